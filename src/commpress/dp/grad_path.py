"""The data-parallel gradient path a policy asks for, as one object.

The DDP hook, FSDP2's reduce-scatter and the sharded optimizer all reduce gradients
the same way: with the policy's ``dp.grad`` codec in one level, or — when the policy
names ``intra`` and ``inter`` codecs — in two levels over the node topology. A
:class:`GradPath` holds those codecs (and so their state: stochastic-rounding counters,
error-feedback residuals) and runs either collective; it checkpoints with
``state_dict()``. Each bucket gets its own path, since codec state belongs to the
values it compresses.
"""

from __future__ import annotations

import logging
import math
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback
from commpress.codecs.error_feedback import coder_state, load_coder_state
from commpress.collectives import (
    Handle,
    Topology,
    all_reduce,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
    reduce_scatter,
    reduce_scatter_parts,
)
from commpress.collectives.byte_stats import Stats
from commpress.collectives.hierarchical import (
    all_reduce_levels_steps,
    reduce_scatter_levels_steps,
)
from commpress.collectives.topology import levels_used
from commpress.collectives.transport import Peers, Steps
from commpress.policy import Policy
from commpress.validate import InputError

log = logging.getLogger(__name__)


class GradPath:
    """One bucket's gradient codecs: ``{"single": c}`` or ``{"intra": a, "inter": b}``,
    from the policy's ``dp.grad`` rules (``axis="outer"``: its ``outer.grad`` rules, the
    pseudo-gradients of :class:`commpress.DiLoCo`), and beside each its error-feedback
    memory where the rule asks for one (``memories``, by the same names). ``level``: one
    level's rule alone, run as the one level of a group that spans only that link
    (HSDP's all-reduce across replicas: ``"inter"``)."""

    def __init__(self, policy: Policy, topology: Topology, label: str = "dp.grad",
                 axis: str = "dp", level: str | None = None) -> None:
        self.topology = topology
        self.label = label
        self.policy, self.axis, self.level = policy, axis, level
        self.codecs, self.memories = self._fresh()

    def _fresh(self) -> tuple[dict[str, Codec], dict[str, ErrorFeedback | None]]:
        policy, axis = self.policy, self.axis
        levels = {"intra": "intra", "inter": "inter"} if (
            self.level is None and policy.two_level(axis)) else {"single": self.level}
        return ({name: policy.codec_for(axis, "grad", lv) for name, lv in levels.items()},
                {name: policy.memory_for(axis, "grad", lv) for name, lv in levels.items()})

    @property
    def two_level(self) -> bool:
        return "single" not in self.codecs

    @property
    def alignment(self) -> int:
        """Element count every codec of the path splits evenly on."""
        return math.lcm(*(max(c.alignment, 1) for c in self.codecs.values()))

    @property
    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """The input dtypes every codec of the path takes."""
        return frozenset.intersection(*(frozenset(c.supported_dtypes)
                                        for c in self.codecs.values()))

    @cached_property  # the rules never change; asked per bucket call
    def lossy(self) -> bool:
        """Whether the reduced gradients can differ from an exact reduction."""
        levels = [self.level] if "single" in self.codecs else list(self.codecs)
        return any(self.policy.rule(self.axis, "grad", lv).lossy for lv in levels)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       group: dist.ProcessGroup | None, op: str = "avg",
                       async_op: bool = False) -> torch.Tensor | Handle:
        if not self.two_level:
            return reduce_scatter(output, input, self.codecs["single"], group=group, op=op,
                                  label=self.label, async_op=async_op,
                                  memory=self.memories["single"])
        return hierarchical_reduce_scatter(output, input, intra=self.codecs["intra"],
                                           inter=self.codecs["inter"], topology=self.topology,
                                           group=group, op=op, label=self.label,
                                           async_op=async_op, **self._level_memories())

    def reduce_scatter_parts(self, parts: list[torch.Tensor], group: dist.ProcessGroup | None,
                             op: str = "avg") -> torch.Tensor:
        """:func:`commpress.reduce_scatter_parts` of uneven ``parts`` with these codecs."""
        return reduce_scatter_parts(parts, self.codecs.get("single", "none"),
                                    intra=self.codecs.get("intra"),
                                    inter=self.codecs.get("inter"), topology=self.topology,
                                    group=group, op=op, label=self.label,
                                    memory=self.memories.get("single"),
                                    **self._level_memories())

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "avg",
                   async_op: bool = False, also_agree: dict[str, object] | None = None
                   ) -> torch.Tensor | Handle:
        if not self.two_level:
            return all_reduce(tensor, self.codecs["single"], group=group, op=op,
                              label=self.label, async_op=async_op, also_agree=also_agree,
                              memory=self.memories["single"])
        return hierarchical_all_reduce(tensor, intra=self.codecs["intra"],
                                       inter=self.codecs["inter"], topology=self.topology,
                                       group=group, op=op, label=self.label, async_op=async_op,
                                       also_agree=also_agree, **self._level_memories())

    def _level_memories(self) -> dict[str, ErrorFeedback | None]:
        return {"intra_memory": self.memories.get("intra"),
                "inter_memory": self.memories.get("inter")}

    def reduce_scatter_steps(self, flat: torch.Tensor, sizes: int | list[int],
                             peers: tuple[Peers, Peers, Peers], stats: Stats,
                             op: str = "avg") -> Steps:
        """The steps of :meth:`reduce_scatter` (``sizes`` an int) or of
        :meth:`reduce_scatter_parts` (a list) for one rank, given its peers in the whole
        group, inside its node and across nodes (what a played rank runs)."""
        whole, intra, inter = peers
        used = levels_used(self.two_level, whole.size, intra.size)
        return reduce_scatter_levels_steps(flat, sizes, self.codecs, used, whole, intra,
                                           inter, stats, self.label, op, whole.rank,
                                           self.memories)

    def all_reduce_steps(self, flat: torch.Tensor, peers: tuple[Peers, Peers, Peers],
                         stats: Stats, op: str = "avg") -> Steps:
        """The steps of :meth:`all_reduce` for one rank (as :meth:`reduce_scatter_steps`)."""
        whole, intra, inter = peers
        used = levels_used(self.two_level, whole.size, intra.size)
        return all_reduce_levels_steps(flat, self.codecs, used, whole, intra, inter, stats,
                                       self.label, op, memories=self.memories)

    def state_dict(self) -> dict[str, Any]:
        return {k: coder_state(c, self.memories[k]) for k, c in self.codecs.items()}

    def load_state_dict(self, state: dict[str, Any], memory: bool = True) -> None:
        """Restore the codecs' state; ``memory=False`` checks it and starts the codecs
        fresh (an elastic resume: the memory was laid out for another world)."""
        if set(state) != set(self.codecs):
            raise InputError(f"gradient codec state has levels {sorted(state)}; this policy "
                             f"has {sorted(self.codecs)}")
        if not memory:
            self.codecs, self.memories = self._fresh()
            return
        for k, c in self.codecs.items():
            load_coder_state(c, self.memories[k], state[k])


