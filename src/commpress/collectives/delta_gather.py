"""qWD: all-gather weights as compressed differences (SDP4Bit, Jia et al., NeurIPS 2024).

In sharded data parallelism every rank holds the full low-precision weights ``W``
(bitwise identical everywhere) and owns the fp32 master of one shard. After the
optimizer step each rank encodes ``Δ = lowp(new master shard) − W_shard`` (4-bit,
group 2048 in the paper), the codes are all-gathered, and **every** rank — the owner
too — applies ``W += Δ̂`` from the same bytes: replicas stay bitwise identical, and the
master never sees the quantization error, which the next step's difference carries
(implicit error feedback). Sending ``W`` itself (qW) hurt the loss badly in the paper.

Across several nodes the differences cross the slow links once: the ranks of one
local index exchange their encoded differences across nodes and apply them to those
shards, then each node shares the updated weights in their own dtype — the same bits
as every rank applying every difference, in half the intra-node bytes of fp32
differences for bf16 weights.

The arithmetic is :mod:`commpress.codecs.delta`'s (:func:`difference`,
:func:`apply_difference`); this module moves the bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback
from commpress.codecs.delta import apply_difference, difference
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import end
from commpress.collectives.compressed_all_gather import all_gather_steps
from commpress.collectives.handle import Handle
from commpress.collectives.hierarchical import EXACT, begin_two_level
from commpress.collectives.topology import Topology
from commpress.collectives.transport import Peers, Steps, run
from commpress.validate import InputError


def delta_all_gather(
    weights: torch.Tensor,
    shard: torch.Tensor,
    *,
    codec="int4:group=2048",
    topology: Topology | None = None,
    group: dist.ProcessGroup | None = None,
    label: str | None = None,
    async_op: bool = False,
    memory: ErrorFeedback | None = None,
) -> torch.Tensor | Handle:
    """Move every rank's slice of the replicated ``weights`` to that rank's new ``shard``,
    sending codes of the differences (qWD); ``weights`` is updated in place.

    Args:
        weights: ``world × shard.numel()`` elements, contiguous, identical on every rank
            (the low-precision model weights; slice ``r`` is rank ``r``'s shard).
        shard: this rank's new values for its slice (e.g. the fp32 master), cast to
            ``weights.dtype`` before the difference is taken.
        codec: the difference codec (the paper: ``int4:group=2048``).
        topology: node layout; with several nodes of several ranks, two levels.
        memory: error feedback around the differences' encode.

    Bytes this rank sends: ``wire_bytes(m)`` to each peer, ``m = shard.numel()``; two
    levels: to the ``nodes − 1`` peers of its local index, then ``m`` weights of
    ``weights.dtype`` to each node peer per node.

    Example::

        commpress.delta_all_gather(model_weights, master_shard, codec="int4:group=2048")
    """
    if not weights.is_contiguous():
        raise InputError("delta_all_gather: weights must be contiguous (the flat replica "
                         "every rank holds)")
    call, used, peers = begin_two_level(
        "delta_all_gather", group, label, EXACT, codec, topology, inter_memory=memory,
        tensors={"weights": weights, "shard": shard},
        check=lambda n: _check_sizes(weights, shard, n))
    flat = weights.view(-1)
    # one level: every rank applies every rank's difference
    intra, inter = peers[1:] if len(used) == 2 else (Peers(0, 1, None), peers[0])
    steps = delta_gather_steps(flat, shard.reshape(-1), call.codecs["inter"], intra, inter,
                               call.stats, call.label, call.memories["inter"])
    return end(run(steps, lambda new: flat.copy_(new).view_as(weights)), async_op)


def _check_sizes(weights: torch.Tensor, shard: torch.Tensor, world: int) -> None:
    if weights.numel() != world * shard.numel():
        raise InputError(f"delta_all_gather: weights must have world_size ({world}) × "
                         f"shard.numel() ({shard.numel()}) elements; got {weights.numel()}")


def delta_gather_steps(weights: torch.Tensor, shard: torch.Tensor, codec: Codec,
                       intra: Peers, inter: Peers, stats: Stats, label: str,
                       memory: ErrorFeedback | None = None) -> Steps:
    """One rank's qWD gather → the new flat replica. ``weights`` is the flat replica
    (read, not written), ``shard`` this rank's new values. One level when ``intra`` has
    one rank: the differences cross ``inter``, labelled ``label``, encoded through
    ``memory`` when given."""
    L, nodes, m = intra.size, inter.size, shard.numel()
    shards = weights.view(nodes, L, m)  # rank node·L + l owns shards[node, l]
    diff = difference(shard.to(weights.dtype), shards[inter.rank, intra.rank])
    del shard
    # Step 1: the differences of this local index cross nodes once and are applied to
    # its shards; every rank that gathers them computes the same
    mine = yield from all_gather_steps(
        diff, codec, inter, stats, label if L == 1 else f"{label}.inter", memory=memory,
        then=lambda full: apply_difference(shards[:, intra.rank], full.reshape(nodes, m)))
    if L == 1:
        return mine.view(-1)
    # Step 2: share them inside the node, in the weights' dtype
    return (yield from all_gather_steps(
        mine.reshape(-1), EXACT, intra, stats, f"{label}.intra",
        then=lambda local: local.view(L, nodes, m).transpose(0, 1).reshape(-1)))
