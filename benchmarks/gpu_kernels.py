"""On a CUDA GPU: kernel correctness against float64, then every variant timed.

    PYTHONPATH=src python benchmarks/gpu_kernels.py --out $OUT [--numel 268435456] [--tune]
    PYTHONPATH=src python benchmarks/gpu_kernels.py --out $OUT --tune-only  # tuning alone
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/gpu_kernels.py --device cpu  # dry run

1. Correctness (1 Mi elements, bf16 and fp32 inputs): the Triton encode gives the same
   codes as the torch reference (differences only at rounding ties under Hadamard), and
   the decoded values' error against a float64 quantize-dequantize stays within
   half a quantization step (int codecs, trits) or the fp8 rounding bound (2⁻⁴ relative);
   the top-k radix select gives the reference's bytes (values, indices, flag).
2. Host path: the public ``codec.encode``/``decode`` on a 4 Mi-element bf16 bucket —
   host µs per call (calls queued without synchronizing) and whether any call
   synchronizes with the host (``torch.cuda.set_sync_debug_mode("error")``).
3. Speed: ``bench_codecs`` on CUDA (copy roofline, torch.compile reference, every
   codec and the cross-site presets' codecs between sites), ``dequant_reduce_requant``
   (k = 4 chunks, 8 → 4 bits) and the fused ``dequantize_sum`` (k = 4 int4 chunks,
   Hadamard 128) in GB/s; fp32 products as "ieee" and "tf32x3"
   (``KernelConfig.fp32_dot``), with their agreement.
4. ``--tune``: every (tile, warps) candidate of the quantize, dequantize, fp8, trits
   and dequantize-reduce-requantize kernels, with registers and spills per compiled
   kernel where Triton reports them; prints the best as the ``TUNED`` table of
   ``commpress/kernels/config.py``; then the top-k select's tile sizes.
Every variant runs under ``override_kernels`` (the row or flat-tile family, tile and
warps, the fp32 product precision), which restores the defaults after it.
Every row is printed and appended to ``gpu_kernels.jsonl`` under --out as it finishes
(a timeout keeps the finished rows); its numbers go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from commpress.bench.codecs import DEFAULT_CPU, DEFAULT_CUDA, bench_codecs  # noqa: E402
from commpress.bench.timing import median_seconds  # noqa: E402
from commpress.codecs import codec as build_codec  # noqa: E402
from commpress.frontends.diloco import OUTER_PRESETS  # noqa: E402
from commpress.kernels import reference as ref  # noqa: E402
from commpress.kernels import triton_int, triton_topk  # noqa: E402
from commpress.kernels import triton_quant as tq  # noqa: E402
from commpress.kernels.config import override_kernels, resolve  # noqa: E402

CONFIGS = [(4, 128, 0), (8, 128, 0), (4, 128, 128), (8, 128, 128), (2, 128, 0), (4, 2048, 0)]
FP8_CONFIGS = [(128, 0), (128, 128), (32, 128)]
TRIT_CONFIGS = [(128, 0), (128, 128)]


def check(n: int, device: str, emit) -> None:
    """One row per (input dtype, codec configuration): Triton against the reference and
    a float64 oracle."""
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n, device=device).to(dtype)
        for fn, configs in ((_check_int, CONFIGS), (_check_fp8, FP8_CONFIGS),
                            (_check_trits, TRIT_CONFIGS)):
            for cfg in configs:
                guarded(emit, f"{fn.__name__}{cfg} {dtype}", partial(_emit_of, emit, fn, x, *cfg))
        for bits in (8, 4, 2):
            guarded(emit, f"rows int{bits} {dtype}",
                    partial(_emit_of, emit, _check_rows_equal_flat, x, bits))
        x[[5, n // 2]] = float("nan")  # non-finite values are selected first and flagged
        x[n - 1] = float("-inf")
        for k in (1, n // 100, n // 2):
            guarded(emit, f"topk k={k} {dtype}", partial(_emit_of, emit, _check_topk, x, k))


def _check_rows_equal_flat(x: torch.Tensor, bits: int, group: int = 128, had: int = 128
                           ) -> dict:
    """The row kernels give the flat-tile kernels' bytes (codes, scales, decoded values)."""
    runs = []
    for rows in (True, False):
        with override_kernels(row_kernels=rows):
            c, s = tq.quantize(x, bits=bits, group=group, hadamard=had)
            runs.append((c, s, tq.dequantize(c, s, x.numel(), bits=bits, group=group,
                                              hadamard=had, out_dtype=x.dtype)))
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*runs)]
    return {"dtype": str(x.dtype), "codec": f"int{bits} rows = flat", "group": group,
            "hadamard": had, "codes_equal": same[0], "scales_equal": same[1],
            "decoded_equal": same[2], "ok": all(same)}


