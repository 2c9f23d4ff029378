"""What every Triton launch needs on the host: the resolved :class:`KernelConfig`, the
grid, the ±1 Hadamard matrix in the product's dtype, and the one precision rule of
every ``tl.dot`` (:func:`dot_precision`).

Why the matrix is a tensor in global memory: a kernel that builds the ``h × h`` matrix
in registers and multiplies fp32 values (``q · scale``) with an ieee fp32 dot spills on
an H200 (32 registers per thread, 7.8 GB of local-memory traffic for 42 MB of data:
10 GB/s in ``benchmarks/gpu_kernels.py``). Loaded from memory (cached per device and
dtype) it stays in L2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from commpress.kernels.config import KernelConfig, interpreting, resolve
from commpress.kernels.reference import padded_numel


def dot_precision(exact: bool, cfg: KernelConfig) -> str:
    """How a product runs, the ``DOT`` constexpr of the kernels (one rule for all).

    ``""``: in the matrix's dtype, for operands that dtype holds exactly — ±1 times
    bf16/fp16 inputs, integer codes (|q| ≤ 127), fp8 values, trits and bytes (≤ 242) —
    with fp32 accumulation (|sum| ≤ 127 · 256 < 2²⁴): exact on tensor cores, so it equals
    the reference. Else (fp32 inputs, scaled values, sums) fp32 operands at
    ``cfg.fp32_dot``: "ieee" (CUDA cores, exact fp32 products) or "tf32x3" (about fp32's
    accuracy on tensor cores). The interpreter's bf16 ``tl.dot`` is wrong, so there every
    product is an ieee fp32 one.
    """
    if interpreting():
        return "ieee"
    return "" if exact else cfg.fp32_dot


@functools.cache
def _hadamard_matrix(h: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The ±1 Sylvester matrix as a contiguous (h, h) tensor the kernels load."""
    from commpress.kernels.reference import hadamard_pm1

    return hadamard_pm1(h, device).to(dtype).contiguous()


def hadamard_matrix(h: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # a 1 × 1 placeholder when there is no rotation (the kernels never read it)
    return _hadamard_matrix(max(h, 1), dtype, str(device))


def matrix_dtype(precision: str, exact_dtype: torch.dtype) -> torch.dtype:
    """The dtype a product's constant matrix is stored in: fp32 for an fp32 product,
    else the exact operands' dtype."""
    return torch.float32 if precision else exact_dtype


def rows_per_program(tile: int, width: int, dot: bool = True) -> int:
    """Rows of ``width`` elements in a row kernel's tile: the tile's, at least the 16 a
    ``tl.dot`` needs (one row when there is no product: wide groups stay one row)."""
    return max(tile // width, 16 if dot else 1)


@dataclass
class Encode:
    """What every encoder's launch needs: the flat contiguous input, the padded length,
    grid, configuration, the input rotation's precision and the Hadamard matrix in that
    product's dtype (the input's where ±1 times its values is exact)."""

    flat: torch.Tensor
    total: int
    grid: tuple[int, ...]
    cfg: KernelConfig
    dot: str
    h: torch.Tensor

    @classmethod
    def of(cls, kernel: str, x: torch.Tensor, bits: int, group: int, hadamard: int) -> Encode:
        flat = x.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        total = padded_numel(flat.numel(), bits, group, hadamard)
        cfg = resolve(kernel, bits, group, hadamard, x.device)
        dot = dot_precision(flat.dtype != torch.float32, cfg)
        h = hadamard_matrix(hadamard, matrix_dtype(dot, flat.dtype), x.device)
        grid = (triton.cdiv(total, cfg.tile),) if total else ()
        return cls(flat, total, grid, cfg, dot, h)


@dataclass
class Decode:
    """What every decoder's launch needs: padded length, output, grid, configuration,
    the precisions of the products (``dot``: unscaled codes or fp8 values, exact in bf16;
    ``fp32_dot``: scaled values, where Hadamard blocks span groups), the Hadamard matrix
    in ``dot``'s dtype, and the output's saturation bound."""

    total: int
    out: torch.Tensor
    grid: tuple[int, ...]
    cfg: KernelConfig
    dot: str
    fp32_dot: str
    h: torch.Tensor
    out_max: float

    @classmethod
    def of(cls, kernel: str, bits: int, numel: int, group: int, hadamard: int,
           out_dtype: torch.dtype, out: torch.Tensor | None, device: torch.device) -> Decode:
        total = padded_numel(numel, bits, group, hadamard)
        if out is None:
            out = torch.empty(numel, dtype=out_dtype, device=device)
        cfg = resolve(kernel, bits, group, hadamard, device)
        dot = dot_precision(True, cfg)
        h = hadamard_matrix(hadamard, matrix_dtype(dot, torch.bfloat16), device)
        out_max = 0.0 if out.dtype == torch.float32 else torch.finfo(out.dtype).max
        grid = (triton.cdiv(total, cfg.tile),) if numel else ()
        return cls(total, out, grid, cfg, dot, dot_precision(False, cfg), h, out_max)
