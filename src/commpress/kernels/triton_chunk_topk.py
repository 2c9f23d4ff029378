"""Triton chunked top-k: the twin of :func:`commpress.kernels.reference.chunk_topk_select`.

One program per chunk holds the chunk in registers and does what the reference does,
without a sort:

1. The k-th largest magnitude, bit by bit from the top (31 counts over the chunk's
   integer magnitude keys): the largest key with at least ``k`` keys at or above it.
2. Which elements are kept: those above it, then ties in index order; their places in
   the output by a prefix sum, so indices come out increasing (the reference's bytes).
3. The kept values in units of their largest magnitude, their mean and spread, each
   value's bin, and each bin's mean (the table; an empty bin its centre).

Packing the codes and indices into bits is the reference's (:func:`pack_chunk_codes`):
it touches ``k`` of every ``chunk`` elements. The sums run in another order than
torch's, so a value on a bin's edge may fall into the neighbouring bin; the test allows
that and nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from commpress.kernels import reference

MAX_CHUNK = 8192  # one chunk per program, in registers
MAX_BITS = 4  # 16 bins: one pass over the chunk each


def supports(chunk: int, bits: int, dtype: torch.dtype) -> bool:
    """Whether this kernel encodes the configuration (else the caller uses the reference)."""
    return chunk <= MAX_CHUNK and bits <= MAX_BITS and dtype in (
        torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _chunk_topk_kernel(x_ptr, numel, code_ptr, index_ptr, table_ptr, finite_ptr,
                       K: tl.constexpr, CHUNK: tl.constexpr, LEVELS: tl.constexpr,
                       SIGMAS: tl.constexpr):
    pid = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    offs = pid.to(tl.int64) * CHUNK + local
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    finite = tl.sum(x * 0.0, 0) == 0.0  # NaN or ±Inf anywhere: NaN
    x = tl.where(finite, x, 0.0)
    key = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    # 1. the k-th largest key, bit by bit
    threshold = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), 0)
    for b in tl.static_range(31):
        candidate = threshold | (1 << (30 - b))
        enough = tl.sum((key >= candidate).to(tl.int32), 0) >= K
        threshold = tl.where(enough, candidate, threshold)
    # 2. kept: above it, then ties lowest index first; their places, in index order
    above = key > threshold
    tie = key == threshold
    tie_i = tie.to(tl.int32)
    need = K - tl.sum(above.to(tl.int32), 0)
    take = above | (tie & (tl.cumsum(tie_i, 0) - tie_i < need))
    take_i = take.to(tl.int32)
    place = pid.to(tl.int64) * K + tl.cumsum(take_i, 0) - take_i
    # 3. bins over mean ± SIGMAS spreads, in units of the largest kept magnitude
    amax = tl.max(tl.where(take, tl.abs(x), 0.0), 0)
    unit = tl.where(amax > 0, amax, 1.0)
    u = x / unit
    mean = tl.sum(tl.where(take, u, 0.0), 0) / K
    d = tl.where(take, u - mean, 0.0)
    spread = SIGMAS * tl.sqrt(tl.sum(d * d, 0) / K)
    width = 2 * spread / LEVELS
    safe = tl.where(width > 0, width, 1.0)
    code = tl.where(width > 0, tl.floor((u - (mean - spread)) / safe), 0.0)
    code = tl.minimum(tl.maximum(code, 0.0), LEVELS - 1).to(tl.int32)
    for level in tl.static_range(LEVELS):
        sel = take & (code == level)
        count = tl.sum(sel.to(tl.float32), 0)
        total = tl.sum(tl.where(sel, u, 0.0), 0)
        centre = mean - spread + (level + 0.5) * width
        centre = tl.minimum(tl.maximum(centre, -1.0), 1.0)
        value = tl.where(count > 0, total / tl.maximum(count, 1.0), centre) * unit
        tl.store(table_ptr + pid.to(tl.int64) * LEVELS + level, value)
    tl.store(code_ptr + place, code, mask=take)
    tl.store(index_ptr + place, local, mask=take)
    tl.store(finite_ptr + pid, finite.to(tl.int32))


def chunk_topk_select(flat: torch.Tensor, *, chunk: int, k: int, bits: int,
                      sigmas: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`commpress.kernels.reference.chunk_topk_select`."""
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n = flat.numel()
    rows = triton.cdiv(n, chunk)
    levels = 1 << bits
    code = torch.empty(rows, k, dtype=torch.int32, device=flat.device)
    index = torch.empty(rows, k, dtype=torch.int32, device=flat.device)
    table = torch.empty(rows, levels, dtype=torch.float32, device=flat.device)
    finite = torch.empty(rows, 1, dtype=torch.int32, device=flat.device)
    _chunk_topk_kernel[(rows,)](flat, n, code, index, table, finite, K=k, CHUNK=chunk,
                                LEVELS=levels, SIGMAS=float(sigmas),
                                num_warps=8 if chunk >= 2048 else 4)
    return (code.long(), index.long(),
            reference.chunk_table(table, finite.bool()))