def _check_topk(x: torch.Tensor, k: int) -> dict:
    expected, got = ref.topk_select(x, k), triton_topk.topk_select(x, k)
    same = [torch.equal(e.view(torch.uint8), g.view(torch.uint8))
            for e, g in zip(expected, got)]
    return {"dtype": str(x.dtype), "codec": "topk", "k": k, "values_equal": same[0],
            "indices_equal": same[1], "flag_equal": same[2], "ok": all(same)}


def _emit_of(emit, fn, *args) -> None:
    emit(fn(*args))


def guarded(emit, what: str, fn) -> None:
    """Run one piece; a failure (say, a kernel that does not compile on this GPU) is a
    row with the error, and the script goes on to the next piece."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported as a row, the rest still runs
        emit({"failed": what, "error": f"{type(e).__name__}: {e}"[:400], "ok": False})


def _row(codec: str, x: torch.Tensor, group: int, had: int, codes_equal: torch.Tensor,
         err_over_bound: torch.Tensor, decoded: torch.Tensor, **extra: bool) -> dict:
    """A check row: the share of codes equal to the reference's (the rest at rounding
    ties), the largest error against the float64 oracle in units of its bound (≤ 1
    passes), the decoded values' relative error, and ``ok``."""
    equal = float(codes_equal.double().mean())
    worst = float(err_over_bound.nan_to_num(0).max())
    return {"dtype": str(x.dtype), "codec": codec, "group": group, "hadamard": had,
            "codes_equal_frac": equal, "max_err_over_bound": worst,
            "rel_err": float((decoded.double() - x.double()).norm() / x.double().norm()),
            **extra, "ok": equal > 0.99 and worst <= 1.001 and all(extra.values())}


def _check_int(x: torch.Tensor, bits: int, group: int, had: int) -> dict:
    n = x.numel()
    c_ref, s_ref = ref.quantize(x, bits=bits, group=group, hadamard=had)
    c_tri, s_tri = tq.quantize(x, bits=bits, group=group, hadamard=had)
    q_ref, q_tri = ref.unpack_codes(c_ref, bits), ref.unpack_codes(c_tri, bits)
    d = tq.dequantize(c_tri, s_tri, n, bits=bits, group=group, hadamard=had)
    # float64 oracle: the rotated values within half a step (the group's scale) each
    step = s_tri.double().repeat_interleave(group)
    y_hat = ref.dequantize_rotated(c_tri, s_tri, bits=bits, group=group).double()
    return _row(f"int{bits}", x, group, had, q_ref == q_tri,
                (_rotated64(x, had) - y_hat).abs() / (step / 2), d,
                codes_within_one_step=bool((q_ref - q_tri).abs().max() <= 1))


def _check_fp8(x: torch.Tensor, group: int, had: int) -> dict:
    c_ref, _ = ref.fp8_quantize(x, group=group, hadamard=had)
    c_tri, s_tri = tq.fp8_quantize(x, group=group, hadamard=had)
    d = tq.fp8_dequantize(c_tri, s_tri, x.numel(), group=group, hadamard=had)
    # float64 oracle: e4m3 keeps 4 significant bits, so |y − ŷ| ≤ 2⁻⁴·|y| for normals,
    # and at most half the least subnormal step (2⁻¹⁰·scale) near zero
    y = _rotated64(x, had)
    scale = s_tri.double().repeat_interleave(group)
    y_hat = c_tri.view(torch.float8_e4m3fn).double() * scale
    return _row("fp8", x, group, had, c_ref == c_tri,
                (y - y_hat).abs() / (y.abs() / 16 + scale * 2.0**-10), d)


def _check_trits(x: torch.Tensor, group: int, had: int) -> dict:
    n = x.numel()
    c_ref, _ = ref.trits_quantize(x, group=group, hadamard=had)
    c_tri, s_tri = tq.trits_quantize(x, group=group, hadamard=had)
    d = tq.trits_dequantize(c_tri, s_tri, n, group=group, hadamard=had)
    y = _rotated64(x, had)
    step = s_tri.double().repeat_interleave(group)  # int2: one step = the scale
    q_hat = (ref.trit_values(c_tri, group).double() * step)[:y.numel()]
    extra = {}
    if not had:  # without a rotation the reference decodes the very same values
        extra["decode_equal"] = bool(torch.equal(
            ref.trits_dequantize(c_tri, s_tri, n, group=group, hadamard=0), d))
    return _row("trits", x, group, had, c_ref == c_tri, (y - q_hat).abs() / (step / 2), d,
                **extra)


