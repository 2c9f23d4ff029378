"""Torch reference kernels: block Hadamard, group quantization, bit packing.

These functions are the specification. They run on any device (the CPU path of
commpress uses them directly) and every Triton kernel is tested against them.

Conventions shared with the Triton kernels, so that both give the same codes:

* The input is viewed flat and zero-padded to a multiple of ``padded_unit``.
* Hadamard uses the unnormalized ±1 Sylvester matrix ``H`` (``H @ H = h·I``):
  encode quantizes ``y = x·H`` and decode returns ``ŷ·H / h``. ``1/h`` is a power
  of two, so no ``1/√h`` rounding enters either side; the transmitted scale lives in
  the unnormalized rotated domain.
* Symmetric codes in ``[-qmax, qmax]`` with ``qmax = 2**(bits-1) - 1`` are stored
  offset-binary (``q + 2**(bits-1)``); element ``j`` of a byte sits at bits
  ``j*bits`` (little end first).
* ``scale = absmax / qmax``, cast to the scale dtype (fp16 rounds up, so no element
  clips); codes are computed with the cast scale (``q = x · (1/scale)``), so decode
  is exactly ``q · scale``.
* Nearest rounding is ``floor(y + 0.5)``; stochastic rounding is ``floor(y + u)``
  with ``u`` from :func:`uniform_from_counter`, a counter-based hash of
  (key, element index): identical on every device and every run.
* A group holding NaN or ±Inf gets scale NaN and codes 0: it decodes to NaN,
  never to finite values.
* Finite values never decode to ±Inf: inputs to a rotation are saturated at
  ``±FP32_MAX / (2h)`` (so ``x·H`` cannot overflow, with room for bf16 rounding), fp16
  scales at 65504 (codes then saturate at ``±qmax``), and ``q · scale`` at ``±FP32_MAX``;
  decode scales by ``1/h`` before rotating back. Values that large mean training has
  already diverged; what matters is that they stay finite, not exact.
"""

from __future__ import annotations

import functools
import math

import torch

MASK32 = 0xFFFFFFFF
FP32_MAX = torch.finfo(torch.float32).max
FP16_MAX = torch.finfo(torch.float16).max
# Multipliers below 2**31 keep int64 products exact in torch (no overflow), and
# equal the uint32 arithmetic of the Triton kernels modulo 2**32.
HASH_MUL_1 = 0x7FEB352D
HASH_MUL_2 = 0x2C1B3C6D


def qmax_for_bits(bits: int) -> int:
    """Largest code magnitude of a symmetric ``bits``-bit quantizer (7 for int4)."""
    return (1 << (bits - 1)) - 1


def scale_floor(scale_dtype: torch.dtype) -> float:
    """Smallest scale a nonzero group gets: fp16's least subnormal, fp32's least normal."""
    return 2.0**-24 if scale_dtype == torch.float16 else 2.0**-126


def padded_unit(bits: int, group: int, hadamard: int) -> int:
    """Smallest element count whose codes pack into whole bytes and whole groups/blocks."""
    per_byte = 8 // bits
    return math.lcm(group, max(hadamard, 1), per_byte)


