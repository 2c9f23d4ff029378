"""Triton kernels of the two-level collectives' middle step: ``k`` encoded chunks
decoded and summed in fp32 — then re-encoded (dequantize-reduce-requantize), or rotated
back once (dequantize-sum, TLq-HS step 5) — in one pass over the codes.

As for the integer codes, the row kernels (a group per row; equal groups in and out, or
groups equal to the Hadamard block) and the flat-tile kernels give the same bytes,
chosen by ``KernelConfig.row_kernels``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from commpress.kernels.config import resolve
from commpress.kernels.reference import scale_floor
from commpress.kernels.triton_int import dequantize_tile, quantize_rows, quantize_tile, unpack_rows
from commpress.kernels.triton_launch import dot_precision, hadamard_matrix, rows_per_program
from commpress.kernels.triton_tiles import dot, load_hadamard, rotate, row_offsets, saturate


@triton.jit
def _sum_chunk_rows(codes_ptr, scales_ptr, groups, k, chunk, BITS: tl.constexpr,
                    GROUP: tl.constexpr):
    """Groups ``groups`` of ``k`` encoded chunks (rows of ``chunk`` elements), decoded and
    summed in fp32 in chunk order: (len(groups), GROUP), as :func:`_sum_chunks`."""
    boffs = row_offsets(groups, GROUP * BITS // 8)
    bmask = boffs < chunk * BITS // 8
    gmask = groups < chunk // GROUP
    acc = tl.zeros((groups.shape[0], GROUP), dtype=tl.float32)
    for i in range(k):
        packed = tl.load(codes_ptr + i * (chunk * BITS // 8) + boffs, mask=bmask, other=0)
        scale = tl.load(scales_ptr + i * (chunk // GROUP) + groups, mask=gmask, other=0.0)
        acc += saturate(unpack_rows(packed, BITS).to(tl.float32)
                        * scale.to(tl.float32)[:, None])
    return acc


@triton.jit
def _dequant_reduce_requant_rows_kernel(codes_ptr, scales_ptr, out_codes_ptr, out_scales_ptr,
                                        k, chunk, k1, k2, BITS_IN: tl.constexpr,
                                        BITS_OUT: tl.constexpr, GROUP: tl.constexpr,
                                        ROWS: tl.constexpr, STOCHASTIC: tl.constexpr,
                                        SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    """:func:`_dequant_reduce_requant_kernel` for equal groups in and out: a group per row."""
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    acc = saturate(_sum_chunk_rows(codes_ptr, scales_ptr, groups, k, chunk, BITS_IN, GROUP))
    quantize_rows(acc, pid.to(tl.int64) * (ROWS * GROUP), groups, out_codes_ptr,
                  out_scales_ptr, chunk, k1, k2, BITS_OUT, STOCHASTIC, SCALE_FP16, FLOOR)


@triton.jit
def _dequantize_sum_rows_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, k, chunk,
                                BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                                ROWS: tl.constexpr, DOT: tl.constexpr):
    """:func:`_dequantize_sum_kernel` for groups equal to the Hadamard block (or no
    rotation): a group per row."""
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    acc = _sum_chunk_rows(codes_ptr, scales_ptr, groups, k, chunk, BITS, GROUP)
    if HAD > 1:
        acc = dot(acc * (1.0 / HAD), load_hadamard(h_ptr, HAD), DOT)
    offs = row_offsets(groups, GROUP)
    tl.store(out_ptr + offs, acc, mask=offs < chunk)


@triton.jit
def _sum_chunks(codes_ptr, scales_ptr, pid, k, chunk, BITS: tl.constexpr, GROUP: tl.constexpr,
                TILE: tl.constexpr):
    """Tile ``pid`` of ``k`` encoded chunks (rows of ``chunk`` elements), decoded and
    summed in fp32 in row order: fp32 ``(TILE,)`` in the rotated domain."""
    NB: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NB + tl.arange(0, NB)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    bmask = boffs < chunk * BITS // 8
    gmask = goffs < chunk // GROUP
    acc = tl.zeros((TILE,), dtype=tl.float32)
    for i in range(k):
        packed = tl.load(codes_ptr + i * (chunk * BITS // 8) + boffs, mask=bmask, other=0)
        scale = tl.load(scales_ptr + i * (chunk // GROUP) + goffs, mask=gmask, other=0.0)
        acc += dequantize_tile(packed, scale.to(tl.float32), TILE, BITS, GROUP)
    return acc


@triton.jit
def _dequantize_sum_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, k, chunk,
                           BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                           TILE: tl.constexpr, DOT: tl.constexpr):
    """TLq-HS step 5 in one pass: decode ``k`` chunks, sum in the rotated domain, rotate
    the sum back once (an fp32 product of precision ``DOT``: the sum is no longer
    integer)."""
    pid = tl.program_id(0)
    acc = _sum_chunks(codes_ptr, scales_ptr, pid, k, chunk, BITS, GROUP, TILE)
    if HAD > 1:
        acc = rotate(acc * (1.0 / HAD), load_hadamard(h_ptr, HAD), TILE, HAD, DOT)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    tl.store(out_ptr + offs, acc, mask=offs < chunk)


@triton.jit
def _dequant_reduce_requant_kernel(codes_ptr, scales_ptr, out_codes_ptr, out_scales_ptr,
                                   k, chunk, k1, k2,
                                   BITS_IN: tl.constexpr, GROUP_IN: tl.constexpr,
                                   BITS_OUT: tl.constexpr, GROUP_OUT: tl.constexpr,
                                   TILE: tl.constexpr, STOCHASTIC: tl.constexpr,
                                   SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    acc = _sum_chunks(codes_ptr, scales_ptr, pid, k, chunk, BITS_IN, GROUP_IN, TILE)
    acc = saturate(acc)  # an overflowed sum must not re-encode as a non-finite group
    packed, scale = quantize_tile(acc, base, k1, k2, TILE, BITS_OUT, GROUP_OUT, STOCHASTIC,
                                  SCALE_FP16, FLOOR)
    NB_OUT: tl.constexpr = TILE * BITS_OUT // 8
    ooffs = pid.to(tl.int64) * NB_OUT + tl.arange(0, NB_OUT)
    tl.store(out_codes_ptr + ooffs, packed, mask=ooffs < chunk * BITS_OUT // 8)
    soffs = pid.to(tl.int64) * (TILE // GROUP_OUT) + tl.arange(0, TILE // GROUP_OUT)
    tl.store(out_scales_ptr + soffs, scale.to(out_scales_ptr.dtype.element_ty),
             mask=soffs < chunk // GROUP_OUT)


def dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group: int,
                   hadamard: int = 0) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.dequantize_sum`: ``k`` chunks
    (rows) decoded and summed in row order, rotated back once → ``(chunk,)`` fp32."""
    k, nbytes = codes.shape
    chunk = nbytes * 8 // bits
    out = torch.empty(chunk, dtype=torch.float32, device=codes.device)
    if chunk == 0 or k == 0:
        return out.zero_()
    cfg = resolve("dequantize_sum", bits, group, hadamard, codes.device)
    precision = dot_precision(False, cfg)  # the sum is no longer integer
    h = hadamard_matrix(hadamard, torch.float32, codes.device)
    codes, scales = codes.contiguous(), scales.contiguous()
    if cfg.row_kernels and hadamard in (0, group):
        rows = rows_per_program(cfg.tile, group, dot=hadamard > 0)
        _dequantize_sum_rows_kernel[(triton.cdiv(chunk, rows * group),)](
            codes, scales, h, out, k, chunk, BITS=bits, GROUP=group, HAD=hadamard, ROWS=rows,
            DOT=precision, num_warps=cfg.warps)
    else:
        _dequantize_sum_kernel[(triton.cdiv(chunk, cfg.tile),)](
            codes, scales, h, out, k, chunk, BITS=bits, GROUP=group, HAD=hadamard,
            TILE=cfg.tile, DOT=precision, num_warps=cfg.warps)
    return out