def _rotated64(x: torch.Tensor, had: int) -> torch.Tensor:
    y = x.double()
    if had:
        y = (y.view(-1, had) @ ref.hadamard_pm1(had, x.device).double()).view(-1)
    return y


HOST_SPECS = ["int4", "int8", "int4:hadamard=128", "int8:hadamard=128", "fp8",
              "int2:packing=trits", "topk:ratio=0.01"]


def host_path(numel: int, device: str, emit, calls: int = 200) -> None:
    """Host µs per public encode/decode call (queued, no synchronize between calls), and
    whether a call synchronizes with the host."""
    dev = torch.device(device)
    x = torch.randn(numel, device=dev).to(torch.bfloat16)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for spec in HOST_SPECS:
        guarded(emit, f"host_path {spec}", partial(_host_row, spec, x, dev, sync, emit, calls))


def _host_row(spec: str, x: torch.Tensor, dev: torch.device, sync, emit, calls: int) -> None:
    c = build_codec(spec)
    packet = c.encode(x)
    row = {"host_path": spec, "numel": x.numel()}
    for what, fn in (("encode", partial(c.encode, x)), ("decode", partial(c.decode, packet))):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        row[f"{what}_host_us"] = (time.perf_counter() - t0) / calls * 1e6
        sync()
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                row[f"{what}_syncs"] = False
            except RuntimeError as e:
                row[f"{what}_syncs"] = str(e)[:160]
            finally:
                torch.cuda.set_sync_debug_mode("default")
    emit(row)


def outer_codecs(listed: list[str]) -> list[str]:
    """The cross-site presets' codecs between sites that the codec table lacks."""
    specs = [p["outer"]["grad"]["inter"] for p in OUTER_PRESETS.values() if p["outer"]]
    specs = [s["codec"] if isinstance(s, dict) else s for s in specs]
    return [s for s in dict.fromkeys(specs) if s not in listed]


def drr_speed(numel: int, device: str = "cuda") -> dict:
    k, chunk = 4, numel // 4
    enc = [ref.quantize_rotated(torch.randn(chunk, device=device), bits=8, group=128,
                                scale_dtype=torch.float32, keys=None) for _ in range(k)]
    codes = torch.stack([e[0] for e in enc])
    scales = torch.stack([e[1] for e in enc])
    fn = lambda: tq.dequant_reduce_requant(codes, scales, bits_in=8, group_in=128,  # noqa: E731
                                           bits_out=4, group_out=128)
    t = median_seconds(fn, torch.device(device), iters=20)
    with override_kernels(row_kernels=False):
        t_flat = median_seconds(fn, torch.device(device), iters=20)
    moved = codes.numel() + scales.numel() * 4 + chunk * (0.5 + 4 / 128)
    # TLq-HS step 5: k int4 chunks (Hadamard-128 domain) decoded, summed, rotated back
    enc4 = [ref.quantize_rotated(torch.randn(chunk, device=device), bits=4, group=128,
                                 scale_dtype=torch.float32, keys=None) for _ in range(k)]
    c4, s4 = torch.stack([e[0] for e in enc4]), torch.stack([e[1] for e in enc4])
    fn4 = partial(tq.dequantize_sum, c4, s4, bits=4, group=128, hadamard=128)
    t4 = median_seconds(fn4, torch.device(device), iters=20)
    with override_kernels(row_kernels=False):
        t4_flat = median_seconds(fn4, torch.device(device), iters=20)

    def unfused() -> torch.Tensor:  # what ran before the fused kernel: decode, sum, rotate
        y = tq.dequantize(c4.reshape(-1), s4.reshape(-1), k * chunk, bits=4, group=128)
        return ref.unrotate(ref.sum_rows(y.view(k, chunk)), chunk, hadamard=128,
                            out_dtype=torch.float32)

    t4u = median_seconds(unfused, torch.device(device), iters=20)
    moved4 = c4.numel() + s4.numel() * 4 + chunk * 4
    return {"k": k, "chunk": chunk, "GBps": moved / t / 1e9,
            "GBps_flat_tile": moved / t_flat / 1e9,
            "dequantize_sum_int4_h128_GBps": moved4 / t4 / 1e9,
            "dequantize_sum_int4_h128_flat_tile_GBps": moved4 / t4_flat / 1e9,
            "dequantize_sum_unfused_GBps": moved4 / t4u / 1e9}


