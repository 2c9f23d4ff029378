"""Triton kernels of int2's ternary codes packed five per byte (3⁵ = 243 ≤ 256): see
:func:`commpress.kernels.reference.trits_quantize`.

Packing and unpacking are products, not loops over the five trits of a byte: byte ``b``
of a group is ``Σ_i (q[5b + i] + 1)·3^i``, one ``tl.dot`` with a constant (GROUP, NBP)
matrix, and each element's byte comes back by a product with a 0/1 selection matrix.
Trits, powers of 3 and bytes (≤ 242) are exact in bf16, so both run on tensor cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from commpress.kernels.reference import scale_floor, trit_bytes
from commpress.kernels.triton_launch import Decode, Encode, dot_precision, matrix_dtype
from commpress.kernels.triton_tiles import (
    dot,
    levels_tile,
    load_rotated,
    scale_and_unrotate,
    store_decoded,
)


@triton.jit
def _trits_quantize_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, w_ptr, numel, total, k1, k2,
                           GROUP: tl.constexpr, HAD: tl.constexpr, TILE: tl.constexpr,
                           NB: tl.constexpr, NBP: tl.constexpr, STOCHASTIC: tl.constexpr,
                           SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr,
                           DOT: tl.constexpr, PACK_DOT: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    y = load_rotated(x_ptr, h_ptr, base, numel, HAD, TILE, DOT)
    q, scale = levels_tile(y, base, k1, k2, TILE, 2, GROUP, STOCHASTIC, SCALE_FP16, FLOOR)
    # five trits per byte: byte b of a group is Σ_i (q[5b + i] + 1)·3^i, one product
    # with the (GROUP, NBP) matrix W[j, b] = 3^(j − 5b) for 0 ≤ j − 5b < 5
    j = tl.arange(0, GROUP)
    W = tl.load(w_ptr + j[:, None] * NBP + tl.arange(0, NBP)[None, :])
    packed = dot(q + 1.0, W, PACK_DOT).to(tl.int32).to(tl.uint8)  # (TILE / GROUP, NBP)
    rows = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    cols = tl.arange(0, NBP)
    mask = (cols[None, :] < NB) & (rows[:, None] < total // GROUP)
    tl.store(codes_ptr + rows[:, None] * NB + cols[None, :], packed, mask=mask)
    tl.store(scales_ptr + rows, scale.to(scales_ptr.dtype.element_ty), mask=rows < total // GROUP)


@triton.jit
def _trits_dequantize_kernel(codes_ptr, scales_ptr, h_ptr, s_ptr, p_ptr, out_ptr, numel, total,
                             GROUP: tl.constexpr, HAD: tl.constexpr, TILE: tl.constexpr,
                             NB: tl.constexpr, NBP: tl.constexpr, DOT: tl.constexpr,
                             FP32_DOT: tl.constexpr, OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    cols = tl.arange(0, NBP)
    mask = (cols[None, :] < NB) & (rows[:, None] < total // GROUP)
    packed = tl.load(codes_ptr + rows[:, None] * NB + cols[None, :], mask=mask, other=0)
    # every element's byte, by a product with the selection S[b, j] = (j // 5 == b),
    # then its trit: (byte // 3^(j % 5)) % 3
    j = tl.arange(0, GROUP)
    S = tl.load(s_ptr + cols[:, None] * GROUP + j[None, :])
    byte = dot(packed.to(tl.float32), S, DOT).to(tl.int32)  # (TILE / GROUP, GROUP)
    q = ((byte // tl.load(p_ptr + j)[None, :]) % 3 - 1).to(tl.float32)
    scale = tl.load(scales_ptr + rows, mask=rows < total // GROUP, other=0.0).to(tl.float32)
    y = scale_and_unrotate(q, scale, h_ptr, TILE, GROUP, HAD, DOT, FP32_DOT)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    store_decoded(out_ptr, offs, y, numel, OUT_MAX)


@functools.cache
def _trit_matrices(group: int, dtype: torch.dtype,
                   device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(W, S, powers, NB, NBP) of the trit kernels: W packs a group's trits into bytes,
    S selects each element's byte, powers are 3^(j % 5); NB bytes per group, NBP the
    next power of two (≥ 16, as tl.dot asks)."""
    nb = trit_bytes(group)
    nbp = max(16, 1 << (nb - 1).bit_length())
    j = torch.arange(group)
    w = torch.zeros(group, nbp)
    w[j, j // 5] = 3.0 ** (j % 5).float()
    sel = torch.zeros(nbp, group)
    sel[j // 5, j] = 1.0
    powers = (3 ** (j % 5)).to(torch.int32)
    return (w.to(device, dtype).contiguous(), sel.to(device, dtype).contiguous(),
            powers.to(device), nb, nbp)


def trits_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                   scale_dtype: torch.dtype = torch.float32,
                   keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`commpress.kernels.reference.trits_quantize`."""
    e = Encode.of("trits_quantize", x, 2, group, hadamard)
    groups = e.total // group
    codes = torch.empty(groups * trit_bytes(group), dtype=torch.uint8, device=x.device)
    scales = torch.empty(groups, dtype=scale_dtype, device=x.device)
    if e.grid:
        k1, k2 = keys if keys is not None else (0, 0)
        # trits and powers of 3 are exact in bf16, whatever the input's dtype
        pack = dot_precision(True, e.cfg)
        w, _, _, nb, nbp = _trit_matrices(group, matrix_dtype(pack, torch.bfloat16),
                                          str(x.device))
        _trits_quantize_kernel[e.grid](
            e.flat, codes, scales, e.h, w, e.flat.numel(), e.total, k1, k2, GROUP=group,
            HAD=hadamard, TILE=e.cfg.tile, NB=nb, NBP=nbp, STOCHASTIC=keys is not None,
            SCALE_FP16=scale_dtype == torch.float16, FLOOR=scale_floor(scale_dtype),
            DOT=e.dot, PACK_DOT=pack, num_warps=e.cfg.warps,
        )
    return codes, scales


def trits_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                     hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.trits_dequantize`."""
    d = Decode.of("trits_dequantize", 2, numel, group, hadamard, out_dtype, out, codes.device)
    # selection matrix and bytes (≤ 242) are exact in the dot's dtype too
    _, sel, powers, nb, nbp = _trit_matrices(group, d.h.dtype, str(codes.device))
    if d.grid:
        _trits_dequantize_kernel[d.grid](
            codes, scales, d.h, sel, powers, d.out, numel, d.total, GROUP=group, HAD=hadamard,
            TILE=d.cfg.tile, NB=nb, NBP=nbp, DOT=d.dot, FP32_DOT=d.fp32_dot,
            OUT_MAX=d.out_max, num_warps=d.cfg.warps,
        )
    return d.out
