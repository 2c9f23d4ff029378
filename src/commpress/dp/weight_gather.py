"""How the sharded optimizer's new weights reach every replica, decided once.

After the step each rank holds the new fp32 master of its shard; every replica needs
all shards in the training dtype. The ``dp.param`` rule sends the weights themselves
or their differences (qWD, :func:`commpress.delta_all_gather`); with several nodes a
compressed gather crosses the slow links once per shard and the node shares the result
exactly. :func:`weight_gather_levels` makes that choice for the real optimizer, its
played ranks (:func:`weight_gather_steps`) and the cost model alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives import (
    Handle,
    Topology,
    all_gather,
    delta_all_gather,
    hierarchical_all_gather,
)
from commpress.collectives.byte_stats import Stats
from commpress.collectives.compressed_all_gather import all_gather_steps
from commpress.collectives.delta_gather import delta_gather_steps
from commpress.collectives.hierarchical import EXACT, two_level_all_gather_steps
from commpress.collectives.transport import Peers, Steps
from commpress.policy import Rule


def weight_gather_levels(rule: Rule, nodes: int, ranks_per_node: int) -> tuple[str, ...]:
    """How the new weights reach every replica: ``("inter", "intra")`` — compressed across
    nodes once per shard, then shared exactly inside the node — or ``("single",)``, one
    all-gather over the group (uncompressed, one node, or one rank per node). Decided
    here alone: the optimizer, its played ranks and the cost model ask."""
    if nodes > 1 and ranks_per_node > 1 and not rule.exact:
        return ("inter", "intra")
    return ("single",)


def gather_weights(weights: torch.Tensor, new: torch.Tensor, codec: Any, rule: Rule,
                   topology: Topology, group: dist.ProcessGroup,
                   async_op: bool = False) -> torch.Tensor | Handle:
    """Move every rank's ``new`` shard into the replicated ``weights`` (rank order) with
    the policy's ``dp.param`` rule: differences (qWD) when ``rule.delta``, else the
    weights themselves, on the levels :func:`weight_gather_levels` picks."""
    levels = topology.resolve(group)
    two_level = len(weight_gather_levels(rule, levels.nodes, levels.ranks_per_node)) == 2
    if rule.delta:
        return delta_all_gather(weights, new, codec=codec,
                                topology=topology if two_level else Topology(1), group=group,
                                label="dp.param", async_op=async_op)
    if two_level:
        return hierarchical_all_gather(weights, new, inter=codec, topology=topology,
                                       group=group, label="dp.param", async_op=async_op)
    return all_gather(weights, new, codec, group=group, label="dp.param", async_op=async_op)


def weight_gather_steps(weights: torch.Tensor, new: torch.Tensor, codec: Any, rule: Rule,
                        peers: tuple[Peers, Peers, Peers], stats: Stats) -> Steps:
    """The steps of :func:`gather_weights` for one rank → the new flat replica, given its
    peers in the whole group, inside its node and across nodes (what a played rank runs).
    ``weights`` is the flat replica, read only."""
    whole, intra, inter = peers
    if len(weight_gather_levels(rule, inter.size, intra.size)) == 1:
        intra, inter = Peers(0, 1, None), whole
    if rule.delta:
        return delta_gather_steps(weights, new, codec, intra, inter, stats, "dp.param")
    if intra.size == 1:
        dtype = new.dtype
        return all_gather_steps(new, codec, inter, stats, "dp.param",
                                then=lambda values: values.to(dtype).reshape(-1))
    return two_level_all_gather_steps(new, EXACT, codec, intra, inter, stats, "dp.param")