def grad_levels(policy: Policy, world: int, ranks_per_node: int,
                axis: str = "dp") -> tuple[str, ...]:
    """The levels the policy's ``axis.grad`` codecs run on over ``world`` ranks in nodes of
    ``ranks_per_node`` (checked to divide it) — what the front-ends, the played ranks and
    the cost model ask, answered here alone (:func:`levels_used`)."""
    return levels_used(policy.two_level(axis), world, ranks_per_node)


def make_levels_now(policy: Policy, topology: Topology, group: dist.ProcessGroup,
                    axis: str = "dp") -> None:
    """Make the node levels of ``group`` that the policy's ``axis.grad`` path needs now, in
    the caller's set-up that every rank reaches, not later on a communication thread."""
    if policy.two_level(axis):
        topology.resolve(group)


_SAID: set[tuple] = set()


def say_once(logger: logging.Logger, key: tuple, rank: int, message: str, *args) -> None:
    """Log ``message`` as a warning on rank 0, once per ``key`` in this process."""
    if rank == 0 and key not in _SAID:
        _SAID.add(key)
        logger.warning(message, *args)


def warn_if_uncompressed(policy: Policy, topology: Topology, group: dist.ProcessGroup | None,
                         what: str, axis: str = "dp") -> bool:
    """Warn once, on the group's first rank, when the policy's ``axis.grad`` codecs compress
    but none of them runs on this group's topology — ``int2ef`` (exact inside a node) on
    one node compresses nothing — naming the policy, the topology seen and what to use
    instead. Returns whether it is so."""
    world = dist.get_world_size(group)
    rpn = topology.ranks_per_node_in(world)
    levels = ["intra", "inter"] if policy.two_level(axis) else [None]
    compressed = [lv for lv in levels if not policy.rule(axis, "grad", lv).exact]
    used = grad_levels(policy, world, rpn, axis)
    if world == 1 or not compressed or any((lv or "single") in used for lv in compressed):
        return False
    nodes = world // rpn
    # what to use instead, in the words of the front-end's own arguments
    instead = ("the topology of the sites (topology=commpress.Topology(1): one rank per "
               "site), or a policy whose outer.grad is one codec "
               "({'outer': {'grad': 'int4:hadamard=128'}})" if axis == "outer" else
               "the topology of a multi-node run, or a one-level codec such as "
               "'int4:hadamard=128'")
    say_once(log, ("uncompressed", what, policy.name, world, rpn), dist.get_rank(group),
             "%s: policy %r compresses nothing here: its compressed %s.grad codecs are for the %s "
             "level, and %d ranks in %d node(s) of %d have no %s link (topology from "
             "LOCAL_WORLD_SIZE or Topology(ranks_per_node)); give %s",
             what, policy.name, axis, "/".join(lv for lv in compressed if lv), world, nodes, rpn,
             "inter-node" if nodes == 1 else "intra-node", instead)
    return True
