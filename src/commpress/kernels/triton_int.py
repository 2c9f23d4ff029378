"""Triton kernels of the integer codes (int8/int4/int2, offset-binary packed): fused
Hadamard + quantize + pack, and unpack + dequantize + inverse Hadamard.

Two families give the same bytes, chosen by ``KernelConfig.row_kernels``: the flat-tile
kernels (one program per ``tile`` elements, the rotation one ``tl.dot`` of the tile
viewed as ``(tile / h, h)``) and the row kernels (a group or Hadamard block per row of
the tile from load to store, no reshapes; where groups are whole blocks). Both stay
until the GPU measurements choose.

Why the decode rotates *integer* codes: when every Hadamard block lies inside one group
(``group % h == 0``, the case of every preset) the codes are rotated before scaling,
``x̂ = scale · (q · H) / h``, where ``q · H`` is exact in bf16 on tensor cores (see
``triton_launch.dot_precision``) and so still equals the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from commpress.kernels.reference import scale_floor
from commpress.kernels.triton_launch import Decode, Encode, rows_per_program
from commpress.kernels.triton_tiles import (
    dot,
    group_levels,
    levels_tile,
    load_hadamard,
    load_rotated,
    row_offsets,
    saturate,
    saturate_for_rotation,
    scale_and_unrotate,
    store_decoded,
)


@triton.jit
def quantize_tile(y, base, k1, k2, TILE: tl.constexpr, BITS: tl.constexpr,
                  GROUP: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                  FLOOR: tl.constexpr):
    """Quantize fp32 ``y`` (TILE,) in groups; return (packed bytes, scales)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    q, scale = levels_tile(y, base, k1, k2, TILE, BITS, GROUP, STOCHASTIC, SCALE_FP16, FLOOR)
    codes = (q.to(tl.int32) + (1 << (BITS - 1)))
    codes = tl.reshape(codes, (TILE // PER_BYTE, PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(codes << shifts[None, :], axis=1).to(tl.uint8)
    return packed, scale


@triton.jit
def unpack_tile(packed, TILE: tl.constexpr, BITS: tl.constexpr):
    """Bytes (TILE·BITS/8,) → signed integer codes (TILE,), int32."""
    PER_BYTE: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER_BYTE) * BITS
    u = (packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)
    return tl.reshape(u - (1 << (BITS - 1)), (TILE,))


@triton.jit
def dequantize_tile(packed, scale, TILE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Unpack bytes (TILE·BITS/8,) and scale per group; fp32 (TILE,) in the rotated domain."""
    q = tl.reshape(unpack_tile(packed, TILE, BITS), (TILE // GROUP, GROUP)).to(tl.float32)
    return saturate(tl.reshape(q * scale[:, None], (TILE,)))


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, numel, total, k1, k2,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                     TILE: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                     FLOOR: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    y = load_rotated(x_ptr, h_ptr, base, numel, HAD, TILE, DOT)
    packed, scale = quantize_tile(y, base, k1, k2, TILE, BITS, GROUP, STOCHASTIC,
                                  SCALE_FP16, FLOOR)
    NBYTES: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    tl.store(codes_ptr + boffs, packed, mask=boffs < total * BITS // 8)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    tl.store(scales_ptr + goffs, scale.to(scales_ptr.dtype.element_ty), mask=goffs < total // GROUP)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, numel, total,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                       TILE: tl.constexpr, DOT: tl.constexpr, FP32_DOT: tl.constexpr,
                       OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    NBYTES: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    packed = tl.load(codes_ptr + boffs, mask=boffs < total * BITS // 8, other=0)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    scale = tl.load(scales_ptr + goffs, mask=goffs < total // GROUP, other=0.0).to(tl.float32)
    q = tl.reshape(unpack_tile(packed, TILE, BITS), (TILE // GROUP, GROUP)).to(tl.float32)
    y = scale_and_unrotate(q, scale, h_ptr, TILE, GROUP, HAD, DOT, FP32_DOT)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    store_decoded(out_ptr, offs, y, numel, OUT_MAX)


@triton.jit
def pack_rows(u, BITS: tl.constexpr):
    """Offset codes ``u`` (rows, W) in ``0 … 2**BITS − 1`` → bytes (rows, W·BITS/8), element
    ``j`` of a byte at bits ``j·BITS``: splits of the row, no reshape across rows."""
    ROWS: tl.constexpr = u.shape[0]
    W: tl.constexpr = u.shape[1]
    # one return: Triton types every return of a function alike, taken branch or not
    if BITS == 8:
        packed = u
    elif BITS == 4:
        a, b = tl.split(tl.reshape(u, (ROWS, W // 2, 2)))  # even, odd elements
        packed = a | (b << 4)
    else:
        a, b = tl.split(tl.reshape(u, (ROWS, W // 2, 2)))
        a0, a2 = tl.split(tl.reshape(a, (ROWS, W // 4, 2)))
        a1, a3 = tl.split(tl.reshape(b, (ROWS, W // 4, 2)))
        packed = a0 | (a1 << 2) | (a2 << 4) | (a3 << 6)
    return packed.to(tl.uint8)


@triton.jit
def unpack_rows(packed, BITS: tl.constexpr):
    """Bytes (rows, NB) → signed integer codes (rows, NB·8/BITS), int32: the inverse of
    :func:`pack_rows`, by interleaving the bit fields."""
    v = packed.to(tl.int32)
    if BITS == 4:
        v = tl.interleave(v & 15, v >> 4)
    elif BITS == 2:
        v = tl.interleave(tl.interleave(v & 3, (v >> 4) & 3),
                          tl.interleave((v >> 2) & 3, v >> 6))
    return v - (1 << (BITS - 1))


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, numel, total, k1, k2,
                          BITS: tl.constexpr, HAD: tl.constexpr, ROWS: tl.constexpr,
                          STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                          FLOOR: tl.constexpr, DOT: tl.constexpr):
    """:func:`_quantize_kernel` for group == Hadamard block: each group is one row of the
    tile from load to store (no reshapes between the load, the product and the packing)."""
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = row_offsets(groups, HAD)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    y = dot(saturate_for_rotation(x, HAD), load_hadamard(h_ptr, HAD), DOT)
    quantize_rows(y, pid.to(tl.int64) * (ROWS * HAD), groups, codes_ptr, scales_ptr, total,
                  k1, k2, BITS, STOCHASTIC, SCALE_FP16, FLOOR)


@triton.jit
def quantize_rows(y, base, groups, codes_ptr, scales_ptr, total, k1, k2, BITS: tl.constexpr,
                  STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    """Quantize fp32 groups ``y`` (rows, GROUP) — group indices ``groups``, first element
    at ``base`` — and store their packed codes and scales (``total`` elements in all)."""
    GROUP: tl.constexpr = y.shape[1]
    q, scale = group_levels(y, base, k1, k2, BITS, STOCHASTIC, SCALE_FP16, FLOOR)
    packed = pack_rows(q.to(tl.int32) + (1 << (BITS - 1)), BITS)
    boffs = row_offsets(groups, GROUP * BITS // 8)
    tl.store(codes_ptr + boffs, packed, mask=boffs < total * BITS // 8)
    tl.store(scales_ptr + groups, scale.to(scales_ptr.dtype.element_ty),
             mask=groups < total // GROUP)


@triton.jit
def _dequantize_rows_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, numel, total,
                            BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                            ROWS: tl.constexpr, DOT: tl.constexpr, OUT_MAX: tl.constexpr):
    """:func:`_dequantize_kernel` for groups of whole Hadamard blocks: each block one row
    of the tile; the unscaled codes rotate exactly, then one scale per row."""
    pid = tl.program_id(0)
    blocks = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    boffs = row_offsets(blocks, HAD * BITS // 8)
    packed = tl.load(codes_ptr + boffs, mask=boffs < total * BITS // 8, other=0)
    groups = blocks // (GROUP // HAD)
    scale = tl.load(scales_ptr + groups, mask=groups < total // GROUP, other=0.0)
    y = dot(unpack_rows(packed, BITS).to(tl.float32), load_hadamard(h_ptr, HAD), DOT)
    y = saturate(y * (scale.to(tl.float32) * (1.0 / HAD))[:, None])
    store_decoded(out_ptr, row_offsets(blocks, HAD), y, numel, OUT_MAX)


def quantize(
    x: torch.Tensor,
    *,
    bits: int,
    group: int,
    hadamard: int = 0,
    scale_dtype: torch.dtype = torch.float32,
    keys: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`commpress.kernels.reference.quantize`."""
    e = Encode.of("quantize", x, bits, group, hadamard)
    codes = torch.empty(e.total * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(e.total // group, dtype=scale_dtype, device=x.device)
    if not e.grid:
        return codes, scales
    k1, k2 = keys if keys is not None else (0, 0)
    common = dict(STOCHASTIC=keys is not None, SCALE_FP16=scale_dtype == torch.float16,
                  FLOOR=scale_floor(scale_dtype), DOT=e.dot, num_warps=e.cfg.warps)
    if e.cfg.row_kernels and hadamard and group == hadamard:
        rows = rows_per_program(e.cfg.tile, hadamard)
        _quantize_rows_kernel[(triton.cdiv(e.total, rows * hadamard),)](
            e.flat, codes, scales, e.h, e.flat.numel(), e.total, k1, k2, BITS=bits,
            HAD=hadamard, ROWS=rows, **common)
    else:
        _quantize_kernel[e.grid](e.flat, codes, scales, e.h, e.flat.numel(), e.total, k1, k2,
                                 BITS=bits, GROUP=group, HAD=hadamard, TILE=e.cfg.tile, **common)
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    *,
    bits: int,
    group: int,
    hadamard: int = 0,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.dequantize` (writes ``out`` if given)."""
    d = Decode.of("dequantize", bits, numel, group, hadamard, out_dtype, out, codes.device)
    if d.grid and d.cfg.row_kernels and hadamard and group % hadamard == 0:
        rows = rows_per_program(d.cfg.tile, hadamard)
        _dequantize_rows_kernel[(triton.cdiv(d.total, rows * hadamard),)](
            codes, scales, d.h, d.out, numel, d.total, BITS=bits, GROUP=group, HAD=hadamard,
            ROWS=rows, DOT=d.dot, OUT_MAX=d.out_max, num_warps=d.cfg.warps,
        )
    elif d.grid:
        _dequantize_kernel[d.grid](
            codes, scales, d.h, d.out, numel, d.total, BITS=bits, GROUP=group, HAD=hadamard,
            TILE=d.cfg.tile, DOT=d.dot, FP32_DOT=d.fp32_dot, OUT_MAX=d.out_max,
            num_warps=d.cfg.warps,
        )
    return d.out
