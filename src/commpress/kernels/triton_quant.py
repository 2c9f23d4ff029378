"""Triton kernels: fused Hadamard + quantize + pack, unpack + dequantize + inverse
Hadamard, and dequantize-reduce-requantize.

Each kernel follows :mod:`commpress.kernels.reference` exactly (same padding, same
offset-binary packing, same ``floor(y + 0.5)`` / counter-hash rounding, same
non-finite rule), so the reference is its oracle. One program handles a tile of
``TILE`` elements (a multiple of the group and of the Hadamard block); the rotation is
one ``tl.dot`` of the tile, viewed as ``(TILE / h, h)``, with the ±1 matrix.

Why the decode is an *integer* product: a kernel that builds the ``h × h`` matrix in
registers and multiplies fp32 values (``q · scale``) with an ieee fp32 dot spills on an
H200 (32 registers per thread, 7.8 GB of local-memory traffic for 42 MB of data: 10 GB/s
in ``benchmarks/gpu_kernels.py``). So the matrix is loaded from global memory (a
``h × h`` tensor, cached per device and dtype: it stays in L2), and when every
Hadamard block lies inside one group (``group % h == 0``, the case of every preset)
the codes are rotated *before* scaling: ``x̂ = scale · (q · H) / h``, where ``q · H`` is
an integer product — exact with bf16 operands (|q| ≤ 127, ±1) and fp32 accumulation
(|sum| ≤ 127 · 256 < 2²⁴), so it runs on tensor cores and still equals the reference.
Encode rotates bf16/fp16 inputs the same exact way; fp32 inputs use the ieee fp32 dot.

Tile sizes and warps come from :data:`CONFIGS` — a table to be filled from
measurements on the H200 (``benchmarks/gpu_kernels.py --tune`` times every candidate
and prints the table); entries not measured use the defaults.

Written for Triton 3.6 (the GPU machine) and 3.9 (pinned for CI, interpreter mode).
Under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands is wrong, so the interpreter
path casts dot operands to fp32. The ``DOT_FP32`` constexpr says how a product runs: ``""``
in the matrix's dtype (exact for bf16 inputs and integer codes: tensor cores), else an
fp32 product of that ``input_precision`` — ``"ieee"`` (the CUDA cores), or
``"tf32x3"`` (three tf32 tensor-core products, about fp32's accuracy), chosen for fp32
operands by :data:`FP32_DOT`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from commpress.kernels.reference import padded_numel, qmax_for_bits, scale_floor, trit_bytes

# The tile must give tl.dot at least 16 rows; 4096 elements per program keeps the
# interpreter quick on CPU and is the untuned start on the GPU.
TILE_ELEMENTS = 4096
DEFAULT_WARPS = 4
# (kernel, bits, group, hadamard) → (tile elements, warps), measured on the H200 with
# ``benchmarks/gpu_kernels.py --tune``; not yet measured, so empty (defaults apply).
CONFIGS: dict[tuple[str, int, int, int], tuple[int, int]] = {}
# How fp32 operands multiply in tl.dot on the GPU: "ieee" (CUDA cores) or "tf32x3" (three
# tf32 tensor-core products, about fp32's accuracy); not yet measured on the H200, which
# ``benchmarks/gpu_kernels.py`` times both ways. The interpreter always runs "ieee".
FP32_DOT = "ieee"


def fp32_dot() -> str:
    return "ieee" if interpreting() else FP32_DOT


# Hadamard codes with groups of whole blocks, and the two-level pieces with equal groups,
# run the row kernels (a group or block per row of the tile, no reshapes; the form of
# the 2500 GB/s prototype); False runs the flat-tile kernels instead, for
# ``benchmarks/gpu_kernels.py`` to time both.
ROW_KERNELS = True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def config(kernel: str, bits: int, group: int, hadamard: int) -> tuple[int, int]:
    """(tile elements, warps) of a kernel for a configuration (measured, else default)."""
    tile, warps = CONFIGS.get((kernel, bits, group, hadamard), (TILE_ELEMENTS, DEFAULT_WARPS))
    if kernel.startswith("trits"):  # tl.dot needs 16 groups per tile
        tile = max(tile, 16 * group)
    return max(tile, group, hadamard), warps


@functools.cache
def _hadamard_matrix(h: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The ±1 Sylvester matrix as a contiguous (h, h) tensor the kernels load."""
    from commpress.kernels.reference import hadamard_pm1

    return hadamard_pm1(h, device).to(dtype).contiguous()


