"""Compressed all-reduce = compressed reduce-scatter + one encode of the reduced shard
+ compressed all-gather of its codes.

Every element is quantized once per stage (twice in all), independent of the number
of ranks, and every rank decodes the same all-gathered bytes: the result is bitwise
identical on all ranks, which data-parallel replicas need so they never drift.

Bytes this rank sends: ``(world − 1) · (wire_bytes(chunk) + wire_bytes(chunk))`` with
``chunk = ceil(numel / world)`` — about ``2 · numel · bits / 8``, as a ring all-reduce.

Two ranks exchange their encoded tensors instead and both sum the two decoded copies
in rank order: the same bytes, but every element is quantized once, not twice (the
inter-node stage of a two-node job is such a pair).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.collectives import chunks
from commpress.collectives.all_gather import finish_all_gather, start_all_gather
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import AnyCodec, begin, end, is_exact
from commpress.collectives.comm import REDUCE_OPS, writable_flat, write_back
from commpress.collectives.handle import Handle, completed
from commpress.collectives.reduce_scatter import finish_reduce_scatter, start_reduce_scatter


def run_all_reduce(tensor: torch.Tensor, codec: AnyCodec, group: dist.ProcessGroup,
                   stats: Stats, label: str, op: str) -> Handle:
    """The all-reduce itself, once ranks agree (sub-groups of a two-level call too)."""
    n = dist.get_world_size(group)
    numel = tensor.numel()
    if n == 1 or numel == 0:
        return completed(tensor)
    flat, copied = writable_flat(tensor)  # a non-contiguous tensor: a copy, written back
    chunk = -(-numel // n)
    if is_exact(codec):
        size = 2 * (n - 1) * chunk * tensor.element_size()
        stats.record(label, calls=1, elements=2 * (n - 1) * chunk, wire_bytes=size,
                     raw_bytes=size)
        work = dist.all_reduce(flat, op=REDUCE_OPS[op], group=group, async_op=True)
        return Handle(lambda: (work.wait(), write_back(tensor, flat, copied))[1])
    rank = dist.get_rank(group)
    if n == 2:
        return _exchange_and_sum(tensor, flat, copied, codec, group, stats, label, op, rank)

    # Step 1-2: encode once, chunk i for rank i; all-to-all
    m_pad = chunks.padded_chunk(codec, chunk)
    x = chunks.pad_chunks(flat, n, chunk, m_pad)
    ex = start_reduce_scatter(x, codec, group, stats, label, rng_stream=rank)

    def finish() -> torch.Tensor:
        # Step 3: decode and sum the received chunks in fp32 (and divide for avg)
        shard = finish_reduce_scatter(ex, codec, stats, label, tensor.dtype, m_pad,
                                      tensor.device)
        if op == "avg":
            shard /= n
        # Step 4-5: encode that shard once (in the tensor's dtype, like the input) and
        # all-gather its codes
        g = start_all_gather(shard.to(tensor.dtype), codec, group, stats, label,
                             rng_stream=rank, key=label + ".shard", count_call=False)
        # Step 6: every rank decodes every shard from the same bytes
        values = finish_all_gather(g, codec, stats, label, tensor.dtype, m_pad, tensor.device)
        flat.copy_(values[:, :chunk].reshape(-1)[:numel])
        return write_back(tensor, flat, copied)

    return Handle(finish)


def _exchange_and_sum(tensor: torch.Tensor, flat: torch.Tensor, copied: bool,
                      codec: AnyCodec, group: dist.ProcessGroup, stats: Stats, label: str,
                      op: str, rank: int) -> Handle:
    numel = tensor.numel()
    m_pad = chunks.padded_chunk(codec, numel)
    x = chunks.pad_chunks(flat, 1, numel, m_pad).view(-1)
    g = start_all_gather(x, codec, group, stats, label, rng_stream=rank)

    def finish() -> torch.Tensor:
        values = finish_all_gather(g, codec, stats, label, tensor.dtype, m_pad, tensor.device)
        total = values[0] + values[1]  # rank order on both ranks: bitwise identical
        if op == "avg":
            total /= 2
        flat.copy_(total[:numel])
        return write_back(tensor, flat, copied)

    return Handle(finish)


def all_reduce(
    tensor: torch.Tensor,
    codec="none",
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """All-reduce ``tensor`` in place: sum (``op="sum"``) or mean (``op="avg"``) over ranks.

    Steps: 1. encode ``tensor`` once, chunk ``i`` for rank ``i``; 2. all-to-all; 3. decode
    and sum the received chunks in fp32 (and divide for ``avg``); 4. encode that shard
    once; 5. all-gather the codes; 6. every rank decodes all shards into ``tensor``.
    With ``codec="none"`` this is torch's own all-reduce.

    Example::

        commpress.all_reduce(grad, "int4:hadamard=128", label="dp.grad")
    """
    call = begin("all_reduce", group, label, {"codec": codec}, op=op,
                 tensors={"tensor": tensor})
    return end(run_all_reduce(tensor, call.codec, call.group, call.stats, call.label, op),
               async_op)