def padded_numel(numel: int, bits: int, group: int, hadamard: int) -> int:
    unit = padded_unit(bits, group, hadamard)
    return -(-numel // unit) * unit


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Mix 32-bit values held in an int64 tensor (lowbias32-style; exact, no overflow)."""
    x = x ^ (x >> 16)
    x = (x * HASH_MUL_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL_2) & MASK32
    x = x ^ (x >> 16)
    return x


def hash32_int(x: int) -> int:
    """:func:`hash32` on a Python int (used to derive per-call keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * HASH_MUL_1) & MASK32
    x ^= x >> 15
    x = (x * HASH_MUL_2) & MASK32
    x ^= x >> 16
    return x


def stream_keys(seed: int, counter: int, stream: int = 0) -> tuple[int, int]:
    """Two 32-bit keys for one encode call, from the seed, the call counter and a stream id."""
    k1 = hash32_int(hash32_int(seed) ^ (counter & MASK32))
    k2 = hash32_int(k1 ^ hash32_int((stream & MASK32) ^ ((counter >> 32) & MASK32) ^ 0x5BD1E995))
    return k1, k2


def uniform_from_counter(start: int, numel: int, keys: tuple[int, int], device) -> torch.Tensor:
    """Uniform floats in [0, 1) for element indices ``start .. start+numel-1`` (fp32, 24 bits)."""
    idx = torch.arange(start, start + numel, device=device, dtype=torch.int64) & MASK32
    h = hash32(hash32(idx ^ keys[0]) ^ keys[1])
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@functools.cache
def _hadamard_pm1(h: int, device_str: str) -> torch.Tensor:
    mat = torch.ones(1, 1, dtype=torch.float32)
    while mat.shape[0] < h:
        mat = torch.cat([torch.cat([mat, mat], 1), torch.cat([mat, -mat], 1)], 0)
    return mat.to(device_str)


def hadamard_pm1(h: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The unnormalized ``h × h`` Sylvester Hadamard matrix of ±1 (fp32, symmetric)."""
    return _hadamard_pm1(h, str(torch.device(device)))


def hadamard_transform(y: torch.Tensor, h: int) -> torch.Tensor:
    """Multiply each block of ``h`` consecutive elements of flat fp32 ``y`` by ``H``."""
    if h <= 1:
        return y
    H = hadamard_pm1(h, y.device)
    return (y.view(-1, h) @ H).view(-1)


def pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack offset-binary codes (integers < 2**bits) into uint8, ``8 // bits`` per byte."""
    per_byte = 8 // bits
    u = u.to(torch.uint8)
    if per_byte == 1:
        return u
    parts = u.view(-1, per_byte)
    packed = parts[:, 0].clone()
    for j in range(1, per_byte):
        packed |= parts[:, j] << (j * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 codes, ``8 // bits`` per byte."""
    per_byte = 8 // bits
    p = packed.to(torch.int32)
    if per_byte == 1:
        return p
    shifts = torch.arange(per_byte, device=p.device, dtype=torch.int32) * bits
    return ((p.view(-1, 1) >> shifts) & ((1 << bits) - 1)).view(-1)


def quantize_rotated(
    y: torch.Tensor,
    *,
    bits: int,
    group: int,
    scale_dtype: torch.dtype,
    keys: tuple[int, int] | None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize flat fp32 ``y`` (numel a multiple of ``group`` and of the packing).

    Returns ``(codes, scales)``: packed uint8 codes and one scale per group.
    ``keys`` selects stochastic rounding (None: nearest); ``start`` is the element
    index of ``y[0]`` in the stream (a piece of a longer tensor).
    """
    u, scales = quantize_levels(y, bits=bits, group=group, scale_dtype=scale_dtype, keys=keys,
                                start=start)
    return pack_codes(u, bits), scales


def quantize_levels(
    y: torch.Tensor,
    *,
    bits: int,
    group: int,
    scale_dtype: torch.dtype,
    keys: tuple[int, int] | None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rotated` before packing: offset-binary codes ``q + 2**(bits-1)``
    as a flat float tensor, and the scales."""
    qmax = qmax_for_bits(bits)
    g = y.view(-1, group)
    # amax propagates NaN and Inf: a group is finite exactly when its absmax is
    absmax = g.abs().amax(dim=1, keepdim=True)
    finite = torch.isfinite(absmax)
    absmax = torch.where(finite, absmax, 0.0)
    scale = absmax / qmax
    if scale_dtype == torch.float16:
        # Round the fp16 scale up (never down), so no element exceeds qmax steps and
        # |x − x̂| ≤ scale/2 holds even where fp16 is subnormal and coarse; beyond fp16's
        # range the scale saturates (and so do the codes) instead of becoming Inf.
        scale = scale.clamp(max=FP16_MAX)
        s16 = scale.to(torch.float16)
        s16 = torch.where(s16.float() < scale, (s16.view(torch.int16) + 1).view(torch.float16), s16)
        scale = s16.float()
    # A nonzero group keeps a scale no smaller than scale_floor: it is never zeroed
    # by underflow, and 1/scale stays finite.
    scale = torch.where(absmax > 0, scale.clamp_min(scale_floor(scale_dtype)), scale)
    # a non-finite group gets inv 0: its codes come out 0 (NaN·0 is cleared below)
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)
    v = g * inv
    if keys is None:
        v += 0.5
    else:
        v += uniform_from_counter(start, y.numel(), keys, y.device).view_as(g)
    q = v.floor_().clamp_(-qmax, qmax).nan_to_num_(0.0)
    q += 1 << (bits - 1)
    scale = torch.where(finite, scale, float("nan"))
    return q.view(-1), scale.view(-1).to(scale_dtype)


def dequantize_rotated(
    codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group: int
) -> torch.Tensor:
    """Flat fp32 values in the rotated domain: ``q · scale``."""
    q = unpack_codes(codes, bits) - (1 << (bits - 1))
    y = q.view(-1, group).to(torch.float32) * scales.float().view(-1, 1)
    # qmax · (absmax / qmax) may round above FP32_MAX; NaN (a non-finite group) stays NaN
    return y.clamp_(-FP32_MAX, FP32_MAX).view(-1)


def quantize(
    x: torch.Tensor,
    *,
    bits: int,
    group: int,
    hadamard: int = 0,
    scale_dtype: torch.dtype = torch.float32,
    keys: tuple[int, int] | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode any float tensor: pad, rotate (``hadamard > 0``), quantize, pack.

    Returns ``(codes, scales)`` with ``padded_numel(...) * bits / 8`` bytes of codes
    and ``padded_numel(...) / group`` scales. ``start``: as for :func:`quantize_rotated`.
    """
    y = pad_and_rotate(x, bits=bits, group=group, hadamard=hadamard)
    return quantize_rotated(y, bits=bits, group=group, scale_dtype=scale_dtype, keys=keys,
                            start=start)


def pad_and_rotate(x: torch.Tensor, *, bits: int, group: int, hadamard: int) -> torch.Tensor:
    """Flat fp32 copy of ``x`` padded to whole groups (and blocks), rotated if asked."""
    flat = x.reshape(-1)
    n = flat.numel()
    total = padded_numel(n, bits, group, hadamard)
    if total == n and flat.dtype == torch.float32 and hadamard <= 1:
        return flat  # read only below: no copy needed
    y = torch.zeros(total, dtype=torch.float32, device=x.device)
    y[:n] = flat
    if hadamard > 1:
        return hadamard_transform(saturate_for_rotation(y, hadamard), hadamard)
    return y


def saturate_for_rotation(y: torch.Tensor, hadamard: int) -> torch.Tensor:
    """Clamp finite values to ``±FP32_MAX / (2h)`` so a rotation cannot overflow; NaN and
    ±Inf pass unchanged (they must stay non-finite)."""
    bound = FP32_MAX / (2 * hadamard)
    return torch.where(torch.isfinite(y), y.clamp(-bound, bound), y)


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
    """Decode to a flat tensor of ``numel`` elements of ``out_dtype`` (into ``out``, a
    flat contiguous tensor of that dtype, if given)."""
    y = dequantize_rotated(codes, scales, bits=bits, group=group)
    return written(unrotate(y, numel, hadamard=hadamard, out_dtype=out_dtype), out)


def written(values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``values``, or ``out`` holding them (the decoders' ``out=``)."""
    if out is None:
        return values
    return out.copy_(values)


def dequantize_sum(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    group: int,
    hadamard: int = 0,
) -> torch.Tensor:
    """Decode ``k`` chunks and sum them in fp32, in row order: ``(m,)`` fp32.

    ``codes`` is ``(k, bytes_per_chunk)`` and ``scales`` ``(k, groups_per_chunk)``. The
    rotation is linear, so the sum is taken in the rotated domain and rotated back
    once — the last step of the two-level reduce-scatter.
    """
    k = codes.shape[0]
    y = dequantize_rotated(codes.reshape(-1), scales.reshape(-1), bits=bits, group=group)
    return unrotate(sum_rows(y.view(k, -1)), y.numel() // k, hadamard=hadamard,
                    out_dtype=torch.float32)


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows[0] + rows[1] + …`` strictly in row order (as the kernels add), in fp32 (fp64
    rows stay fp64)."""
    total = rows[0].to(torch.float64 if rows.dtype == torch.float64 else torch.float32).clone()
    for i in range(1, rows.shape[0]):
        total += rows[i]
    return total


def unrotate(y: torch.Tensor, numel: int, *, hadamard: int,
             out_dtype: torch.dtype) -> torch.Tensor:
    """Decoded fp32 values in the rotated domain → ``numel`` values of ``out_dtype``."""
    if hadamard > 1:  # scale first: ŷ·H alone could overflow
        y = hadamard_transform(y * (1.0 / hadamard), hadamard)
    return saturate(y[:numel], out_dtype).to(out_dtype)


def saturate(y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Clamp *finite* fp32 values to ``out_dtype``'s range: a value near fp16's 65504
    plus quantization error must not become Inf; NaN and ±Inf pass unchanged."""
    if out_dtype == torch.float32:
        return y
    top = torch.finfo(out_dtype).max
    return torch.where(torch.isfinite(y), y.clamp(-top, top), y)


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
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``k`` chunks, sum them in fp32, re-encode the sum — all in the rotated domain.

    ``codes`` is ``(k, bytes_per_chunk)`` uint8 and ``scales`` ``(k, groups_per_chunk)``;
    chunks are summed in row order (deterministic). This is the middle step of the
    two-level reduce-scatter (TLq-HS): no Hadamard is applied here because both
    levels work on the same rotated values. ``start``: the element index of the chunks'
    first column in the stream (for stochastic rounding of a piece of longer chunks).
    """
    total = dequantize_sum(codes, scales, bits=bits_in, group=group_in)
    # a sum that overflowed would re-encode as a non-finite group (NaN): saturate it
    total.clamp_(-FP32_MAX, FP32_MAX)
    return quantize_rotated(total, bits=bits_out, group=group_out, scale_dtype=scale_dtype,
                            keys=keys, start=start)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` as float8 e4m3 bytes with one scale per group (``absmax / 448``),
    after an optional block Hadamard rotation; round to nearest even (torch's cast).

    A group holding NaN or ±Inf gets a NaN scale (it decodes to NaN) and zero codes.
    """
    y = pad_and_rotate(x, bits=8, group=group, hadamard=hadamard)
    g = y.view(-1, group)
    finite = torch.isfinite(g).all(dim=1, keepdim=True)
    absmax = torch.where(finite, g.abs(), 0.0).amax(dim=1, keepdim=True)
    scale = (absmax / FP8_MAX).clamp(max=torch.finfo(scale_dtype).max).to(scale_dtype).float()
    scale = torch.where(absmax > 0, scale.clamp_min(scale_floor(scale_dtype)), scale)
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)
    codes = torch.where(finite, (g * inv).clamp(-FP8_MAX, FP8_MAX), 0.0)
    codes = codes.to(torch.float8_e4m3fn).view(torch.uint8).view(-1)
    return codes, torch.where(finite, scale, float("nan")).view(-1).to(scale_dtype)


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                   hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode :func:`fp8_quantize`'s bytes to ``numel`` values of ``out_dtype``."""
    vals = codes.view(torch.float8_e4m3fn).float().view(-1, group)
    y = (vals * scales.float().view(-1, 1)).view(-1)
    y = y.clamp_(-FP32_MAX, FP32_MAX)  # NaN stays
    return written(unrotate(y, numel, hadamard=hadamard, out_dtype=out_dtype), out)


# -- ternary codes, five per byte (int2:packing=trits) ------------------------------------
TRIT_POWERS = (1, 3, 9, 27, 81)


def trit_bytes(group: int) -> int:
    """Bytes per group: five trits per byte, the group padded to a multiple of 5."""
    return -(-group // 5)


def trits_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                   scale_dtype: torch.dtype = torch.float32,
                   keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` as int2's ternary codes -1, 0, 1 (the same levels and scales as
    :func:`quantize` with ``bits=2``), packed five per byte: byte ``b`` of a group holds
    its elements ``5b … 5b + 4`` as ``Σ (q + 1) · 3^i`` (the last byte zero-padded)."""
    y = pad_and_rotate(x, bits=2, group=group, hadamard=hadamard)
    u, scales = quantize_levels(y, bits=2, group=group, scale_dtype=scale_dtype, keys=keys)
    g = (u - 1).view(-1, group).to(torch.uint8)  # offset codes 1..3 → trits 0..2
    width = 5 * trit_bytes(group)
    if width != group:
        g = torch.nn.functional.pad(g, (0, width - group))
    powers = torch.tensor(TRIT_POWERS, dtype=torch.uint8, device=x.device)
    return (g.view(-1, 5) * powers).sum(dim=1, dtype=torch.uint8), scales


def trit_values(packed: torch.Tensor, group: int) -> torch.Tensor:
    """The codes -1, 0, 1 of whole groups (flat int32) held in trit bytes."""
    powers = torch.tensor(TRIT_POWERS, dtype=torch.int32, device=packed.device)
    q = (packed.to(torch.int32).view(-1, 1) // powers) % 3 - 1  # (bytes, 5)
    return q.view(-1, 5 * trit_bytes(group))[:, :group].reshape(-1)


def trits_dequantize(packed: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                     hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode :func:`trits_quantize`'s bytes to ``numel`` values of ``out_dtype``."""
    q = trit_values(packed, group).view(-1, group).float()
    y = (q * scales.float().view(-1, 1)).view(-1)
    return written(unrotate(y, numel, hadamard=hadamard, out_dtype=out_dtype), out)


def magnitude_key(flat: torch.Tensor) -> torch.Tensor:
    """``|x|`` as an integer that orders as ``|x|`` does: the value's bits without its sign
    (NaN above ±Inf above every finite value; ``-0`` and ``+0`` equal). int32 for 16- and
    32-bit floats, int64 for float64."""
    if flat.element_size() == 8:
        return flat.view(torch.int64) & 0x7FFFFFFFFFFFFFFF
    if flat.element_size() == 4:
        return flat.view(torch.int32) & 0x7FFFFFFF
    return flat.view(torch.int16).to(torch.int32) & 0x7FFF


def topk_index_dtype(numel: int) -> torch.dtype:
    """The dtype of top-k indices into ``numel`` elements: int32 below 2**31, else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def topk_select(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude elements of flat ``x`` as ``(values, indices, flag)``.

    Deterministic: ties at the k-th magnitude go to the lowest indices, and indices come
    in increasing order (int32 below 2**31 elements, else int64). ``flag`` is one fp32
    value, 0 if every element is finite, else NaN (the decoder adds it everywhere, so a
    NaN or ±Inf that was not selected still poisons the result, never vanishes).
    """
    n = flat.numel()
    index_dtype = topk_index_dtype(n)
    # x·0 sums to 0, or NaN if any x is NaN or ±Inf; then one NaN whose bytes are the same
    # everywhere
    flag = torch.where((flat.float() * 0).sum().view(1) == 0, 0.0, float("nan"))
    if k == 0:
        return flat[:0].clone(), torch.empty(0, dtype=index_dtype, device=flat.device), flag
    key = magnitude_key(flat)
    threshold = key.kthvalue(n - k + 1).values  # the k-th largest key
    above = key > threshold
    tie = key == threshold
    need = k - above.sum()  # ties to take, lowest index first
    take = above | (tie & (tie.cumsum(0) <= need))
    idx = torch.nonzero_static(take, size=k).view(-1)
    return flat[idx], idx.to(index_dtype), flag


# -- chunked top-k (SparseLoCo): per chunk, the k largest as b-bit codes of a table -------

def pack_rows(values: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of non-negative ints below ``2**width`` → rows of bytes, each row's bits packed
    little-endian and padded to a whole byte (a row splits off with its bytes)."""
    rows, n = values.shape
    shifts = torch.arange(width, device=values.device)
    bits = ((values.to(torch.int64).unsqueeze(-1) >> shifts) & 1).view(rows, n * width)
    pad = (-bits.shape[1]) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(rows, pad)], dim=1)
    weights = 1 << torch.arange(8, device=values.device)
    return (bits.view(rows, -1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """:func:`pack_rows` undone: ``n`` ints of ``width`` bits per row (int64)."""
    rows = packed.shape[0]
    bits = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1
    bits = bits.view(rows, -1)[:, : n * width].view(rows, n, width)
    return (bits << torch.arange(width, device=packed.device)).sum(-1)


def chunk_topk_select(flat: torch.Tensor, *, chunk: int, k: int, bits: int,
                      sigmas: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseLoCo's code of flat ``x``, chunk by chunk of ``chunk`` elements (the last one
    padded with zeros), before packing (:func:`pack_chunk_codes`) → ``(codes, indices,
    table)``, one row per chunk:

    - the ``k`` largest magnitudes of the chunk (ties to the lowest index; indices in
      increasing order), as int64 chunk-local indices;
    - each value's bin (int64): ``2**bits`` equal bins over the mean ± ``sigmas``
      standard deviations of the chunk's kept values (beyond: the outer bins);
    - the table: each bin's mean of the kept values that fell in it (bf16; an empty bin
      its centre), which the decoder reads a code through. A chunk holding NaN or ±Inf
      gets a table of NaN: it decodes to NaN whole, never to finite values."""
    n = flat.numel()
    rows = -(-n // chunk)
    levels = 1 << bits
    x = torch.zeros(rows * chunk, dtype=torch.float32, device=flat.device)
    x[:n] = flat
    x = x.view(rows, chunk)
    finite = torch.isfinite(x).all(dim=1, keepdim=True)
    x = torch.where(finite, x, 0.0)
    key = x.abs()
    threshold = key.kthvalue(chunk - k + 1, dim=1, keepdim=True).values
    above = key > threshold
    tie = key == threshold
    take = above | (tie & (tie.cumsum(1) <= k - above.sum(1, keepdim=True)))
    index = torch.nonzero(take)[:, 1].view(rows, k)
    kept = x.gather(1, index)
    # in units of the chunk's largest kept magnitude: sums and squares cannot overflow
    amax = kept.abs().amax(1, keepdim=True)
    unit = torch.where(amax > 0, amax, 1.0)
    u = kept / unit
    mean = u.mean(1, keepdim=True)
    spread = sigmas * ((u - mean) ** 2).mean(1, keepdim=True).sqrt()
    width = 2 * spread / levels
    safe = torch.where(width > 0, width, 1.0)
    code = torch.where(width > 0, ((u - (mean - spread)) / safe).floor(), 0.0)
    code = code.clamp(0, levels - 1).to(torch.int64)
    onehot = code.unsqueeze(-1) == torch.arange(levels, device=flat.device)
    count = onehot.sum(1).float()
    total = torch.where(onehot, u.unsqueeze(-1), 0.0).sum(1)
    # an empty bin (no code reads it) sends its centre, within the kept values' range
    centre = (mean - spread + (torch.arange(levels, device=flat.device) + 0.5) * width)
    table = torch.where(count > 0, total / count.clamp(min=1), centre.clamp(-1, 1)) * unit
    return code, index, chunk_table(table, finite)


def chunk_table(table: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The bins' means as sent: bf16, saturated (finite stays finite); NaN for a chunk
    that held NaN or ±Inf."""
    return torch.where(finite, saturate(table, torch.bfloat16), float("nan")).to(torch.bfloat16)


def pack_chunk_codes(code: torch.Tensor, index: torch.Tensor, table: torch.Tensor, *,
                     chunk: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of codes and chunk-local indices → their packed bytes (``bits`` and
    ``log2(chunk)`` bits each), with the table."""
    index_bits = chunk.bit_length() - 1
    return pack_rows(code, bits), pack_rows(index, index_bits), table


def chunk_topk_decode(codes: torch.Tensor, indices: torch.Tensor, table: torch.Tensor,
                      numel: int, *, chunk: int, k: int, bits: int) -> torch.Tensor:
    """Packed :func:`chunk_topk_select` decoded → flat fp32 of ``numel`` elements: each kept
    element its bin's table value, the rest zero; a chunk with a NaN table is NaN."""
    rows = table.shape[0]
    code = unpack_rows(codes.view(rows, -1), bits, k)
    index = unpack_rows(indices.view(rows, -1), chunk.bit_length() - 1, k)
    values = table.view(rows, -1).float().gather(1, code)
    dense = torch.zeros(rows, chunk, dtype=torch.float32, device=table.device)
    dense.scatter_(1, index, values)
    dense[table.view(rows, -1).isnan().any(1)] = float("nan")
    return dense.view(-1)[:numel]