def hadamard_matrix(h: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # a 1 × 1 placeholder when there is no rotation (the kernels never read it)
    return _hadamard_matrix(max(h, 1), dtype, str(device))


def supports(bits: int, group: int, hadamard: int, trits: bool = False) -> bool:
    """Whether these kernels handle a configuration (else the caller uses the reference);
    ``trits``: int2 codes five per byte (groups of 16 … 256)."""
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if bits not in (2, 4, 8) or not pow2(group) or group < 8 // bits:
        return False
    if trits and not (bits == 2 and 16 <= group <= 256):
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
def _load_hadamard(h_ptr, HAD: tl.constexpr):
    """The (HAD, HAD) ±1 matrix from global memory (small; L2 keeps it for every program)."""
    i = tl.arange(0, HAD)
    return tl.load(h_ptr + i[:, None] * HAD + i[None, :])


@triton.jit
def _rotate(x, Hm, TILE: tl.constexpr, HAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """``x`` (TILE,) → blocks of HAD times the ±1 matrix ``Hm``, fp32 out. With
    ``DOT_FP32`` (a precision) an fp32 product, else one in ``Hm``'s dtype (exact for
    values that dtype holds exactly: ±1 times bf16 inputs, or integer codes)."""
    return tl.reshape(_rotate_rows(tl.reshape(x, (TILE // HAD, HAD)), Hm, DOT_FP32), (TILE,))


@triton.jit
def _rotate_rows(xb, Hm, DOT_FP32: tl.constexpr):
    """Rows of ``xb`` (rows, HAD) times ``Hm``, fp32 out (see :func:`_rotate`)."""
    if DOT_FP32:
        return tl.dot(xb.to(tl.float32), Hm.to(tl.float32), input_precision=DOT_FP32)
    return tl.dot(xb.to(Hm.dtype), Hm)


@triton.jit
def _group_scales(g, MAXCODE: tl.constexpr, SCALE_FP16: tl.constexpr, ROUND_UP: tl.constexpr,
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
def _levels_tile(y, base, k1, k2, TILE: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                 FLOOR: tl.constexpr):
    """Quantize fp32 ``y`` (TILE,) in groups; return the codes ``q`` as fp32
    ``(TILE / GROUP, GROUP)`` in ``-QMAX … QMAX`` (0 in a non-finite group) and the
    scales (NaN for a non-finite group)."""
    return _group_levels(tl.reshape(y, (TILE // GROUP, GROUP)), base, k1, k2, BITS,
                         STOCHASTIC, SCALE_FP16, FLOOR)


@triton.jit
def _group_levels(g, base, k1, k2, BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
                  SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    """:func:`_levels_tile` of groups already laid out as rows ``g`` (rows, GROUP), the
    first element at ``base`` (the stochastic rounding's counter)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    ROWS: tl.constexpr = g.shape[0]
    GROUP: tl.constexpr = g.shape[1]
    # fp16 scales round up: no element lands beyond QMAX steps
    bad, scale, inv = _group_scales(g, QMAX * 1.0, SCALE_FP16, True, FLOOR)
    v = g * inv[:, None]
    if STOCHASTIC:
        idx = (base + tl.arange(0, ROWS)[:, None] * GROUP
               + tl.arange(0, GROUP)[None, :]).to(tl.uint32)
        h = _hash32(_hash32(idx ^ k1.to(tl.uint32)) ^ k2.to(tl.uint32))
        v = v + (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    else:
        v = v + 0.5
    q = tl.minimum(tl.maximum(tl.floor(v), -QMAX * 1.0), QMAX * 1.0)
    return tl.where(bad[:, None], 0.0, q), tl.where(bad, float("nan"), scale)


@triton.jit
def _quantize_tile(y, base, k1, k2, TILE: tl.constexpr, BITS: tl.constexpr,
                   GROUP: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                   FLOOR: tl.constexpr):
    """Quantize fp32 ``y`` (TILE,) in groups; return (packed bytes, scales)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    q, scale = _levels_tile(y, base, k1, k2, TILE, BITS, GROUP, STOCHASTIC, SCALE_FP16, FLOOR)
    codes = (q.to(tl.int32) + (1 << (BITS - 1)))
    codes = tl.reshape(codes, (TILE // PER_BYTE, PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(codes << shifts[None, :], axis=1).to(tl.uint8)
    return packed, scale


@triton.jit
def _unpack_tile(packed, TILE: tl.constexpr, BITS: tl.constexpr):
    """Bytes (TILE·BITS/8,) → signed integer codes (TILE,), int32."""
    PER_BYTE: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER_BYTE) * BITS
    u = (packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)
    return tl.reshape(u - (1 << (BITS - 1)), (TILE,))


@triton.jit
def _dequantize_tile(packed, scale, TILE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Unpack bytes (TILE·BITS/8,) and scale per group; fp32 (TILE,) in the rotated domain."""
    q = tl.reshape(_unpack_tile(packed, TILE, BITS), (TILE // GROUP, GROUP)).to(tl.float32)
    return _saturate(tl.reshape(q * scale[:, None], (TILE,)))


@triton.jit
def _saturate(v):
    """±Inf (an overflow: non-finite groups decode to NaN, which passes) → ±FP32_MAX."""
    big = tl.where(v > 0, 3.4028234663852886e38, -3.4028234663852886e38)
    return tl.where(tl.abs(v) == float("inf"), big, v)


@triton.jit
def _scale_and_unrotate(v, scale, h_ptr, TILE: tl.constexpr, GROUP: tl.constexpr,
                        HAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """Decoded values ``v`` ``(TILE / GROUP, GROUP)`` before scaling (integer codes or
    fp8 values) → fp32 ``(TILE,)``: scaled per group and, with ``HAD``, rotated back."""
    if HAD > 1 and GROUP % HAD == 0:
        # every block inside one group: rotate the unscaled values (exact products with
        # bf16 operands), then scale once by scale / HAD
        r = _rotate(tl.reshape(v, (TILE,)), _load_hadamard(h_ptr, HAD), TILE, HAD, DOT_FP32)
        r = tl.reshape(r, (TILE // GROUP, GROUP))
        return _saturate(tl.reshape(r * (scale * (1.0 / HAD))[:, None], (TILE,)))
    y = _saturate(tl.reshape(v * scale[:, None], (TILE,)))
    if HAD > 1:  # blocks span groups: scale first, then an fp32 product
        y = _rotate(y * (1.0 / HAD), _load_hadamard(h_ptr, HAD), TILE, HAD, "ieee")
    return y


@triton.jit
def _store_decoded(out_ptr, offs, y, numel, OUT_MAX: tl.constexpr):
    """Store fp32 ``y`` in the output's dtype (rounded to nearest even), finite values
    saturated to its range (see ``reference.saturate``)."""
    if OUT_MAX > 0:
        finite = tl.abs(y) < float("inf")
        y = tl.where(finite, tl.minimum(tl.maximum(y, -OUT_MAX), OUT_MAX), y)
    y = y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + offs, y, mask=offs < numel)


@triton.jit
def _load_rotated(x_ptr, h_ptr, base, numel, HAD: tl.constexpr, TILE: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """The tile at ``base`` (zero past ``numel``) as fp32, block-rotated when ``HAD > 1``."""
    offs = base + tl.arange(0, TILE)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    if HAD > 1:
        return _rotate(_saturate_for_rotation(x, HAD), _load_hadamard(h_ptr, HAD), TILE, HAD,
                       DOT_FP32)
    return x.to(tl.float32)


@triton.jit
def _saturate_for_rotation(x, HAD: tl.constexpr):
    """Finite inputs saturated at ±FP32_MAX / (2·HAD), so x·H cannot overflow (in x's dtype)."""
    xf = x.to(tl.float32)
    BOUND: tl.constexpr = 3.4028234663852886e38 / (2 * HAD)
    xf = tl.where(tl.abs(xf) < float("inf"), tl.minimum(tl.maximum(xf, -BOUND), BOUND), xf)
    return xf.to(x.dtype)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, numel, total, k1, k2,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                     TILE: tl.constexpr, STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                     FLOOR: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    y = _load_rotated(x_ptr, h_ptr, base, numel, HAD, TILE, DOT_FP32)
    packed, scale = _quantize_tile(y, base, k1, k2, TILE, BITS, GROUP, STOCHASTIC,
                                   SCALE_FP16, FLOOR)
    NBYTES: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    tl.store(codes_ptr + boffs, packed, mask=boffs < total * BITS // 8)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    tl.store(scales_ptr + goffs, scale.to(scales_ptr.dtype.element_ty), mask=goffs < total // GROUP)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, numel, total,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                       TILE: tl.constexpr, DOT_FP32: tl.constexpr, OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    NBYTES: tl.constexpr = TILE * BITS // 8
    boffs = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    packed = tl.load(codes_ptr + boffs, mask=boffs < total * BITS // 8, other=0)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    scale = tl.load(scales_ptr + goffs, mask=goffs < total // GROUP, other=0.0).to(tl.float32)
    q = tl.reshape(_unpack_tile(packed, TILE, BITS), (TILE // GROUP, GROUP)).to(tl.float32)
    y = _scale_and_unrotate(q, scale, h_ptr, TILE, GROUP, HAD, DOT_FP32)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    _store_decoded(out_ptr, offs, y, numel, OUT_MAX)


@triton.jit
def _pack_rows(u, BITS: tl.constexpr):
    """Offset codes ``u`` (rows, W) in ``0 … 2**BITS − 1`` → bytes (rows, W·BITS/8), element
    ``j`` of a byte at bits ``j·BITS``: splits of the row, no reshape across rows."""
    ROWS: tl.constexpr = u.shape[0]
    W: tl.constexpr = u.shape[1]
    if BITS == 8:
        return u.to(tl.uint8)
    a, b = tl.split(tl.reshape(u, (ROWS, W // 2, 2)))  # even, odd elements
    if BITS == 4:
        return (a | (b << 4)).to(tl.uint8)
    a0, a2 = tl.split(tl.reshape(a, (ROWS, W // 4, 2)))
    a1, a3 = tl.split(tl.reshape(b, (ROWS, W // 4, 2)))
    return (a0 | (a1 << 2) | (a2 << 4) | (a3 << 6)).to(tl.uint8)


@triton.jit
def _unpack_rows(packed, BITS: tl.constexpr):
    """Bytes (rows, NB) → signed integer codes (rows, NB·8/BITS), int32: the inverse of
    :func:`_pack_rows`, by interleaving the bit fields."""
    v = packed.to(tl.int32)
    if BITS == 4:
        v = tl.interleave(v & 15, v >> 4)
    elif BITS == 2:
        v = tl.interleave(tl.interleave(v & 3, (v >> 4) & 3),
                          tl.interleave((v >> 2) & 3, v >> 6))
    return v - (1 << (BITS - 1))


@triton.jit
def _row_offsets(rows, W: tl.constexpr):
    """Element offsets (len(rows), W) of rows ``rows`` (global indices) of width ``W``."""
    return rows[:, None] * W + tl.arange(0, W)[None, :]


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, numel, total, k1, k2,
                          BITS: tl.constexpr, HAD: tl.constexpr, ROWS: tl.constexpr,
                          STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr,
                          FLOOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """:func:`_quantize_kernel` for group == Hadamard block: each group is one row of the
    tile from load to store (no reshapes between the load, the product and the packing)."""
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = _row_offsets(groups, HAD)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    y = _rotate_rows(_saturate_for_rotation(x, HAD), _load_hadamard(h_ptr, HAD), DOT_FP32)
    _quantize_rows(y, pid.to(tl.int64) * (ROWS * HAD), groups, codes_ptr, scales_ptr, total,
                   k1, k2, BITS, STOCHASTIC, SCALE_FP16, FLOOR)


@triton.jit
def _quantize_rows(y, base, groups, codes_ptr, scales_ptr, total, k1, k2, BITS: tl.constexpr,
                   STOCHASTIC: tl.constexpr, SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr):
    """Quantize fp32 groups ``y`` (rows, GROUP) — group indices ``groups``, first element
    at ``base`` — and store their packed codes and scales (``total`` elements in all)."""
    GROUP: tl.constexpr = y.shape[1]
    q, scale = _group_levels(y, base, k1, k2, BITS, STOCHASTIC, SCALE_FP16, FLOOR)
    packed = _pack_rows(q.to(tl.int32) + (1 << (BITS - 1)), BITS)
    boffs = _row_offsets(groups, GROUP * BITS // 8)
    tl.store(codes_ptr + boffs, packed, mask=boffs < total * BITS // 8)
    tl.store(scales_ptr + groups, scale.to(scales_ptr.dtype.element_ty),
             mask=groups < total // GROUP)


@triton.jit
def _sum_chunk_rows(codes_ptr, scales_ptr, groups, k, chunk, BITS: tl.constexpr,
                    GROUP: tl.constexpr):
    """Groups ``groups`` of ``k`` encoded chunks (rows of ``chunk`` elements), decoded and
    summed in fp32 in chunk order: (len(groups), GROUP), as :func:`_sum_chunks`."""
    boffs = _row_offsets(groups, GROUP * BITS // 8)
    bmask = boffs < chunk * BITS // 8
    gmask = groups < chunk // GROUP
    acc = tl.zeros((groups.shape[0], GROUP), dtype=tl.float32)
    for i in range(k):
        packed = tl.load(codes_ptr + i * (chunk * BITS // 8) + boffs, mask=bmask, other=0)
        scale = tl.load(scales_ptr + i * (chunk // GROUP) + groups, mask=gmask, other=0.0)
        acc += _saturate(_unpack_rows(packed, BITS).to(tl.float32)
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
    acc = _saturate(_sum_chunk_rows(codes_ptr, scales_ptr, groups, k, chunk, BITS_IN, GROUP))
    _quantize_rows(acc, pid.to(tl.int64) * (ROWS * GROUP), groups, out_codes_ptr,
                   out_scales_ptr, chunk, k1, k2, BITS_OUT, STOCHASTIC, SCALE_FP16, FLOOR)


@triton.jit
def _dequantize_sum_rows_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, k, chunk,
                                BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                                ROWS: tl.constexpr, SUM_DOT: tl.constexpr):
    """:func:`_dequantize_sum_kernel` for groups equal to the Hadamard block (or no
    rotation): a group per row."""
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    acc = _sum_chunk_rows(codes_ptr, scales_ptr, groups, k, chunk, BITS, GROUP)
    if HAD > 1:
        acc = _rotate_rows(acc * (1.0 / HAD), _load_hadamard(h_ptr, HAD), SUM_DOT)
    offs = _row_offsets(groups, GROUP)
    tl.store(out_ptr + offs, acc, mask=offs < chunk)


@triton.jit
def _dequantize_rows_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, numel, total,
                            BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                            ROWS: tl.constexpr, DOT_FP32: tl.constexpr, OUT_MAX: tl.constexpr):
    """:func:`_dequantize_kernel` for groups of whole Hadamard blocks: each block one row
    of the tile; the unscaled codes rotate exactly, then one scale per row."""
    pid = tl.program_id(0)
    blocks = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    boffs = _row_offsets(blocks, HAD * BITS // 8)
    packed = tl.load(codes_ptr + boffs, mask=boffs < total * BITS // 8, other=0)
    groups = blocks // (GROUP // HAD)
    scale = tl.load(scales_ptr + groups, mask=groups < total // GROUP, other=0.0)
    y = _rotate_rows(_unpack_rows(packed, BITS).to(tl.float32), _load_hadamard(h_ptr, HAD),
                     DOT_FP32)
    y = _saturate(y * (scale.to(tl.float32) * (1.0 / HAD))[:, None])
    _store_decoded(out_ptr, _row_offsets(blocks, HAD), y, numel, OUT_MAX)


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
        acc += _dequantize_tile(packed, scale.to(tl.float32), TILE, BITS, GROUP)
    return acc


@triton.jit
def _dequantize_sum_kernel(codes_ptr, scales_ptr, h_ptr, out_ptr, k, chunk,
                           BITS: tl.constexpr, GROUP: tl.constexpr, HAD: tl.constexpr,
                           TILE: tl.constexpr, SUM_DOT: tl.constexpr):
    """TLq-HS step 5 in one pass: decode ``k`` chunks, sum in the rotated domain, rotate
    the sum back once (an fp32 product of precision ``SUM_DOT``: the sum is no longer
    integer)."""
    pid = tl.program_id(0)
    acc = _sum_chunks(codes_ptr, scales_ptr, pid, k, chunk, BITS, GROUP, TILE)
    if HAD > 1:
        acc = _rotate(acc * (1.0 / HAD), _load_hadamard(h_ptr, HAD), TILE, HAD, SUM_DOT)
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
    acc = _saturate(acc)  # an overflowed sum must not re-encode as a non-finite group
    packed, scale = _quantize_tile(acc, base, k1, k2, TILE, BITS_OUT, GROUP_OUT, STOCHASTIC,
                                   SCALE_FP16, FLOOR)
    NB_OUT: tl.constexpr = TILE * BITS_OUT // 8
    ooffs = pid.to(tl.int64) * NB_OUT + tl.arange(0, NB_OUT)
    tl.store(out_codes_ptr + ooffs, packed, mask=ooffs < chunk * BITS_OUT // 8)
    soffs = pid.to(tl.int64) * (TILE // GROUP_OUT) + tl.arange(0, TILE // GROUP_OUT)
    tl.store(out_scales_ptr + soffs, scale.to(out_scales_ptr.dtype.element_ty),
             mask=soffs < chunk // GROUP_OUT)


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
                         DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    y = _load_rotated(x_ptr, h_ptr, base, numel, HAD, TILE, DOT_FP32)
    g = tl.reshape(y, (TILE // GROUP, GROUP))
    # fp16 scales round to nearest even, as the reference's cast does
    bad, scale, inv = _group_scales(g, 448.0, SCALE_FP16, False, FLOOR)
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
                           DOT_FP32: tl.constexpr, OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    c = tl.load(codes_ptr + offs, mask=offs < total, other=0).to(tl.int32)
    goffs = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    scale = tl.load(scales_ptr + goffs, mask=goffs < total // GROUP, other=0.0).to(tl.float32)
    # fp8 values times ±1 are exact products in bf16, as integer codes are
    vals = tl.reshape(_fp8_value(c), (TILE // GROUP, GROUP))
    y = _scale_and_unrotate(vals, scale, h_ptr, TILE, GROUP, HAD, DOT_FP32)
    _store_decoded(out_ptr, offs, y, numel, OUT_MAX)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` in fp32: an ieee product, or one in ``b``'s dtype (exact for the small
    integers the trit kernels multiply)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _trits_quantize_kernel(x_ptr, codes_ptr, scales_ptr, h_ptr, w_ptr, numel, total, k1, k2,
                           GROUP: tl.constexpr, HAD: tl.constexpr, TILE: tl.constexpr,
                           NB: tl.constexpr, NBP: tl.constexpr, STOCHASTIC: tl.constexpr,
                           SCALE_FP16: tl.constexpr, FLOOR: tl.constexpr,
                           DOT_FP32: tl.constexpr, PACK_FP32: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * TILE
    y = _load_rotated(x_ptr, h_ptr, base, numel, HAD, TILE, DOT_FP32)
    q, scale = _levels_tile(y, base, k1, k2, TILE, 2, GROUP, STOCHASTIC, SCALE_FP16, FLOOR)
    # five trits per byte: byte b of a group is Σ_i (q[5b + i] + 1)·3^i, one product
    # with the (GROUP, NBP) matrix W[j, b] = 3^(j − 5b) for 0 ≤ j − 5b < 5
    j = tl.arange(0, GROUP)
    W = tl.load(w_ptr + j[:, None] * NBP + tl.arange(0, NBP)[None, :])
    packed = _dot(q + 1.0, W, PACK_FP32).to(tl.int32).to(tl.uint8)  # (TILE / GROUP, NBP)
    rows = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    cols = tl.arange(0, NBP)
    mask = (cols[None, :] < NB) & (rows[:, None] < total // GROUP)
    tl.store(codes_ptr + rows[:, None] * NB + cols[None, :], packed, mask=mask)
    tl.store(scales_ptr + rows, scale.to(scales_ptr.dtype.element_ty), mask=rows < total // GROUP)


@triton.jit
def _trits_dequantize_kernel(codes_ptr, scales_ptr, h_ptr, s_ptr, p_ptr, out_ptr, numel, total,
                             GROUP: tl.constexpr, HAD: tl.constexpr, TILE: tl.constexpr,
                             NB: tl.constexpr, NBP: tl.constexpr, DOT_FP32: tl.constexpr,
                             OUT_MAX: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * (TILE // GROUP) + tl.arange(0, TILE // GROUP)
    cols = tl.arange(0, NBP)
    mask = (cols[None, :] < NB) & (rows[:, None] < total // GROUP)
    packed = tl.load(codes_ptr + rows[:, None] * NB + cols[None, :], mask=mask, other=0)
    # every element's byte, by a product with the selection S[b, j] = (j // 5 == b),
    # then its trit: (byte // 3^(j % 5)) % 3
    j = tl.arange(0, GROUP)
    S = tl.load(s_ptr + cols[:, None] * GROUP + j[None, :])
    byte = _dot(packed.to(tl.float32), S, DOT_FP32).to(tl.int32)  # (TILE / GROUP, GROUP)
    q = ((byte // tl.load(p_ptr + j)[None, :]) % 3 - 1).to(tl.float32)
    scale = tl.load(scales_ptr + rows, mask=rows < total // GROUP, other=0.0).to(tl.float32)
    y = _scale_and_unrotate(q, scale, h_ptr, TILE, GROUP, HAD, DOT_FP32)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    _store_decoded(out_ptr, offs, y, numel, OUT_MAX)


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
    e = _Encode.of("quantize", x, bits, group, hadamard)
    codes = torch.empty(e.total * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(e.total // group, dtype=scale_dtype, device=x.device)
    if not e.grid:
        return codes, scales
    k1, k2 = keys if keys is not None else (0, 0)
    common = dict(STOCHASTIC=keys is not None, SCALE_FP16=scale_dtype == torch.float16,
                  FLOOR=scale_floor(scale_dtype), DOT_FP32=e.dot_fp32, num_warps=e.warps)
    if ROW_KERNELS and hadamard and group == hadamard:
        rows = _rows(e.tile, hadamard)
        _quantize_rows_kernel[(triton.cdiv(e.total, rows * hadamard),)](
            e.flat, codes, scales, e.h, e.flat.numel(), e.total, k1, k2, BITS=bits,
            HAD=hadamard, ROWS=rows, **common)
    else:
        _quantize_kernel[e.grid](e.flat, codes, scales, e.h, e.flat.numel(), e.total, k1, k2,
                                 BITS=bits, GROUP=group, HAD=hadamard, TILE=e.tile, **common)
    return codes, scales


def _rows(tile: int, width: int, dot: bool = True) -> int:
    """Rows of ``width`` elements in a row kernel's tile: the tile's, at least the 16 a
    ``tl.dot`` needs (one row when there is no product: wide groups stay one row)."""
    return max(tile // width, 16 if dot else 1)


@dataclass
class _Encode:
    """What every encoder's launch needs: the flat contiguous input, the padded length,
    grid, tile and warps, and the Hadamard matrix in the dot's dtype (the input's: ±1
    times bf16/fp16 values is exact; an ieee fp32 product for fp32 inputs and in the
    interpreter)."""

    flat: torch.Tensor
    total: int
    grid: tuple[int, ...]
    tile: int
    warps: int
    dot_fp32: str
    h: torch.Tensor

    @classmethod
    def of(cls, kernel: str, x: torch.Tensor, bits: int, group: int, hadamard: int) -> _Encode:
        flat = x.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        total = padded_numel(flat.numel(), bits, group, hadamard)
        tile, warps = config(kernel, bits, group, hadamard)
        dot_fp32 = fp32_dot() if interpreting() or flat.dtype == torch.float32 else ""
        h = hadamard_matrix(hadamard, torch.float32 if dot_fp32 else flat.dtype, x.device)
        grid = (triton.cdiv(total, tile),) if total else ()
        return cls(flat, total, grid, tile, warps, dot_fp32, h)


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
    d = _Decode.of("dequantize", bits, numel, group, hadamard, out_dtype, out, codes.device)
    if d.grid and ROW_KERNELS and hadamard and group % hadamard == 0:
        rows = _rows(d.tile, hadamard)
        _dequantize_rows_kernel[(triton.cdiv(d.total, rows * hadamard),)](
            codes, scales, d.h, d.out, numel, d.total, BITS=bits, GROUP=group, HAD=hadamard,
            ROWS=rows, DOT_FP32=d.dot_fp32, OUT_MAX=d.out_max, num_warps=d.warps,
        )
    elif d.grid:
        _dequantize_kernel[d.grid](
            codes, scales, d.h, d.out, numel, d.total, BITS=bits, GROUP=group, HAD=hadamard,
            TILE=d.tile, DOT_FP32=d.dot_fp32, OUT_MAX=d.out_max, num_warps=d.warps,
        )
    return d.out


@dataclass
class _Decode:
    """What every decoder's launch needs: padded length, output, grid, tile and warps,
    the Hadamard matrix in the dot's dtype, and the output's saturation bound. Unscaled
    codes and fp8 values rotate exactly in bf16 on tensor cores (fp32 in the
    interpreter, whose bf16 dot is wrong)."""

    total: int
    out: torch.Tensor
    grid: tuple[int, ...]
    tile: int
    warps: int
    dot_fp32: str
    h: torch.Tensor
    out_max: float

    @classmethod
    def of(cls, kernel: str, bits: int, numel: int, group: int, hadamard: int,
           out_dtype: torch.dtype, out: torch.Tensor | None, device: torch.device) -> _Decode:
        total = padded_numel(numel, bits, group, hadamard)
        if out is None:
            out = torch.empty(numel, dtype=out_dtype, device=device)
        tile, warps = config(kernel, bits, group, hadamard)
        dot_fp32 = fp32_dot() if interpreting() else ""
        h = hadamard_matrix(hadamard, torch.float32 if dot_fp32 else torch.bfloat16, device)
        out_max = 0.0 if out.dtype == torch.float32 else torch.finfo(out.dtype).max
        grid = (triton.cdiv(total, tile),) if numel else ()
        return cls(total, out, grid, tile, warps, dot_fp32, h, out_max)


def dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group: int,
                   hadamard: int = 0) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.dequantize_sum`: ``k`` chunks
    (rows) decoded and summed in row order, rotated back once → ``(chunk,)`` fp32."""
    k, nbytes = codes.shape
    chunk = nbytes * 8 // bits
    out = torch.empty(chunk, dtype=torch.float32, device=codes.device)
    if chunk == 0 or k == 0:
        return out.zero_()
    tile, warps = config("dequantize_sum", bits, group, hadamard)
    h = hadamard_matrix(hadamard, torch.float32, codes.device)
    codes, scales = codes.contiguous(), scales.contiguous()
    if ROW_KERNELS and hadamard in (0, group):
        rows = _rows(tile, group, dot=hadamard > 0)
        _dequantize_sum_rows_kernel[(triton.cdiv(chunk, rows * group),)](
            codes, scales, h, out, k, chunk, BITS=bits, GROUP=group, HAD=hadamard, ROWS=rows,
            SUM_DOT=fp32_dot(), num_warps=warps)
    else:
        _dequantize_sum_kernel[(triton.cdiv(chunk, tile),)](
            codes, scales, h, out, k, chunk, BITS=bits, GROUP=group, HAD=hadamard, TILE=tile,
            SUM_DOT=fp32_dot(), num_warps=warps)
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
    tile, warps = config("dequant_reduce_requant", bits_in, max(group_in, group_out), 0)
    k1, k2 = keys if keys is not None else (0, 0)
    codes, scales = codes.contiguous(), scales.contiguous()
    common = dict(STOCHASTIC=keys is not None, SCALE_FP16=scale_dtype == torch.float16,
                  FLOOR=scale_floor(scale_dtype), num_warps=warps)
    if ROW_KERNELS and group_in == group_out:
        rows = _rows(tile, group_in, dot=False)
        _dequant_reduce_requant_rows_kernel[(triton.cdiv(chunk, rows * group_in),)](
            codes, scales, out_codes, out_scales, k, chunk, k1, k2, BITS_IN=bits_in,
            BITS_OUT=bits_out, GROUP=group_in, ROWS=rows, **common)
    else:
        _dequant_reduce_requant_kernel[(triton.cdiv(chunk, tile),)](
            codes, scales, out_codes, out_scales, k, chunk, k1, k2, BITS_IN=bits_in,
            GROUP_IN=group_in, BITS_OUT=bits_out, GROUP_OUT=group_out, TILE=tile, **common)
    return out_codes, out_scales


def fp8_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`commpress.kernels.reference.fp8_quantize`."""
    e = _Encode.of("fp8_quantize", x, 8, group, hadamard)
    codes = torch.empty(e.total, dtype=torch.uint8, device=x.device)
    scales = torch.empty(e.total // group, dtype=scale_dtype, device=x.device)
    if e.grid:
        _fp8_quantize_kernel[e.grid](
            e.flat, codes, scales, e.h, e.flat.numel(), e.total, GROUP=group, HAD=hadamard,
            TILE=e.tile, SCALE_FP16=scale_dtype == torch.float16,
            FLOOR=scale_floor(scale_dtype), DOT_FP32=e.dot_fp32, num_warps=e.warps,
        )
    return codes, scales


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                   hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.fp8_dequantize` (writes ``out``
    if given)."""
    d = _Decode.of("fp8_dequantize", 8, numel, group, hadamard, out_dtype, out, codes.device)
    if d.grid:
        _fp8_dequantize_kernel[d.grid](
            codes, scales, d.h, d.out, numel, d.total, GROUP=group, HAD=hadamard, TILE=d.tile,
            DOT_FP32=d.dot_fp32, OUT_MAX=d.out_max, num_warps=d.warps,
        )
    return d.out


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
    e = _Encode.of("trits_quantize", x, 2, group, hadamard)
    groups = e.total // group
    codes = torch.empty(groups * trit_bytes(group), dtype=torch.uint8, device=x.device)
    scales = torch.empty(groups, dtype=scale_dtype, device=x.device)
    if e.grid:
        k1, k2 = keys if keys is not None else (0, 0)
        # trits and powers of 3 are exact in bf16, whatever the input's dtype
        w, _, _, nb, nbp = _trit_matrices(
            group, torch.float32 if interpreting() else torch.bfloat16, str(x.device))
        _trits_quantize_kernel[e.grid](
            e.flat, codes, scales, e.h, w, e.flat.numel(), e.total, k1, k2, GROUP=group,
            HAD=hadamard, TILE=e.tile, NB=nb, NBP=nbp, STOCHASTIC=keys is not None,
            SCALE_FP16=scale_dtype == torch.float16, FLOOR=scale_floor(scale_dtype),
            DOT_FP32=e.dot_fp32, PACK_FP32=interpreting(), num_warps=e.warps,
        )
    return codes, scales


def trits_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                     hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`commpress.kernels.reference.trits_dequantize`."""
    d = _Decode.of("trits_dequantize", 2, numel, group, hadamard, out_dtype, out, codes.device)
    # selection matrix and bytes (≤ 242) are exact in the dot's dtype too
    _, sel, powers, nb, nbp = _trit_matrices(group, d.h.dtype, str(codes.device))
    if d.grid:
        _trits_dequantize_kernel[d.grid](
            codes, scales, d.h, sel, powers, d.out, numel, d.total, GROUP=group, HAD=hadamard,
            TILE=d.tile, NB=nb, NBP=nbp, DOT_FP32=d.dot_fp32, OUT_MAX=d.out_max,
            num_warps=d.warps,
        )
    return d.out


__all__ = ["CONFIGS", "config", "dequant_reduce_requant", "dequantize", "dequantize_sum",
           "fp8_dequantize", "fp8_quantize", "quantize", "qmax_for_bits", "supports",
           "trits_dequantize", "trits_quantize"]