def dequant_reduce_requant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits_in: int,
    group_in: int,
    bits_out: int,
    group_out: int,
    scale_dtype: torch.dtype = torch.float32,
    keys: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`commpress.kernels.reference.dequant_reduce_requant`."""
    k, nbytes = codes.shape
    chunk = nbytes * 8 // bits_in
    out_codes = torch.empty(chunk * bits_out // 8, dtype=torch.uint8, device=codes.device)
    out_scales = torch.empty(chunk // group_out, dtype=scale_dtype, device=codes.device)
    if chunk == 0:
        return out_codes, out_scales
    cfg = resolve("dequant_reduce_requant", bits_in, max(group_in, group_out), 0, codes.device)
    k1, k2 = keys if keys is not None else (0, 0)
    codes, scales = codes.contiguous(), scales.contiguous()
    common = dict(STOCHASTIC=keys is not None, SCALE_FP16=scale_dtype == torch.float16,
                  FLOOR=scale_floor(scale_dtype), num_warps=cfg.warps)
    if cfg.row_kernels and group_in == group_out:
        rows = rows_per_program(cfg.tile, group_in, dot=False)
        _dequant_reduce_requant_rows_kernel[(triton.cdiv(chunk, rows * group_in),)](
            codes, scales, out_codes, out_scales, k, chunk, k1, k2, BITS_IN=bits_in,
            BITS_OUT=bits_out, GROUP=group_in, ROWS=rows, **common)
    else:
        _dequant_reduce_requant_kernel[(triton.cdiv(chunk, cfg.tile),)](
            codes, scales, out_codes, out_scales, k, chunk, k1, k2, BITS_IN=bits_in,
            GROUP_IN=group_in, BITS_OUT=bits_out, GROUP_OUT=group_out, TILE=cfg.tile, **common)
    return out_codes, out_scales
