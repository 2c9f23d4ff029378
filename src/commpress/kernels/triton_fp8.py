"""Triton kernels of float8 e4m3 values with per-group scales: fused Hadamard + scale +
cast, and the inverse (see :func:`commpress.kernels.reference.fp8_quantize`).

The cast is integer arithmetic, not ``.to(tl.float8e4nv)``: the interpreter's fp8 cast
rounds wrongly across binades (124.4 → 64), so the kernel could not be tested on CPU.
fp8 values times ±1 are exact in bf16, so the decode rotates them before scaling, as
the integer codes' decode does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from commpress.kernels.reference import scale_floor
from commpress.kernels.triton_launch import Decode, Encode
from commpress.kernels.triton_tiles import (
    group_scales,
    load_rotated,
    scale_and_unrotate,
    store_decoded,
)


@triton.jit
def _fp8_bits(v):
    """fp32 (finite, |v| ≤ 448) → float8 e4m3fn bits, rounded to nearest even as torch's
    cast does. Integer arithmetic, not ``.to(tl.float8e4nv)``: the interpreter's fp8 cast
    rounds wrongly across binades (124.4 → 64), so the kernel could not be tested on CPU."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = bits & 0x7FFFFFFF
    # normal (|v| ≥ 2⁻⁶): round the fp32 mantissa to 3 bits (a carry bumps the exponent),
    # then rebias the exponent from 127 to 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20).to(tl.int32) - (120 << 3)
    # subnormal: multiples of 2⁻⁹, rounded half to even (8 is the least normal, code 8)
    t = tl.abs(v) * 512.0
    f = tl.floor(t)
    d = t - f
    odd = (f.to(tl.int32) & 1) == 1
    sub = (f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)).to(tl.int32)
    mag = tl.where(a < 0x3C800000, sub, normal)  # 0x3C800000 = 2⁻⁶
    return (mag | sign.to(tl.int32)).to(tl.uint8)


@triton.jit
def _fp8_value(c):
    """float8 e4m3fn bits (int32) → fp32 value (0x7F/0xFF: NaN)."""
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * (1.0 / 512.0), normal)
    v = tl.where((e == 15) & (m == 7), float("nan"), v)
    return tl.where((c >> 7) == 1, -v, v)


@triton.jit
def _fp8_quantize_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, numel, total,
                         GROUP: tl.constexpr, HAD: tl.constexpr, TILE: tl.constexpr,
                         SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr,
                         DOT: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    y = load_rotated(x_ptr, h_ptr, base, numel, HAD, TILE, DOT)
    g = tl.reshape(y, (TILE // GROUP, GROUP))
    # fp16 scales round to nearest even, as the reference's cast does
    bad, scale, inv = group_scales(g, 448.0, SCALE_FP16, False, FLOOR)
    v = tl.minimum(tl.maximum(g * inv[:, None], -448.0), 448.0)
    codes = tl.where(bad[:, None], 0, _fp8_bits(tl.where(bad[:, None], 0.0, v)))
    offs = base + tl.arange(0, TILE)
    tl.store(codes_ptr + offs, tl.reshape(codes, (TILE,)), mask=offs < total)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    scale = tl.where(bad, float("nan"), scale)
    tl.store(scales_ptr + goffs, scale.to(scales_ptr.dtype.element_ty), mask=goffs < total // GROUP)


@triton.jit
def _fp8_dequantize_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, numel, total,
                           GROUP: tl.constexpr, HAD: tl.constexpr, TILE: tl.constexpr,
                           DOT: tl.constexpr, FP32_DOT: tl.constexpr, OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    c = tl.load(codes_ptr + offs, mask=offs < total, other=0).to(tl.int32)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    scale = tl.load(scales_ptr + goffs, mask=goffs < total // GROUP, other=0.0).to(tl.float32)
    # fp8 values times ±1 are exact products in bf16, as integer codes are
    vals = tl.reshape(_fp8_value(c), (TILE // GROUP, GROUP))
    y = scale_and_unrotate(vals, scale, h_ptr, TILE, GROUP, HAD, DOT, FP32_DOT)
    store_decoded(out_ptr, offs, y, numel, OUT_MAX)


def fp8_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`commpress.kernels.reference.fp8_quantize`."""
    e = Encode.of("fp8_quantize", x, 8, group, hadamard)
    codes = torch.empty(e.total, dtype=torch.uint8, device=x.device)
    scales = torch.empty(e.total // group, dtype=scale_dtype, device=x.device)
    if e.grid:
        _fp8_quantize_kernel[e.grid](
            e.flat, codes, scales, e.h, e.flat.numel(), e.total, GROUP=group, HAD=hadamard,
            TILE=e.cfg.tile, SCALE_FP16=scale_dtype == torch.float16,
            FLOOR=scale_floor(scale_dtype), DOT=e.dot, num_warps=e.cfg.warps,
        )
    return codes, scales


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                   hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.fp8_dequantize` (writes ``out``
    if given)."""
    d = Decode.of("fp8_dequantize", 8, numel, group, hadamard, out_dtype, out, codes.device)
    if d.grid:
        _fp8_dequantize_kernel[d.grid](
            codes, scales, d.h, d.out, numel, d.total, GROUP=group, HAD=hadamard,
            TILE=d.cfg.tile, DOT=d.dot, FP32_DOT=d.fp32_dot, OUT_MAX=d.out_max,
            num_warps=d.cfg.warps,
        )
    return d.out
