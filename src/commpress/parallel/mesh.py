"""The dp × tp × pp layout of ranks, Megatron's order: TP innermost, then PP, then DP.

``rank = dp_idx · (pp · tp) + pp_idx · tp + tp_idx``: tensor-parallel peers are
neighbours (inside a node, where links are fast), pipeline stages next, data-parallel
replicas outermost. Every rank creates every sub-group in the same order.

Expert parallelism borrows from data parallelism: ``ep`` consecutive data-parallel
indices form an expert-parallel group (``ep_idx = dp_idx % ep``), and the data-parallel
ranks with the same ``ep_idx`` form its expert-data-parallel group, which holds one
expert's replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from commpress.collectives.comm import group_timeout
from commpress.collectives.group_context import release
from commpress.validate import InputError


@dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)} is not allowed; allowed: >= 1")
        if self.dp % self.ep:
            raise InputError(f"ep={self.ep} does not divide dp={self.dp}; allowed: an "
                             "expert-parallel degree that divides the data-parallel degree "
                             "(expert parallelism borrows data-parallel ranks)")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def check_world(self, world: int) -> None:
        if world != self.world:
            raise InputError(f"world size {world} is not dp × tp × pp = {self.dp} × {self.tp} × "
                             f"{self.pp} = {self.world}; allowed: set --dp/--tp/--pp so their "
                             f"product is the number of ranks")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_idx, pp_idx, tp_idx) of a global rank."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp_idx: int, pp_idx: int, tp_idx: int) -> int:
        return dp_idx * self.pp * self.tp + pp_idx * self.tp + tp_idx


@dataclass
class Mesh:
    """This rank's coordinates and its dp, tp and pp process groups."""

    shape: MeshShape
    rank: int
    dp_idx: int
    pp_idx: int
    tp_idx: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    pp_ranks: list[int]
    ep_group: dist.ProcessGroup | None = None  # with ep > 1: this rank's expert-parallel
    edp_group: dist.ProcessGroup | None = None  # and expert-data-parallel groups

    @property
    def last_stage(self) -> bool:
        return self.pp_idx == self.shape.pp - 1

    def release(self) -> None:
        """Destroy this rank's dp, tp and pp groups (and commpress's sub-groups of them)
        after the run's last collective."""
        groups = (self.dp_group, self.tp_group, self.pp_group, self.ep_group, self.edp_group)
        for group in {id(g): g for g in groups if g is not None}.values():
            release(group)


def build_mesh(shape: MeshShape) -> Mesh:
    """Create the sub-groups (collective: every rank must call it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shape.check_world(world)
    dp_i, pp_i, tp_i = shape.coords(rank)
    mine: dict[str, dist.ProcessGroup] = {}
    pp_ranks: list[int] = []
    timeout = group_timeout()  # the default group's, not torch's 30 min for a new group
    for axis in ("tp", "pp", "dp"):
        for ranks in _groups(shape, axis):
            # single-rank groups too: "no peers" must not read as "the default group"
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[axis] = g
                if axis == "pp":
                    pp_ranks = ranks
    if shape.ep > 1:
        for dp_ranks in _groups(shape, "dp"):
            for axis, ranks in _expert_groups(dp_ranks, shape.ep):
                g = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[axis] = g
    return Mesh(shape, rank, dp_i, pp_i, tp_i, mine["dp"], mine["tp"], mine["pp"], pp_ranks,
                mine.get("ep"), mine.get("edp"))


def _expert_groups(dp_ranks: list[int], ep: int) -> list[tuple[str, list[int]]]:
    """One data-parallel group's expert-parallel groups (``ep`` consecutive ranks each),
    then its expert-data-parallel groups (the ranks ``ep`` apart), by axis."""
    return ([("ep", dp_ranks[i:i + ep]) for i in range(0, len(dp_ranks), ep)]
            + [("edp", dp_ranks[j::ep]) for j in range(ep)])


def _groups(shape: MeshShape, axis: str) -> list[list[int]]:
    """The rank lists of ``axis``'s groups (ranks that differ only in that index), in the
    order of the other two indices."""
    ranks = torch.arange(shape.world).view(shape.dp, shape.pp, shape.tp)
    dim = ("dp", "pp", "tp").index(axis)
    return ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
