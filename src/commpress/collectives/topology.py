"""Which ranks share a node: the two levels of hierarchical collectives.

Ranks ``node · L … node · L + L − 1`` form a node (``L = ranks_per_node``), as
``torchrun`` and SLURM number them. The intra-node group of a rank holds its node's
ranks; its inter-node group holds the ranks with the same local index on every node.
Sub-groups are created once per (parent group, L), by their members only, and cached.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Node layout. ``ranks_per_node=None`` reads ``LOCAL_WORLD_SIZE`` (set by torchrun),
    else treats the whole group as one node."""

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"Topology: ranks_per_node={self.ranks_per_node} is not allowed; "
                             "allowed: a positive integer dividing the world size")

    def resolve(self, group: dist.ProcessGroup) -> Levels:
        world = dist.get_world_size(group)
        rpn = self.ranks_per_node
        if rpn is None:
            rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        rpn = min(rpn, world)
        if world % rpn:
            raise ValueError(f"Topology: world size {world} is not divisible by "
                             f"ranks_per_node={rpn}; allowed: a divisor of {world}")
        return _levels(group, rpn)


@dataclass(frozen=True)
class Levels:
    """The resolved two levels for this rank."""

    ranks_per_node: int
    nodes: int
    node: int
    local_rank: int
    intra: dist.ProcessGroup | None  # None when there is one rank per node
    inter: dist.ProcessGroup | None  # None when there is one node


_CACHE: dict[tuple, Levels] = {}


def _levels(group: dist.ProcessGroup, rpn: int) -> Levels:
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (ranks, rpn)
    if key in _CACHE:
        return _CACHE[key]
    world = len(ranks)
    nodes = world // rpn
    me = dist.get_rank(group)
    intra = inter = None
    if rpn > 1 and nodes > 1:
        # Only the members of a sub-group create it (local synchronization): ``group``
        # may be one of several data-parallel groups, whose ranks reach this point at
        # different times and must not wait for each other.
        node, local = me // rpn, me % rpn
        intra = dist.new_group([ranks[node * rpn + i] for i in range(rpn)],
                               use_local_synchronization=True)
        inter = dist.new_group([ranks[n * rpn + local] for n in range(nodes)],
                               use_local_synchronization=True)
    elif rpn > 1:
        intra = group
    elif nodes > 1:
        inter = group
    levels = Levels(rpn, nodes, me // rpn, me % rpn, intra, inter)
    _CACHE[key] = levels
    return levels


def forget_topologies() -> None:
    """Drop cached sub-groups (after destroying and re-creating process groups)."""
    _CACHE.clear()
