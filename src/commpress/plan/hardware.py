"""Hardware defaults for the cost model, each with its source.

GPU peak dense bf16/fp16 tensor TFLOPS (vendor datasheets):
  V100 SXM2 125 (NVIDIA V100 datasheet), A100 SXM 312 (A100 datasheet),
  H100 SXM 989 (H100 datasheet), H200 SXM 989 (H200 datasheet; same compute as H100).

Links, GB/s per direction:
  NVLink: V100 NVLink 2.0 150 per GPU (300 GB/s bidirectional, V100 datasheet);
  A100 NVLink 3.0 300 (600 bidirectional); H100/H200 NVLink 4.0 450 (900 bidirectional).
  InfiniBand per port: EDR 100 Gb/s = 12.5, HDR 200 Gb/s = 25, NDR 400 Gb/s = 50.
  HPE Slingshot-10 100 Gb/s = 12.5; Slingshot-11 200 Gb/s = 25 per NIC.
  A node's injection bandwidth is NICs × per-NIC: e.g. a DGX H100 with 8 NDR NICs has
  400 GB/s; Perlmutter (4 × A100, 4 × Slingshot-11) 100; Lassen (4 × V100, 2 × EDR) 25.
Latency: 2 µs for NVLink hops and 5 µs for one network message (typical MPI/NCCL
small-message latencies; override with --latency).
"""

from __future__ import annotations

GPUS: dict[str, dict[str, float]] = {
    "v100": {"tflops": 125.0, "nvlink_GBps": 150.0},
    "a100": {"tflops": 312.0, "nvlink_GBps": 300.0},
    "h100": {"tflops": 989.0, "nvlink_GBps": 450.0},
    "h200": {"tflops": 989.0, "nvlink_GBps": 450.0},
}

NETWORKS_GBps: dict[str, float] = {
    "edr": 12.5, "hdr": 25.0, "ndr": 50.0, "slingshot-10": 12.5, "slingshot-11": 25.0,
}

INTRA_LATENCY_US = 2.0
INTER_LATENCY_US = 5.0

# Codec throughput defaults, GB/s of bytes read + written, used when no
# ``commpress bench codecs --json`` file is given. GPU: the untuned fused Triton
# kernel measured on an H200 (DESIGN.md, ~2500 GB/s) for int codecs, memory copies for
# casts. CPU: measured on the 2-core development machine (BENCHMARKS.md).
CODEC_GBps: dict[str, dict[str, float]] = {
    "gpu": {"int": 2500.0, "cast": 3000.0, "fp8": 1500.0, "topk": 100.0, "other": 200.0},
    "cpu": {"int": 2.0, "cast": 50.0, "fp8": 2.0, "topk": 1.0, "other": 0.3},
}
