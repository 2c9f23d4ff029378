"""How the sharded optimizer's new weights reach every replica, decided once.

After the step each rank holds the new fp32 master of its shard; every replica needs
all shards in the training dtype. The ``dp.param`` rule sends the weights themselves
or their differences (qWD, :func:`commpress.delta_all_gather`); with several nodes a
compressed gather crosses the slow links once per shard and the node shares the result
exactly. :func:`weight_gather_levels` makes that choice for the real optimizer, its
played ranks (:func:`weight_gather_steps`) and the cost model alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback
from commpress.collectives import Handle, Topology
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import end, owned_input
from commpress.collectives.comm import check_sizes
from commpress.collectives.compressed_all_gather import all_gather_steps
from commpress.collectives.delta_gather import delta_gather_steps
from commpress.collectives.hierarchical import (
    EXACT,
    begin_two_level,
    two_level_all_gather_steps,
)
from commpress.collectives.levels import levels_used
from commpress.collectives.transport import Peers, Steps, run_into
from commpress.policy import Rule

LABEL = "dp.param"


def weight_gather_levels(rule: Rule, nodes: int, ranks_per_node: int) -> tuple[str, ...]:
    """How the new weights reach every replica: ``("inter", "intra")`` — compressed across
    nodes once per shard, then shared exactly inside the node — or ``("single",)``, one
    all-gather over the group (uncompressed, one node, or one rank per node). Decided
    here alone: the optimizer, its played ranks and the cost model ask."""
    if not rule.exact and levels_used(True, nodes * ranks_per_node,
                                      ranks_per_node) == ("intra", "inter"):
        return ("inter", "intra")
    return ("single",)


def gather_weights(weights: torch.Tensor, new: torch.Tensor, codec: Codec,
                   memory: ErrorFeedback | None, rule: Rule, topology: Topology,
                   group: dist.ProcessGroup, async_op: bool = False) -> torch.Tensor | Handle:
    """Move every rank's ``new`` shard into the replicated ``weights`` (rank order) with
    the policy's ``dp.param`` rule: differences (qWD) when ``rule.delta``, else the
    weights themselves, on the levels :func:`weight_gather_levels` picks. One prologue
    (ranks agree, the node levels are resolved once), then the very steps a played rank
    runs (:func:`weight_gather_steps`)."""
    call, _, peers = begin_two_level(
        "gather_weights", group, LABEL, EXACT, codec, topology, delta=rule.delta,
        inter_memory=memory,
        tensors={"weights": weights, "new": new},
        check=lambda n: check_sizes("gather_weights", weights, new, n, "weights", "new"))
    new = owned_input(new, call.codecs["inter"], async_op).reshape(-1)
    return end(run_into(weights, lambda flat: weight_gather_steps(
        flat, new, call.codecs["inter"], call.memories["inter"], rule, peers, call.stats,
        out=flat)), async_op)


def weight_gather_steps(weights: torch.Tensor, new: torch.Tensor, codec: Codec,
                        memory: ErrorFeedback | None, rule: Rule,
                        peers: tuple[Peers, Peers, Peers], stats: Stats,
                        out: torch.Tensor | None = None) -> Steps:
    """The steps of :func:`gather_weights` for one rank → the new flat replica, given its
    peers in the whole group, inside its node and across nodes (what a played rank runs).
    ``weights`` is the flat replica, read only; ``out``, a buffer an exact one-level
    gather may write into (the real replica)."""
    whole, intra, inter = peers
    if weight_gather_levels(rule, inter.size, intra.size) == ("single",):
        if rule.delta:  # every rank applies every rank's difference
            return delta_gather_steps(weights, new, codec, Peers(0, 1, None), whole, stats,
                                      LABEL, memory)
        dtype = new.dtype
        return all_gather_steps(new, codec, whole, stats, LABEL, out=out, memory=memory,
                                then=lambda values: values.to(dtype).reshape(-1))
    if rule.delta:
        return delta_gather_steps(weights, new, codec, intra, inter, stats, LABEL, memory)
    return two_level_all_gather_steps(new, EXACT, codec, intra, inter, stats, LABEL,
                                      inter_memory=memory)
