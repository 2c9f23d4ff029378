"""Triton kernels: fused Hadamard + quantize + pack, unpack + dequantize + inverse
Hadamard, and dequantize-reduce-requantize.

Each kernel follows :mod:`commpress.kernels.reference` exactly (same padding, same
offset-binary packing, same ``floor(y + 0.5)`` / counter-hash rounding, same
non-finite rule), so the reference is its oracle. One program handles a tile of
``ROWS × WIDTH`` elements, ``WIDTH = max(group, hadamard)``; the Hadamard rotation is
one ``tl.dot`` of the tile, viewed as ``(ROWS·WIDTH/h, h)``, with the ±1 matrix built
in registers (exact in bf16/fp16; 1/h is applied as a power of two).

Written for Triton 3.6 (the GPU machine) and 3.9 (pinned for CI, interpreter mode).
Under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands is wrong, so the interpreter
path casts dot operands to fp32 (the ``DOT_FP32`` constexpr).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from commpress.kernels.reference import padded_numel, qmax_for_bits, scale_floor

# The tile must give tl.dot at least 16 rows; 4096 elements per program keeps the
# interpreter quick on CPU and is a reasonable untuned start on the GPU.
TILE_ELEMENTS = 4096


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(bits: int, group: int, hadamard: int) -> bool:
    """Whether these kernels handle a configuration (else the caller uses the reference)."""
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if bits not in (2, 4, 8) or not pow2(group) or group < 8 // bits:
        return False
    if hadamard and (not pow2(hadamard) or hadamard < 16):
        return False
    return max(group, hadamard) <= TILE_ELEMENTS


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    return x


@triton.jit
def _hadamard_pm1(H: tl.constexpr):
    i = tl.arange(0, H)[:, None]
    j = tl.arange(0, H)[None, :]
    p = i & j
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return (1 - 2 * (p & 1)).to(tl.float32)


@triton.jit
def _rotate(x, TILE: tl.constexpr, HAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """``x`` (TILE,) → blocks of HAD times the ±1 Hadamard matrix, fp32 out."""
    Hm = _hadamard_pm1(HAD)
    xb = tl.reshape(x, (TILE // HAD, HAD))
    if DOT_FP32:
        y = tl.dot(xb.to(tl.float32), Hm, input_precision="ieee")
    else:
        y = tl.dot(xb, Hm.to(xb.dtype))
    return tl.reshape(y, (TILE,))


@triton.jit
def _quantize_tile(y, base, k1, k2, TILE: tl.constexpr, BITS: tl.constexpr,
                   GROUP: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                   FLOOR: tl.constexpr):
    """Quantize fp32 ``y`` (TILE,) in groups; return (packed bytes, scales)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    PER_BYTE: tl.constexpr = 8 // BITS
    g = tl.reshape(y, (TILE // GROUP, GROUP))
    ok = tl.abs(g) < float("inf")  # False for NaN and ±Inf
    bad = tl.max(tl.where(ok, 0, 1), axis=1) > 0
    absmax = tl.max(tl.where(ok, tl.abs(g), 0.0), axis=1)
    scale = tl.div_rn(absmax, QMAX * 1.0)
    if SCALE_FP16:
        scale = tl.minimum(scale, 65504.0)  # saturate, as the reference does
        s16 = scale.to(tl.float16)
        up = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
        scale = tl.where(s16.to(tl.float32) < scale, up, s16).to(tl.float32)
    scale = tl.where(absmax > 0, tl.maximum(scale, FLOOR), scale)
    safe = tl.where(scale > 0, scale, 1.0)  # no 1/0 computed for all-zero groups
    inv = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe), 0.0)
    v = g * inv[:, None]
    if STOCHASTIC:
        idx = (base + tl.arange(0, TILE)).to(tl.uint32)
        h = _hash32(_hash32(idx ^ k1.to(tl.uint32)) ^ k2.to(tl.uint32))
        u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
        v = v + tl.reshape(u, (TILE // GROUP, GROUP))
    else:
        v = v + 0.5
    q = tl.minimum(tl.maximum(tl.floor(v), -QMAX * 1.0), QMAX * 1.0)
    q = tl.where(bad[:, None], 0.0, q)
    codes = (q.to(tl.int32) + (1 << (BITS - 1)))
    codes = tl.reshape(codes, (TILE // PER_BYTE, PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(codes << shifts[None, :], axis=1).to(tl.uint8)
    scale = tl.where(bad, float("nan"), scale)
    return packed, scale


@triton.jit
def _dequantize_tile(packed, scale, TILE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Unpack bytes (TILE·BITS/8,) and scale per group; fp32 (TILE,) in the rotated domain."""
    PER_BYTE: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER_BYTE) * BITS
    u = (packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(u - (1 << (BITS - 1)), (TILE // GROUP, GROUP)).to(tl.float32)
    return _saturate(tl.reshape(q * scale[:, None], (TILE,)))


@triton.jit
def _saturate(v):
    """±Inf (an overflow: non-finite groups decode to NaN, which passes) → ±FP32_MAX."""
    big = tl.where(v > 0, 3.4028234663852886e38, -3.4028234663852886e38)
    return tl.where(tl.abs(v) == float("inf"), big, v)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, numel, total, k1, k2,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                     TILE: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                     FLOOR: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    offs = base + tl.arange(0, TILE)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    if HAD > 1:
        # finite inputs saturate at ±FP32_MAX / (2·HAD): x·H cannot overflow
        xf = x.to(tl.float32)
        BOUND: tl.constexpr = 3.4028234663852886e38 / (2 * HAD)
        xf = tl.where(tl.abs(xf) < float("inf"), tl.minimum(tl.maximum(xf, -BOUND), BOUND),
                      xf)
        y = _rotate(xf.to(x.dtype), TILE, HAD, DOT_FP32)
    else:
        y = x.to(tl.float32)
    packed, scale = _quantize_tile(y, base, k1, k2, TILE, BITS, GROUP, STOCHASTIC,
                                   SCALE_FP16, FLOOR)
    NBYTES: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    tl.store(codes_ptr + boffs, packed, mask=boffs < total * BITS // 8)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    tl.store(scales_ptr + goffs, scale.to(scales_ptr.dtype.element_ty), mask=goffs < total // GROUP)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, numel, total,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                       TILE: tl.constexpr, DOT_FP32: tl.constexpr, OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    NBYTES: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    packed = tl.load(codes_ptr + boffs, mask=boffs < total * BITS // 8, other=0)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    scale = tl.load(scales_ptr + goffs, mask=goffs < total // GROUP, other=0.0).to(tl.float32)
    y = _dequantize_tile(packed, scale, TILE, BITS, GROUP)
    if HAD > 1:  # scale first: ŷ·H alone could overflow
        y = _rotate(y * (1.0 / HAD), TILE, HAD, True)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    if OUT_MAX > 0:  # saturate finite values to the output dtype (see reference.saturate)
        finite = tl.abs(y) < float("inf")
        y = tl.where(finite, tl.minimum(tl.maximum(y, -OUT_MAX), OUT_MAX), y)
    y = y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + offs, y, mask=offs < numel)


@triton.jit
def _dequant_reduce_requant_kernel(codes_ptr, scales_ptr, out_codes_ptr, out_scales_ptr,
                                   k, chunk, k1, k2,
                                   BITS_IN: tl.constexpr, GROUP_IN: tl.constexpr,
                                   BITS_OUT: tl.constexpr, GROUP_OUT: tl.constexpr,
                                   TILE: tl.constexpr, STOCHASTIC: tl.constexpr,
                                   SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    NB_IN: tl.constexpr = TILE * BITS_IN // 8
    boffs = pid.to(tl.int64) * NB_IN + tl.arange(0, NB_IN)
    goffs = pid.to(tl.int64) * (TILE // GROUP_IN) + tl.arange(0, TILE // GROUP_IN)
    bmask = boffs < chunk * BITS_IN // 8
    gmask = goffs < chunk // GROUP_IN
    acc = tl.zeros((TILE,), dtype=tl.float32)
    for i in range(k):
        packed = tl.load(codes_ptr + i * (chunk * BITS_IN // 8) + boffs, mask=bmask, other=0)
        scale = tl.load(scales_ptr + i * (chunk // GROUP_IN) + goffs, mask=gmask, other=0.0)
        acc += _dequantize_tile(packed, scale.to(tl.float32), TILE, BITS_IN, GROUP_IN)
    acc = _saturate(acc)  # an overflowed sum must not re-encode as a non-finite group
    packed, scale = _quantize_tile(acc, base, k1, k2, TILE, BITS_OUT, GROUP_OUT, STOCHASTIC,
                                   SCALE_FP16, FLOOR)
    NB_OUT: tl.constexpr = TILE * BITS_OUT // 8
    ooffs = pid.to(tl.int64) * NB_OUT + tl.arange(0, NB_OUT)
    tl.store(out_codes_ptr + ooffs, packed, mask=ooffs < chunk * BITS_OUT // 8)
    soffs = pid.to(tl.int64) * (TILE // GROUP_OUT) + tl.arange(0, TILE // GROUP_OUT)
    tl.store(out_scales_ptr + soffs, scale.to(out_scales_ptr.dtype.element_ty),
             mask=soffs < chunk // GROUP_OUT)


def _tile(*widths: int) -> int:
    return max(TILE_ELEMENTS, *widths)


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
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    numel = flat.numel()
    total = padded_numel(numel, bits, group, hadamard)
    codes = torch.empty(total * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(total // group, dtype=scale_dtype, device=x.device)
    if total == 0:
        return codes, scales
    tile = _tile(group, hadamard)
    k1, k2 = keys if keys is not None else (0, 0)
    dot_fp32 = interpreting() or flat.dtype == torch.float32
    _quantize_kernel[(triton.cdiv(total, tile),)](
        flat, codes, scales, numel, total, k1, k2,
        BITS=bits, GROUP=group, HAD=hadamard, TILE=tile, STOCHASTIC=keys is not None,
        SCALE_FP16=scale_dtype == torch.float16, FLOOR=scale_floor(scale_dtype),
        DOT_FP32=dot_fp32,
    )
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
    total = padded_numel(numel, bits, group, hadamard)
    if out is None:
        out = torch.empty(numel, dtype=out_dtype, device=codes.device)
    if numel == 0:
        return out
    tile = _tile(group, hadamard)
    _dequantize_kernel[(triton.cdiv(total, tile),)](
        codes, scales, out, numel, total,
        BITS=bits, GROUP=group, HAD=hadamard, TILE=tile, DOT_FP32=True,
        OUT_MAX=0.0 if out.dtype == torch.float32 else torch.finfo(out.dtype).max,
    )
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
    tile = _tile(group_in, group_out)
    k1, k2 = keys if keys is not None else (0, 0)
    _dequant_reduce_requant_kernel[(triton.cdiv(chunk, tile),)](
        codes.contiguous(), scales.contiguous(), out_codes, out_scales, k, chunk, k1, k2,
        BITS_IN=bits_in, GROUP_IN=group_in, BITS_OUT=bits_out, GROUP_OUT=group_out,
        TILE=tile, STOCHASTIC=keys is not None, SCALE_FP16=scale_dtype == torch.float16,
        FLOOR=scale_floor(scale_dtype),
    )
    return out_codes, out_scales


__all__ = ["dequant_reduce_requant", "dequantize", "quantize", "qmax_for_bits", "supports"]
