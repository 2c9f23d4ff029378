"""Triton building blocks every kernel family shares: the counter hash of stochastic
rounding, the Hadamard products, group scales and levels, saturation, and the loads and
stores of a tile.

Each follows :mod:`commpress.kernels.reference` exactly (same padding, same
``floor(y + 0.5)`` / counter-hash rounding, same non-finite rule), so the reference is
the oracle of every kernel built from them. Written for Triton 3.6 (the GPU machine)
and 3.9 (pinned for CI, interpreter mode).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    return x


@triton.jit
def load_hadamard(h_ptr, HAD: tl.constexpr):
    """The (HAD, HAD) ±1 matrix from global memory (small; L2 keeps it for every program)."""
    i = tl.arange(0, HAD)
    return tl.load(h_ptr + i[:, None] * HAD + i[None, :])


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """``a @ b``, fp32 out, at precision ``DOT`` (see ``triton_launch.dot_precision``):
    ``""`` multiplies in ``b``'s dtype (for operands it holds exactly), else fp32
    operands at that ``input_precision``."""
    if DOT != "":  # a constexpr str: Triton compiles `if` on bool or int only
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT)
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def rotate(x, Hm, TILE: tl.constexpr, HAD: tl.constexpr, DOT: tl.constexpr):
    """``x`` (TILE,) → blocks of HAD times the ±1 matrix ``Hm``, fp32 out (a :func:`dot`
    of precision ``DOT``)."""
    return tl.reshape(dot(tl.reshape(x, (TILE // HAD, HAD)), Hm, DOT), (TILE,))


@triton.jit
def group_scales(g, MAXCODE: tl.constexpr, SCALE_FP16: tl.constexpr, ROUND_UP: tl.constexpr,
                  FLOOR: tl.constexpr):
    """Per row of ``g`` (groups): whether it holds NaN/±Inf, its scale ``absmax /
    MAXCODE`` (fp16 scales saturate at 65504 and round up or to nearest even; a nonzero
    group's scale is at least ``FLOOR``) and the scale's inverse (0 for a zero scale)."""
    ok = tl.abs(g) < float("inf")  # False for NaN and ±Inf
    bad = tl.max(tl.where(ok, 0, 1), axis=1) > 0
    absmax = tl.max(tl.where(ok, tl.abs(g), 0.0), axis=1)
    scale = tl.div_rn(absmax, MAXCODE)
    if SCALE_FP16:
        scale = tl.minimum(scale, 65504.0)  # saturate, as the reference does
        s16 = scale.to(tl.float16)
        if ROUND_UP:
            up = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
            s16 = tl.where(s16.to(tl.float32) < scale, up, s16)
        scale = s16.to(tl.float32)
    scale = tl.where(absmax > 0, tl.maximum(scale, FLOOR), scale)
    safe = tl.where(scale > 0, scale, 1.0)  # no 1/0 computed for all-zero groups
    inv = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe), 0.0)
    return bad, scale, inv


@triton.jit
def levels_tile(y, base, k1, k2, TILE: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                 FLOOR: tl.constexpr):
    """Quantize fp32 ``y`` (TILE,) in groups; return the codes ``q`` as fp32
    ``(TILE / GROUP, GROUP)`` in ``-QMAX … QMAX`` (0 in a non-finite group) and the
    scales (NaN for a non-finite group)."""
    return group_levels(tl.reshape(y, (TILE // GROUP, GROUP)), base, k1, k2, BITS,
                         STOCHASTIC, SCALE_FP16, FLOOR)


@triton.jit
def group_levels(g, base, k1, k2, BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
                  SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    """:func:`levels_tile` of groups already laid out as rows ``g`` (rows, GROUP), the
    first element at ``base`` (the stochastic rounding's counter)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    ROWS: tl.constexpr = g.shape[0]
    GROUP: tl.constexpr = g.shape[1]
    # fp16 scales round up: no element lands beyond QMAX steps
    bad, scale, inv = group_scales(g, QMAX * 1.0, SCALE_FP16, True, FLOOR)
    v = g * inv[:, None]
    if STOCHASTIC:
        idx = (base + tl.arange(0, ROWS)[:, None] * GROUP
               + tl.arange(0, GROUP)[None, :]).to(tl.uint32)
        # tl.cast, not .to: Triton passes an integer argument equal to 1 as a constant
        h = hash32(hash32(idx ^ tl.cast(k1, tl.uint32)) ^ tl.cast(k2, tl.uint32))
        v = v + (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    else:
        v = v + 0.5
    q = tl.minimum(tl.maximum(tl.floor(v), -QMAX * 1.0), QMAX * 1.0)
    return tl.where(bad[:, None], 0.0, q), tl.where(bad, float("nan"), scale)


@triton.jit
def saturate(v):
    """±Inf (an overflow: non-finite groups decode to NaN, which passes) → ±FP32_MAX."""
    big = tl.where(v > 0, 3.4028234663852886e38, -3.4028234663852886e38)
    return tl.where(tl.abs(v) == float("inf"), big, v)


@triton.jit
def scale_and_unrotate(v, scale, h_ptr, TILE: tl.constexpr, GROUP: tl.constexpr,
                       HAD: tl.constexpr, DOT: tl.constexpr, FP32_DOT: tl.constexpr):
    """Decoded values ``v`` ``(TILE / GROUP, GROUP)`` before scaling (integer codes or
    fp8 values) → fp32 ``(TILE,)``: scaled per group and, with ``HAD``, rotated back
    (a product of precision ``DOT`` for the unscaled values, ``FP32_DOT`` for scaled ones)."""
    if HAD > 1 and GROUP % HAD == 0:
        # every block inside one group: rotate the unscaled values (exact products with
        # bf16 operands), then scale once by scale / HAD
        r = rotate(tl.reshape(v, (TILE,)), load_hadamard(h_ptr, HAD), TILE, HAD, DOT)
        r = tl.reshape(r, (TILE // GROUP, GROUP))
        return saturate(tl.reshape(r * (scale * (1.0 / HAD))[:, None], (TILE,)))
    y = saturate(tl.reshape(v * scale[:, None], (TILE,)))
    if HAD > 1:  # blocks span groups: scale first, then an fp32 product
        y = rotate(y * (1.0 / HAD), load_hadamard(h_ptr, HAD), TILE, HAD, FP32_DOT)
    return y


@triton.jit
def store_decoded(out_ptr, offs, y, numel, OUT_MAX: tl.constexpr):
    """Store fp32 ``y`` in the output's dtype (rounded to nearest even), finite values
    saturated to its range (see ``reference.saturate``)."""
    if OUT_MAX > 0:
        finite = tl.abs(y) < float("inf")
        y = tl.where(finite, tl.minimum(tl.maximum(y, -OUT_MAX), OUT_MAX), y)
    y = y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + offs, y, mask=offs < numel)


@triton.jit
def load_rotated(x_ptr, h_ptr, base, numel, HAD: tl.constexpr, TILE: tl.constexpr,
                  DOT: tl.constexpr):
    """The tile at ``base`` (zero past ``numel``) as fp32, block-rotated when ``HAD > 1``."""
    offs = base + tl.arange(0, TILE)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    if HAD > 1:
        return rotate(saturate_for_rotation(x, HAD), load_hadamard(h_ptr, HAD), TILE, HAD,
                       DOT)
    return x.to(tl.float32)


@triton.jit
def saturate_for_rotation(x, HAD: tl.constexpr):
    """Finite inputs saturated at ±FP32_MAX / (2·HAD), so x·H cannot overflow (in x's dtype)."""
    xf = x.to(tl.float32)
    BOUND: tl.constexpr = 3.4028234663852886e38 / (2 * HAD)
    xf = tl.where(tl.abs(xf) < float("inf"), tl.minimum(tl.maximum(xf, -BOUND), BOUND), xf)
    return xf.to(x.dtype)


@triton.jit
def row_offsets(rows, W: tl.constexpr):
    """Element offsets (len(rows), W) of rows ``rows`` (global indices) of width ``W``."""
    return rows[:, None] * W + tl.arange(0, W)[None, :]
