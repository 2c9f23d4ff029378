"""One script for a lent GPU: kernel correctness against float64, then every variant timed.

    PYTHONPATH=src python benchmarks/gpu_kernels.py --out $OUT [--numel 268435456] [--tune]

1. Correctness (1 Mi elements, bf16 and fp32 inputs): the Triton encode gives the same
   codes as the torch reference (differences only at rounding ties under Hadamard), and
   the decoded values' error against a float64 quantize-dequantize stays within
   half a quantization step.
2. Speed: ``bench_codecs`` on CUDA (copy roofline, torch.compile reference, every
   codec), and ``dequant_reduce_requant`` (k = 4 chunks, 8 → 4 bits) in GB/s.
3. ``--tune``: every (tile, warps) candidate of the quantize, dequantize and
   dequantize-reduce-requantize kernels, with registers and spills per compiled
   kernel where Triton reports them; prints the best as the ``CONFIGS`` table of
   ``commpress/kernels/triton_quant.py``.
Every row is printed and appended to ``gpu_kernels.jsonl`` under --out as it finishes
(a timeout keeps the finished rows); its numbers go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

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


TUNE_CONFIGS = [(4, 128, 128), (8, 128, 128), (4, 128, 0), (8, 128, 0), (2, 128, 0),
                (4, 2048, 0)]
TUNE_TILES = [2048, 4096, 8192, 16384]
TUNE_WARPS = [4, 8]


def _resources(jit_fn) -> list[dict]:
    """Registers and spills of every compiled variant, where this Triton reports them."""
    out = []
    try:
        for cache in getattr(jit_fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for key, ck in kernels.items():
                out.append({"key": str(key)[:120], "n_regs": getattr(ck, "n_regs", None),
                            "n_spills": getattr(ck, "n_spills", None)})
    except Exception as e:  # noqa: BLE001 - introspection only
        out.append({"error": repr(e)})
    return out


def tune(numel: int, emit) -> None:
    dev = torch.device("cuda")
    x = torch.randn(numel, device=dev).to(torch.bfloat16)
    best: dict[tuple, tuple[float, int, int]] = {}
    for bits, group, had in TUNE_CONFIGS:
        codes, scales = tq.quantize(x, bits=bits, group=group, hadamard=had)
        out = torch.empty_like(x)
        moved = x.numel() * 2 + codes.numel() + scales.numel() * 4
        for tile in TUNE_TILES:
            for warps in TUNE_WARPS:
                for kernel, fn in (
                        ("quantize", partial(tq.quantize, x, bits=bits, group=group,
                                             hadamard=had)),
                        ("dequantize", partial(tq.dequantize, codes, scales, numel, bits=bits,
                                               group=group, hadamard=had, out=out))):
                    tq.CONFIGS[(kernel, bits, group, had)] = (tile, warps)
                    try:
                        gbps = moved / median_seconds(fn, dev, iters=10) / 1e9
                    except Exception as e:  # noqa: BLE001 - a candidate that fails to compile
                        emit({"tune": kernel, "bits": bits, "group": group, "hadamard": had,
                              "tile": tile, "warps": warps, "error": repr(e)[:200]})
                        continue
                    emit({"tune": kernel, "bits": bits, "group": group, "hadamard": had,
                          "tile": tile, "warps": warps, "GBps": gbps})
                    key = (kernel, bits, group, had)
                    if gbps > best.get(key, (0.0, 0, 0))[0]:
                        best[key] = (gbps, tile, warps)
                tq.CONFIGS.pop(("quantize", bits, group, had), None)
                tq.CONFIGS.pop(("dequantize", bits, group, had), None)
    emit({"resources_quantize": _resources(tq._quantize_kernel),
          "resources_dequantize": _resources(tq._dequantize_kernel)})
    print("CONFIGS = {")
    for key, (gbps, tile, warps) in sorted(best.items()):
        print(f"    {key!r}: ({tile}, {warps}),  # {gbps:.0f} GB/s")
    print("}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--numel", type=int, default=256 * 2**20)
    ap.add_argument("--tune", action="store_true")
    args = ap.parse_args()
    log_path = os.path.join(args.out, "gpu_kernels.jsonl")

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__})
    for row in check(1 << 20):
        emit(row)
    for r in bench_codecs(device="cuda", numel=args.numel, dtype=torch.bfloat16, iters=20,
                          progress=lambda msg: print(f"... {msg}", flush=True)):
        emit(r.__dict__)
    emit({"dequant_reduce_requant": drr_speed(args.numel)})
    if args.tune:
        tune(min(args.numel, 64 * 2**20), emit)


if __name__ == "__main__":
    main()
