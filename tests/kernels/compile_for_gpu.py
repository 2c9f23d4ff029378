"""Compile every Triton kernel family for an H100/H200 (sm_90) on a machine with no GPU.

    python -m tests.kernels.compile_for_gpu     # prints one line per kernel, exit 1 on a failure

Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels on CPU) never
compiles them, so it accepts code the compiler refuses: an ``if`` on a constexpr string,
returns of different shapes in one function, an integer argument that Triton passes as a
constant because it equals 1, a product whose matrix outgrows shared memory. This runs
the real compiler (Triton's front end, its NVIDIA back end and ``ptxas``) through a
driver that reports an sm_90 target and launches nothing, so the kernels' host code runs
to the end and each kernel it launches is compiled and checked against the GPU's shared
memory. Run without ``TRITON_INTERPRET``; tests start it as a separate process.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

# an H200's limits, as the CUDA driver reports them
SM90 = GPUTarget("cuda", 90, 32)
SHARED_MEMORY = 232448


class _NoGPU:
    """The driver utilities a compiled kernel asks for when it is loaded."""

    def __init__(self) -> None:
        self.compiled: list[str] = []

    def load_binary(self, name, kernel, shared, device):
        self.compiled.append(name)
        return None, None, 0, 0, 1024  # module, function, registers, spills, threads

    def get_device_properties(self, device):
        return {"max_shared_mem": SHARED_MEMORY, "multiprocessor_count": 132,
                "max_num_regs": 65536, "warpSize": 32, "max_threads_per_block": 1024}


class CompileOnlyDriver(DriverBase):
    """Compiles for :data:`SM90`; a launch does nothing (outputs stay as allocated)."""

    def __init__(self) -> None:
        self.utils = _NoGPU()
        self.launcher_cls = lambda src, metadata: (lambda *args, **kwargs: None)

    @classmethod
    def is_active(cls) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return SM90

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass  # one pretend device: nothing to switch

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError("compile only")

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("compile only")

    def get_empty_cache_for_benchmark(self):
        raise NotImplementedError("compile only")

    def clear_cache(self, cache) -> None:
        pass  # nothing runs, so no cache to clear between timings


def _cases():
    """One call per kernel family and product precision: (the choices to override, a
    name, the call)."""
    from commpress.kernels import reference as ref
    from commpress.kernels import triton_chunk_topk, triton_topk
    from commpress.kernels import triton_quant as tq

    n = 1 << 14
    bf16, fp32 = torch.randn(n).to(torch.bfloat16), torch.randn(n)
    key_one = (1, 7)  # Triton passes an integer argument equal to 1 as a constant
    c4, s4 = ref.quantize(fp32, bits=4, group=128, hadamard=128)
    c64, s64 = ref.quantize(fp32, bits=4, group=64, hadamard=128)  # blocks span groups
    c8, s8 = ref.fp8_quantize(fp32, group=128, hadamard=128)
    ct, st = ref.trits_quantize(fp32, group=128, hadamard=0)
    chunks = [ref.quantize_rotated(torch.randn(n // 4), bits=8, group=128,
                                   scale_dtype=torch.float32, keys=None) for _ in range(4)]
    cc, sc = torch.stack([c for c, _ in chunks]), torch.stack([s for _, s in chunks])
    for rows in (True, False):
        family = "rows" if rows else "flat"
        choice = {"row_kernels": rows}
        yield choice, f"quantize int4 h128 bf16 stochastic {family}", lambda: tq.quantize(
            bf16, bits=4, group=128, hadamard=128, scale_dtype=torch.float16, keys=key_one)
        yield choice, f"quantize int2 h128 fp32 {family}", lambda: tq.quantize(
            fp32, bits=2, group=128, hadamard=128)
        yield choice, f"dequantize int4 h128 {family}", lambda: tq.dequantize(
            c4, s4, n, bits=4, group=128, hadamard=128, out_dtype=torch.bfloat16)
        yield choice, f"dequant_reduce_requant 8->4 {family}", lambda: tq.dequant_reduce_requant(
            cc, sc, bits_in=8, group_in=128, bits_out=4, group_out=128)
        yield choice, f"dequantize_sum int8 h128 {family}", lambda: tq.dequantize_sum(
            cc, sc, bits=8, group=128, hadamard=128)
    yield None, "dequantize int4 group 64 h128", lambda: tq.dequantize(
        c64, s64, n, bits=4, group=64, hadamard=128)
    yield None, "fp8 quantize h128", lambda: tq.fp8_quantize(bf16, group=128, hadamard=128)
    yield None, "fp8 dequantize h128", lambda: tq.fp8_dequantize(c8, s8, n, group=128,
                                                                 hadamard=128)
    yield None, "trits quantize stochastic", lambda: tq.trits_quantize(
        fp32, group=128, hadamard=0, keys=key_one)
    yield None, "trits dequantize", lambda: tq.trits_dequantize(ct, st, n, group=128,
                                                               hadamard=0)
    yield None, "topk", lambda: triton_topk.topk_select(bf16, n // 100)
    yield None, "chunk topk 4096/64 2-bit bf16", lambda: triton_chunk_topk.chunk_topk_select(
        bf16, chunk=4096, k=64, bits=2, sigmas=6.0)
    yield None, "chunk topk 8192/128 4-bit fp32", lambda: triton_chunk_topk.chunk_topk_select(
        fp32, chunk=8192, k=128, bits=4, sigmas=6.0)
    yield from _tuned_cases(n)


def _tuned_cases(n: int):
    """Each configuration of the H200's TUNED table, compiled with its choices (on the
    CPU tensors here :func:`~commpress.kernels.config.resolve` would not apply them), for
    bf16 and fp32 values in and out (fp32 operands take the ``fp32_dot`` products)."""
    from commpress.kernels import reference as ref
    from commpress.kernels import triton_quant as tq
    from commpress.kernels.config import TUNED

    chunks = lambda bits, group: [ref.quantize_rotated(  # noqa: E731
        torch.randn(n // 4), bits=bits, group=group, scale_dtype=torch.float32, keys=None)
        for _ in range(4)]
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n).to(dtype)
        calls = {
            "quantize": lambda b, g, h, x=x: tq.quantize(x, bits=b, group=g, hadamard=h),
            "dequantize": lambda b, g, h, x=x: tq.dequantize(
                *ref.quantize(x, bits=b, group=g, hadamard=h), n, bits=b, group=g,
                hadamard=h, out_dtype=x.dtype),
            "fp8_quantize": lambda b, g, h, x=x: tq.fp8_quantize(x, group=g, hadamard=h),
            "fp8_dequantize": lambda b, g, h, x=x: tq.fp8_dequantize(
                *ref.fp8_quantize(x, group=g, hadamard=h), n, group=g, hadamard=h,
                out_dtype=x.dtype),
            "trits_quantize": lambda b, g, h, x=x: tq.trits_quantize(x, group=g, hadamard=h),
            "trits_dequantize": lambda b, g, h, x=x: tq.trits_dequantize(
                *ref.trits_quantize(x, group=g, hadamard=h), n, group=g, hadamard=h,
                out_dtype=x.dtype),
            "dequantize_sum": lambda b, g, h, x=x: tq.dequantize_sum(
                *(torch.stack(t) for t in zip(*chunks(b, g))), bits=b, group=g, hadamard=h),
            "dequant_reduce_requant": lambda b, g, h, x=x: tq.dequant_reduce_requant(
                *(torch.stack(t) for t in zip(*chunks(8, g))), bits_in=8, group_in=g,
                bits_out=b, group_out=g),
        }
        name = str(dtype).removeprefix("torch.")
        for (kernel, bits, group, had), choices in TUNED.items():
            if kernel in ("dequant_reduce_requant", "dequantize_sum") and dtype != torch.float32:
                continue  # codes in; codes or fp32 out: no value dtype to vary
            yield dict(choices), f"{kernel} int{bits} group {group} h{had} {name} as tuned", (
                lambda call=calls[kernel], bits=bits, group=group, had=had:
                call(bits, group, had))


def main() -> int:
    driver = CompileOnlyDriver()
    triton.runtime.driver.set_active(driver)
    from commpress.kernels.config import override_kernels

    failures = 0
    for choices, name, call in _cases():
        before = len(driver.utils.compiled)
        try:
            with override_kernels(kernels="triton", **(choices or {})):
                call()
        except Exception as e:  # noqa: BLE001 - each failure is a line, the rest still run
            failures += 1
            root = e
            while root.__cause__ is not None or root.__context__ is not None:
                root = root.__cause__ or root.__context__
            print(f"FAILED {name}: {type(root).__name__}: {str(root)[-600:]}", flush=True)
            continue
        print(f"compiled {name}: {', '.join(driver.utils.compiled[before:])}", flush=True)
    print(f"triton {triton.__version__}, sm_90: {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
