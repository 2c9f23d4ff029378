"""Hardware defaults for the cost model, each with its source.

GPU peak dense bf16/fp16 tensor TFLOPS (vendor datasheets):
  V100 SXM2 125 (NVIDIA V100 datasheet; the CCGrid paper's Lassen), A100 SXM 312 (A100
  datasheet; SDP4Bit's Slingshot-10 cluster), H100 SXM 989 (H100 datasheet), H800 SXM
  989 (the export H100: same compute, NVLink cut to 400 GB/s bidirectional; SDP4Bit's
  InfiniBand cluster), H200 SXM 989 (H200 datasheet; same compute as H100).

Links, GB/s per direction:
  NVLink: V100 NVLink 2.0 150 per GPU (300 GB/s bidirectional, V100 datasheet);
  A100 NVLink 3.0 300 (600 bidirectional); H100/H200 NVLink 4.0 450 (900
  bidirectional); H800 200 (400 bidirectional).
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
    "h800": {"tflops": 989.0, "nvlink_GBps": 200.0},
    "h200": {"tflops": 989.0, "nvlink_GBps": 450.0},
}

NETWORKS_GBps: dict[str, float] = {
    "edr": 12.5, "hdr": 25.0, "ndr": 50.0, "slingshot-10": 12.5, "slingshot-11": 25.0,
}

INTRA_LATENCY_US = 2.0
INTER_LATENCY_US = 5.0

# Codec throughput defaults, (encode, decode) GB/s of bytes read + written, used when no
# ``commpress bench codecs --json`` file is given. GPU: the Triton kernels measured on an
# H200 with benchmarks/gpu_kernels.py (BENCHMARKS.md, "On the GPU (H200)"): int8/int4/
# int2 group 128, fp8, top-1 % and casts (the device-to-device copy) on 256 Mi bf16
# elements; int with Hadamard-128 and trits on 64 Mi at their tuned tiles, Hadamard's
# decode at the gradient paths' fused decode-and-sum (545; a plain decode ran 1141).
# "other" (zfp, sign, nf2: eager torch or host libraries) was not measured: a guess,
# labelled so. CPU: measured on the 2-core development machine (BENCHMARKS.md, "Codecs
# on the CPU").
CODEC_GBps: dict[str, dict[str, tuple[float, float]]] = {
    "gpu": {"int8": (2597.0, 3688.0), "int4": (2116.0, 2862.0), "int2": (1463.0, 2292.0),
            "int_hadamard": (843.0, 545.0), "trits": (957.0, 887.0), "cast": (3960.0, 3960.0),
            "fp8": (1594.0, 1801.0), "topk": (149.0, 1072.0), "other": (100.0, 100.0)},
    "cpu": {"int8": (10.1, 13.1), "int4": (7.1, 5.7), "int2": (6.1, 6.9),
            "int_hadamard": (2.2, 2.1), "trits": (1.0, 1.0), "cast": (101.5, 102.7),
            "fp8": (1.3, 1.5), "topk": (0.3, 38.0), "other": (0.3, 0.3)},
}
