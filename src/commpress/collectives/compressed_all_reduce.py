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

from commpress.codecs import Codec, ErrorFeedback
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import begin, end, is_exact
from commpress.collectives.comm import rank_in
from commpress.collectives.compressed_all_gather import all_gather_steps
from commpress.collectives.compressed_reduce_scatter import exchange_and_sum
from commpress.collectives.handle import Handle
from commpress.collectives.transport import Peers, Reduce, Steps, run_into


def two_rank_exchange(world: int) -> bool:
    """Whether a compressed all-reduce over ``world`` ranks exchanges whole encoded
    tensors (two ranks: each element quantized once, the same bytes) instead of a
    reduce-scatter and an all-gather of the reduced chunks."""
    return world == 2


def all_reduce_steps(flat: torch.Tensor, codec: Codec, peers: Peers, stats: Stats,
                     label: str, op: str, memory: ErrorFeedback | None = None) -> Steps:
    """One rank's all-reduce of ``flat`` → the reduced values in its dtype, bitwise the
    same on every rank (``flat`` itself, reduced in place, when exact). ``memory`` is
    applied around both encodes (keys ``label`` and ``label.shard``)."""
    n, numel, dtype = peers.size, flat.numel(), flat.dtype
    if n == 1 or numel == 0:
        return flat
    chunk = -(-numel // n)
    if is_exact(codec, memory):
        size = 2 * (n - 1) * chunk * flat.element_size()
        count_sent(stats, label, 2 * (n - 1) * chunk, size, flat.element_size())
        request = Reduce(peers, stats, label, False, flat, op)
        del flat
        return (yield request)
    if two_rank_exchange(n):
        m_pad = chunks.padded_chunk(codec, numel)
        x = chunks.pad_chunks(flat, 1, numel, m_pad).view(-1)
        del flat
        # both ranks sum the two decoded copies in rank order: bitwise identical
        total = yield from all_gather_steps(x, codec, peers, stats, label, memory=memory,
                                            then=lambda values: values[0] + values[1])
        return (total / 2 if op == "avg" else total)[:numel].to(dtype)
    # Step 1-3: encode once, chunk i for rank i; all-to-all; decode and sum in fp32
    padded = [chunks.padded_chunk(codec, chunk)] * n
    x = chunks.pad_parts(flat, [chunk] * n, padded)
    del flat
    shard = yield from exchange_and_sum(x, padded, codec, peers, stats, label,
                                        rng_stream=peers.rank, memory=memory)
    if op == "avg":
        shard /= n
    # Step 4-6: encode that shard once (in the tensor's dtype, like the input), all-gather
    # its codes; every rank decodes every shard from the same bytes
    return (yield from all_gather_steps(
        shard.to(dtype), codec, peers, stats, label, key=label + ".shard", count_call=False,
        memory=memory, then=lambda values: values[:, :chunk].reshape(-1)[:numel].to(dtype)))


def run_all_reduce(tensor: torch.Tensor, codec: Codec, memory: ErrorFeedback | None,
                   group: dist.ProcessGroup, stats: Stats, label: str, op: str) -> Handle:
    """The all-reduce itself, once ranks agree, over torch.distributed."""
    peers = Peers(rank_in(group), group.size(), group)
    return run_into(tensor, lambda flat: all_reduce_steps(flat, codec, peers, stats, label, op,
                                                          memory))


def all_reduce(
    tensor: torch.Tensor,
    codec="none",
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
    async_op: bool = False,
    *,
    memory: ErrorFeedback | None = None,
    also_agree: dict[str, object] | None = None,
) -> torch.Tensor | Handle:
    """All-reduce ``tensor`` in place: sum (``op="sum"``) or mean (``op="avg"``) over ranks.

    Steps: 1. encode ``tensor`` once, chunk ``i`` for rank ``i``; 2. all-to-all; 3. decode
    and sum the received chunks in fp32 (and divide for ``avg``); 4. encode that shard
    once; 5. all-gather the codes; 6. every rank decodes all shards into ``tensor``.
    With ``codec="none"`` this is torch's own all-reduce. ``memory``: a
    :class:`commpress.ErrorFeedback` applied around both encodes. ``also_agree``: fields the
    caller's ranks must agree on too (a front-end's own check), in the same round as the
    call's.

    Example::

        commpress.all_reduce(grad, "int4:hadamard=128", label="dp.grad")
    """
    call = begin("all_reduce", group, label, {"codec": codec}, op=op,
                 memories={"codec": memory}, tensors={"tensor": tensor}, **(also_agree or {}))
    return end(run_all_reduce(tensor, call.codec, call.memory, call.group, call.stats,
                              call.label, op), async_op)
