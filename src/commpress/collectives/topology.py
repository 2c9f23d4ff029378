"""Which ranks share a node: the two levels of hierarchical collectives.

Ranks ``node · L … node · L + L − 1`` form a node (``L = ranks_per_node``), as
``torchrun`` and SLURM number them. The intra-node group of a rank holds its node's
ranks; its inter-node group holds the ranks with the same local index on every node.
The sub-groups are created once per (group, L), by their members only, and kept in
the group's context (:mod:`commpress.collectives.agreement`), so they go with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from commpress.collectives.group_context import Levels, context
from commpress.collectives.levels import levels_used
from commpress.validate import InputError


def level_label(label: str, level: str) -> str:
    """The stats label of one level (``dp.grad.inter``; a single level keeps ``label``)."""
    return label if level == "single" else f"{label}.{level}"


@dataclass(frozen=True)
class Topology:
    """Node layout. ``ranks_per_node=None`` reads ``LOCAL_WORLD_SIZE`` (set by torchrun),
    else treats the whole group as one node — then inter-node codecs have no link to
    compress and only the intra-node level runs."""

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and (
                not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise InputError(f"Topology: ranks_per_node={self.ranks_per_node!r} is not allowed; "
                             "allowed: a positive integer dividing the world size")

    def _ranks_per_node(self, default: int) -> int:
        """The ranks per node given, else ``LOCAL_WORLD_SIZE``, else ``default``."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return int(os.environ.get("LOCAL_WORLD_SIZE", default))

    def ranks_per_node_in(self, world: int) -> int:
        """``L`` for a group of ``world`` ranks (at most ``world``), checked to divide it."""
        rpn = min(self._ranks_per_node(world), world)
        if world % rpn:
            raise InputError(f"Topology: world size {world} is not divisible by "
                             f"ranks_per_node={rpn}; allowed: a divisor of {world}")
        return rpn

    def node_of(self, global_rank: int) -> int:
        """The node of a global rank, as torchrun numbers them (``LOCAL_WORLD_SIZE`` ranks a
        node when ``ranks_per_node`` is None): for groups whose ranks are not contiguous,
        such as an expert-parallel group strided over data parallelism."""
        return global_rank // self._ranks_per_node(dist.get_world_size())

    def resolve(self, group: dist.ProcessGroup) -> Levels:
        """This rank's two levels of ``group`` (sub-groups created on first use)."""
        ctx = context(group)
        return ctx.levels(group, self.ranks_per_node_in(ctx.world))


__all__ = ["Levels", "Topology", "level_label", "levels_used"]
