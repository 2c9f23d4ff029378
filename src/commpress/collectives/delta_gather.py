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

The arithmetic is :class:`commpress.Delta`'s (:meth:`Delta.difference`,
:meth:`Delta.apply`); this module moves the bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.codecs import Delta
from commpress.collectives.agreement import Levels
from commpress.collectives.all_gather import run_all_gather
from commpress.collectives.call import Call, end
from commpress.collectives.handle import Handle
from commpress.collectives.hierarchical import EXACT, begin_two_level
from commpress.collectives.topology import Topology


def delta_all_gather(
    weights: torch.Tensor,
    shard: torch.Tensor,
    *,
    codec="int4:group=2048",
    topology: Topology | None = None,
    group: dist.ProcessGroup | None = None,
    label: str | None = None,
    async_op: bool = False,
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

    Bytes this rank sends: ``wire_bytes(m)`` to each peer, ``m = shard.numel()``; two
    levels: to the ``nodes − 1`` peers of its local index, then ``m`` weights of
    ``weights.dtype`` to each node peer per node.

    Example::

        commpress.delta_all_gather(model_weights, master_shard, codec="int4:group=2048")
    """
    if not weights.is_contiguous():
        raise ValueError("delta_all_gather: weights must be contiguous (the flat replica "
                         "every rank holds)")
    call, levels, single = begin_two_level(
        "delta_all_gather", group, label, EXACT, codec, topology,
        tensors={"weights": weights, "shard": shard},
        check=lambda n: _check_sizes(weights, shard, n))
    codec = call.codecs["inter"]
    m = shard.numel()
    if single is None:
        return end(_two_level(weights, shard, call, levels), async_op)
    # one level: every rank applies every rank's difference
    mine = weights.view(-1)[call.rank * m:(call.rank + 1) * m]
    diff = Delta.difference(shard.reshape(-1).to(weights.dtype), mine)
    full = torch.empty(call.world * m, dtype=torch.float32, device=weights.device)
    gather = run_all_gather(full, diff, codec, call.group, call.stats, call.label)

    def finish() -> torch.Tensor:
        gather.wait()
        return Delta.apply(weights.view(-1), full, out=weights.view(-1)).view_as(weights)

    return end(Handle(finish), async_op)


def _check_sizes(weights: torch.Tensor, shard: torch.Tensor, world: int) -> None:
    if weights.numel() != world * shard.numel():
        raise ValueError(f"delta_all_gather: weights must have world_size ({world}) × "
                         f"shard.numel() ({shard.numel()}) elements; got {weights.numel()}")


def _two_level(weights: torch.Tensor, shard: torch.Tensor, call: Call, levels: Levels) -> Handle:
    L, nodes, m = levels.ranks_per_node, levels.nodes, shard.numel()
    shards = weights.view(nodes, L, m)  # rank node·L + l owns shards[node, l]
    diff = Delta.difference(shard.reshape(-1).to(weights.dtype),
                            shards[levels.node, levels.local_rank])
    # Step 1: the differences of this local index cross nodes once
    across = torch.empty(nodes * m, dtype=torch.float32, device=weights.device)
    run_all_gather(across, diff, call.codecs["inter"], levels.inter, call.stats,
                   f"{call.label}.inter").wait()

    def finish() -> torch.Tensor:
        # Step 2: apply them to this local index's shards; Step 3: share inside the node
        mine = Delta.apply(shards[:, levels.local_rank], across.view(nodes, m))
        local = torch.empty(L * nodes * m, dtype=weights.dtype, device=weights.device)
        run_all_gather(local, mine.reshape(-1), EXACT, levels.intra, call.stats,
                       f"{call.label}.intra").wait()
        shards.copy_(local.view(L, nodes, m).transpose(0, 1))
        return weights

    return Handle(finish)
