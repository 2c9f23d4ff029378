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
from commpress.collectives.agreement import check_agreement
from commpress.collectives.all_gather import finish_all_gather, start_all_gather
from commpress.collectives.comm import REDUCE_OPS, check_op, describe, resolve_group
from commpress.collectives.handle import Handle, completed
from commpress.collectives.reduce_scatter import (
    check_float,
    finish_reduce_scatter,
    is_exact,
    resolve_codec,
    start_reduce_scatter,
)
from commpress.collectives.stats import record


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
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_op(op)
    check_float("tensor", tensor)
    label = label or "all_reduce"
    n = dist.get_world_size(group)
    check_agreement(group, "all_reduce", tensor.device, label=label, codec=codec.spec(), op=op,
                    **describe(tensor))
    if n == 1 or tensor.numel() == 0:
        return completed(tensor) if async_op else tensor
    if is_exact(codec):
        work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=True)
        size = 2 * (n - 1) * (-(-tensor.numel() // n)) * tensor.element_size()
        record(label, calls=1, elements=2 * (n - 1) * (-(-tensor.numel() // n)),
               wire_bytes=size, raw_bytes=size)
        handle = Handle(lambda: (work.wait(), tensor)[1])
        return handle if async_op else handle.wait()

    rank = dist.get_rank(group)
    numel = tensor.numel()
    if n == 2:
        return _exchange_and_sum(tensor, codec, group, op, label, rank, async_op)
    m = -(-numel // n)
    x = chunks.pad_chunks(tensor.reshape(-1), n, m, chunks.padded_chunk(codec, m))
    # Step 1-2
    ex, m_pad = start_reduce_scatter(x, codec, group, label, stream=rank)

    def finish() -> torch.Tensor:
        # Step 3
        shard = finish_reduce_scatter(ex, codec, label, tensor.dtype, m_pad, tensor.device)
        if op == "avg":
            shard /= n
        # Step 4-6 (the shard travels in the tensor's dtype, like the input did)
        g = start_all_gather(shard.to(tensor.dtype), codec, group, label, stream=rank,
                             key=label + ".shard", count_call=False)
        values = finish_all_gather(g, codec, label, tensor.dtype, m_pad, tensor.device)
        tensor.view(-1).copy_(values[:, :m].reshape(-1)[:numel])
        return tensor

    handle = Handle(finish)
    return handle if async_op else handle.wait()



def _exchange_and_sum(tensor: torch.Tensor, codec, group, op: str, label: str, rank: int,
                      async_op: bool) -> torch.Tensor | Handle:
    numel = tensor.numel()
    m_pad = chunks.padded_chunk(codec, numel)
    x = chunks.pad_chunks(tensor.reshape(-1), 1, numel, m_pad).view(-1)
    g = start_all_gather(x, codec, group, label, stream=rank)

    def finish() -> torch.Tensor:
        values = finish_all_gather(g, codec, label, tensor.dtype, m_pad, tensor.device)
        total = values[0] + values[1]  # rank order on both ranks: bitwise identical
        if op == "avg":
            total /= 2
        tensor.view(-1).copy_(total[:numel])
        return tensor

    handle = Handle(finish)
    return handle if async_op else handle.wait()
