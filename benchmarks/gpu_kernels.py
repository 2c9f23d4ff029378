"""One script for a lent GPU: kernel correctness against float64, then every variant timed.

    PYTHONPATH=src python benchmarks/gpu_kernels.py --out $OUT [--numel 268435456]

1. Correctness (1 Mi elements, bf16 and fp32 inputs): the Triton encode gives the same
   codes as the torch reference (differences only at rounding ties under Hadamard), and
   the decoded values' error against a float64 quantize-dequantize stays within
   half a quantization step.
2. Speed: ``bench_codecs`` on CUDA (copy roofline, torch.compile reference, every
   codec), and ``dequant_reduce_requant`` (k = 4 chunks, 8 → 4 bits) in GB/s.
Writes ``gpu_kernels.json`` under --out; its numbers go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from commpress.bench.codecs import bench_codecs  # noqa: E402
from commpress.bench.timing import median_seconds  # noqa: E402
from commpress.kernels import reference as ref  # noqa: E402
from commpress.kernels import triton_quant as tq  # noqa: E402

CONFIGS = [(4, 128, 0), (8, 128, 0), (4, 128, 128), (8, 128, 128), (2, 128, 0), (4, 2048, 0)]


def check(n: int) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n, device="cuda").to(dtype)
        for bits, group, had in CONFIGS:
            c_ref, s_ref = ref.quantize(x, bits=bits, group=group, hadamard=had)
            c_tri, s_tri = tq.quantize(x, bits=bits, group=group, hadamard=had)
            q_ref, q_tri = ref.unpack_codes(c_ref, bits), ref.unpack_codes(c_tri, bits)
            d = tq.dequantize(c_tri, s_tri, n, bits=bits, group=group, hadamard=had,
                              out_dtype=torch.float32)
            # float64 oracle: the rotated values, their scales, half a step each
            y = x.double()
            if had:
                y = (y.view(-1, had) @ ref.hadamard_pm1(had, "cuda").double()).view(-1)
            step = s_tri.double().repeat_interleave(group)
            y_hat = ref.dequantize_rotated(c_tri, s_tri, bits=bits, group=group).double()
            rows.append({"dtype": str(dtype), "bits": bits, "group": group, "hadamard": had,
                         "codes_equal_frac": float((q_ref == q_tri).double().mean()),
                         "max_code_diff": int((q_ref - q_tri).abs().max()),
                         "max_err_over_half_step": float(((y - y_hat).abs() / (step / 2))
                                                         .nan_to_num(0).max()),
                         "rel_err": float((d.double() - x.double()).norm() / x.double().norm())})
    return rows


def drr_speed(numel: int) -> dict:
    k, chunk = 4, numel // 4
    enc = [ref.quantize_rotated(torch.randn(chunk, device="cuda"), bits=8, group=128,
                                scale_dtype=torch.float32, keys=None) for _ in range(k)]
    codes = torch.stack([e[0] for e in enc])
    scales = torch.stack([e[1] for e in enc])
    fn = lambda: tq.dequant_reduce_requant(codes, scales, bits_in=8, group_in=128,  # noqa: E731
                                           bits_out=4, group_out=128)
    t = median_seconds(fn, torch.device("cuda"), iters=20)
    moved = codes.numel() + scales.numel() * 4 + chunk * (0.5 + 4 / 128)
    return {"k": k, "chunk": chunk, "GBps": moved / t / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--numel", type=int, default=256 * 2**20)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "correctness": check(1 << 20)}
    print(json.dumps(result["correctness"], indent=1), flush=True)
    rows = bench_codecs(device="cuda", numel=args.numel, dtype=torch.bfloat16, iters=20)
    result["codecs"] = [r.__dict__ for r in rows]
    result["dequant_reduce_requant"] = drr_speed(args.numel)
    with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r.codec:24s} enc {r.encode_GBps:8.0f} dec {r.decode_GBps:8.0f} "
              f"(copy {r.copy_GBps:.0f}, ref {r.ref_encode_GBps} / {r.ref_decode_GBps}) GB/s")
    print(result["dequant_reduce_requant"])


if __name__ == "__main__":
    main()