def fp32_dot_speed(numel: int, device: str, emit) -> None:
    """fp32 operands' products ("ieee" on CUDA cores or "tf32x3" on tensor cores; see
    ``KernelConfig.fp32_dot``): the int8 Hadamard-128 encode of fp32 gradients (what the
    sharded optimizer's TLq-HS encodes) and the fused decode-sum, GB/s and agreement."""
    dev = torch.device(device)
    x = torch.randn(numel, device=dev)
    c_ref, _ = ref.quantize(x[: 1 << 20], bits=8, group=128, hadamard=128)
    k, chunk = 4, numel // 4
    enc = [ref.quantize_rotated(torch.randn(chunk, device=dev), bits=4, group=128,
                                scale_dtype=torch.float32, keys=None) for _ in range(k)]
    c4, s4 = torch.stack([e[0] for e in enc]), torch.stack([e[1] for e in enc])
    want = ref.dequantize_sum(c4[:, : 1 << 19], s4[:, : (1 << 20) // 128], bits=4, group=128,
                              hadamard=128)
    for precision in ("ieee", "tf32x3"):
        with override_kernels(fp32_dot=precision):
            t_enc = median_seconds(partial(tq.quantize, x, bits=8, group=128, hadamard=128),
                                   dev, iters=20)
            t_sum = median_seconds(partial(tq.dequantize_sum, c4, s4, bits=4, group=128,
                                           hadamard=128), dev, iters=20)
            c, _ = tq.quantize(x[: 1 << 20], bits=8, group=128, hadamard=128)
            got = tq.dequantize_sum(c4[:, : 1 << 19], s4[:, : (1 << 20) // 128], bits=4,
                                    group=128, hadamard=128)
        codes_equal = float((ref.unpack_codes(c, 8) == ref.unpack_codes(c_ref, 8)).double()
                            .mean())
        rel = float((got - want).abs().max() / want.abs().max())
        emit({"fp32_dot": precision,
              "encode_int8_h128_fp32_GBps": numel * 4.0 * (1 + 1 / 4 + 1 / 128) / t_enc / 1e9,
              "dequantize_sum_int4_h128_GBps": (c4.numel() + s4.numel() * 4 + chunk * 4)
              / t_sum / 1e9,
              "codes_equal_frac": codes_equal, "sum_max_rel_err": rel,
              "ok": codes_equal > 0.99 and rel < 1e-5})


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


def tune(numel: int, emit, device: str = "cuda") -> None:
    dev = torch.device(device)
    x = torch.randn(numel, device=dev).to(torch.bfloat16)
    best: dict[tuple, tuple[float, int, int]] = {}
    for bits, group, had in TUNE_CONFIGS:
        codes, scales = tq.quantize(x, bits=bits, group=group, hadamard=had)
        out = torch.empty_like(x)
        moved = x.numel() * 2 + codes.numel() + scales.numel() * 4
        for tile in TUNE_TILES:
            for warps in TUNE_WARPS:
                kernels = [("quantize", partial(tq.quantize, x, bits=bits, group=group,
                                                hadamard=had)),
                           ("dequantize", partial(tq.dequantize, codes, scales, numel,
                                                  bits=bits, group=group, hadamard=had,
                                                  out=out))]
                if bits == 2 and tq.supports(2, group, had, trits=True):
                    ct, st = tq.trits_quantize(x, group=group, hadamard=had)
                    kernels += [("trits_quantize", partial(tq.trits_quantize, x, group=group,
                                                           hadamard=had)),
                                ("trits_dequantize", partial(tq.trits_dequantize, ct, st,
                                                             numel, group=group, hadamard=had,
                                                             out=out))]
                if bits == 8:  # fp8 has the int8 kernels' shape: one byte per element
                    c8, s8 = tq.fp8_quantize(x, group=group, hadamard=had)
                    kernels += [("fp8_quantize", partial(tq.fp8_quantize, x, group=group,
                                                         hadamard=had)),
                                ("fp8_dequantize", partial(tq.fp8_dequantize, c8, s8, numel,
                                                           group=group, hadamard=had,
                                                           out=out))]
                for kernel, fn in kernels:
                    # Hadamard int codes: the row kernels and the flat-tile ones
                    for rows in ((True, False) if had and kernel in ("quantize", "dequantize")
                                 else (resolve(kernel, bits, group, had, dev).row_kernels,)):
                        row = {"tune": kernel, "bits": bits, "group": group, "hadamard": had,
                               "tile": tile, "warps": warps, "row_kernels": rows}
                        try:
                            with override_kernels(tile=tile, warps=warps, row_kernels=rows):
                                gbps = moved / median_seconds(fn, dev, iters=10) / 1e9
                        except Exception as e:  # noqa: BLE001 - a candidate that fails
                            emit({**row, "error": repr(e)[:200]})
                            continue
                        emit({**row, "GBps": gbps})
                        key = (kernel, bits, group, had, rows)
                        if gbps > best.get(key, (0.0, 0, 0))[0]:
                            best[key] = (gbps, tile, warps)
    emit({"resources_quantize": _resources(triton_int._quantize_kernel),
          "resources_dequantize": _resources(triton_int._dequantize_kernel)})
    print("TUNED = {  # keep the faster of row_kernels True/False (KernelConfig.row_kernels)")
    for (*key, rows), (gbps, tile, warps) in sorted(best.items()):
        print(f"    {tuple(key)!r}: ({tile}, {warps}),  # {gbps:.0f} GB/s, row_kernels={rows}")
    print("}", flush=True)
    guarded(emit, "tune topk", partial(tune_topk, x, emit))


def tune_topk(x: torch.Tensor, emit) -> None:
    """The radix select's tile (compaction) and tiles per histogram program, 1 % of x;
    GB/s counts the input read once and the selection written."""
    k = x.numel() // 100
    moved = x.numel() * x.element_size() + k * (x.element_size() + 4)
    for tile in (2048, 4096, 8192):
        for tiles in (1, 4, 16):
            for warps in (4, 8):
                with override_kernels(tile=tile, histogram_tiles=tiles, warps=warps):
                    t = median_seconds(partial(triton_topk.topk_select, x, k), x.device,
                                       iters=10)
                emit({"tune": "topk", "tile": tile, "histogram_tiles": tiles,
                      "warps": warps, "GBps": moved / t / 1e9})


def _bench_row(spec: str, device: str, numel: int, iters: int, with_reference: bool,
               emit) -> None:
    for r in bench_codecs([spec], device=device, numel=numel, dtype=torch.bfloat16,
                          iters=iters, with_reference=with_reference,
                          progress=lambda msg: print(f"... {msg}", flush=True)):
        emit(r.__dict__)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--numel", type=int, default=None,
                    help="elements per timed tensor (default: 256 Mi on cuda, 16 Ki on cpu)")
    ap.add_argument("--device", default="cuda",
                    help="cuda; or cpu with TRITON_INTERPRET=1: a dry run on small sizes")
    ap.add_argument("--codecs", nargs="+", default=None,
                    help="codec specs for the codec table, in this order (default: every "
                         "codec, then the cross-site presets' codecs)")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-only", action="store_true",
                    help="skip the checks and speeds (a second run, after one without --tune)")
    args = ap.parse_args()
    small = args.device != "cuda"
    numel = args.numel or (1 << 14 if small else 256 * 2**20)
    log_path = os.path.join(args.out, "gpu_kernels.jsonl")

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    emit({"device": torch.cuda.get_device_name() if not small else "cpu (dry run)",
          "torch": torch.__version__})
    if not args.tune_only:
        check(1 << 12 if small else 1 << 20, args.device, emit)
        host_path(1 << 12 if small else 4 << 20, args.device, emit, calls=5 if small else 200)
        # the two-level pieces and the fp32 products first: the codec table (with its
        # torch.compile references) is the longest part, and a timeout keeps what finished
        guarded(emit, "dequant_reduce_requant",
                lambda: emit({"dequant_reduce_requant": drr_speed(numel, args.device)}))
        guarded(emit, "fp32_dot", partial(fp32_dot_speed, numel, args.device, emit))
        specs = DEFAULT_CPU if small else DEFAULT_CUDA
        specs = args.codecs or specs + outer_codecs(specs)
        for spec in specs:  # one at a time: a failure is a row
            guarded(emit, f"bench {spec}", partial(_bench_row, spec, args.device, numel,
                                                   2 if small else 20, not small, emit))
    if args.tune or args.tune_only:
        tune(min(numel, 64 * 2**20), emit, args.device)


if __name__ == "__main__":
    main()
