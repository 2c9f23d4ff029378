"""One data-parallel bucket's communication state, in one shape for every front-end.

A bucket is a run of gradients reduced together and, in sharded data parallelism, of
weights gathered back. What the policy gives it — its gradient codecs (``dp.grad``: one
level or TLq-HS's two, :class:`GradPath`) and its weight codec (``dp.param``: the
weights', or qWD's differences') — carries state that belongs to the values it
compresses: stochastic-rounding counters, error-feedback memory, and for qWD the
reference the differences are taken from, where the engine keeps no replica of its own.
The sharded optimizer, Megatron's buckets, DeepSpeed's partitions and FSDP2's modules
each hold one :class:`DPBucket` per bucket (the played optimizer one per played rank),
and keep only what is their own: where buckets come from and when they are ready.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commpress.codecs.error_feedback import coder_state, load_coder_state
from commpress.collectives import Handle, Topology
from commpress.collectives.byte_stats import Stats
from commpress.collectives.transport import Peers, Steps
from commpress.dp.fallback import MeasuredChoice
from commpress.dp.grad_path import GradPath
from commpress.dp.weight_gather import gather_weights, weight_gather_steps
from commpress.policy import Policy, Rule
from commpress.validate import InputError


class Reducer(Protocol):
    """What reduces a bucket's gradients and keeps the state of doing so: the policy's
    :class:`GradPath`, or the low-rank hook's factors. Every owner of a bucket's
    all-reduce — the bucket itself, its gradient path, a hook's reducer — offers these."""

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                   op: str = "avg", async_op: bool = False) -> torch.Tensor | Handle: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], memory: bool = True) -> None: ...


def needs_node_levels(policy: Policy) -> bool:
    """Whether the policy's data-parallel path may split a group into node levels:
    two-level gradients, or a lossy weight gather (:func:`weight_gather_levels`)."""
    return policy.two_level() or not policy.rule("dp", "param").exact


class DPBucket:
    """The codecs of one bucket: ``grad``, what reduces its gradients (the policy's
    :class:`GradPath`, or what ``reducer()`` makes: the low-rank hook's factors; none
    with ``grads=False``: an engine whose weights are gathered by other units than its
    gradients are reduced) and, when the bucket's weights are gathered
    (``weights=True``), ``param`` built from ``param_rule`` — the policy's ``dp.param``
    rule, or the one given (FSDP2 gathers exactly what qWD would send as differences).
    ``reference``: qWD's copy of this rank's weights, set by a front-end whose engine
    overwrites its own (saved with the state)."""

    def __init__(self, policy: Policy, topology: Topology, label: str = "dp.grad", *,
                 axis: str = "dp", level: str | None = None, grads: bool = True,
                 weights: bool = False, param_rule: Rule | None = None,
                 reducer: Callable[[], Reducer] | None = None) -> None:
        self.policy, self.topology, self.label, self.grads = policy, topology, label, grads
        # axis "outer": DiLoCo's pseudo-gradients, by the policy's outer.grad rules; level:
        # one level's rule alone (GradPath)
        self._grad_path_of = lambda p: GradPath(p, topology, label, axis, level)
        self.reducer = reducer or (lambda: self._grad_path_of(policy))
        self.param_rule = param_rule or (policy.rule("dp", "param") if weights else None)
        self.reference: torch.Tensor | None = None
        self.fresh()

    def fresh(self) -> None:
        """The codecs as the policy builds them: no memory, rounding streams from their
        start (a new run, or an elastic resume on another number of ranks); a measured
        fallback measures again."""
        self.grad = self.reducer() if self.grads else None
        self._fresh_param()
        self._fresh_choices()
        self._exact_grad: Reducer | None = None

    def alignment_under(self, policy: Policy) -> int:
        """The alignment this bucket would have under ``policy``'s rules."""
        units = [self._grad_path_of(policy).alignment] if self.grads else []
        if self.param_rule is not None:
            units.append(max(policy.rule("dp", "param").build().alignment, 1))
        return math.lcm(*units)

    def promote_param(self, policy: Policy) -> None:
        """Gather weights by ``policy``'s ``dp.param`` rule from now on (the guard's
        promotion): a fresh weight codec. What qWD's differences are taken against — the
        weights every replica gathered last — is kept, and the differences are taken with
        the new codec; a rule without differences needs no reference."""
        self.policy = policy
        self.param_rule = policy.rule("dp", "param")
        self._fresh_param()
        if not self.sends_differences:
            self.reference = None
        self.choices.pop("param", None)  # the new codec is measured anew
        if policy.fallback == "measured" and not self.param_rule.exact:
            self.choices["param"] = MeasuredChoice("dp.param")

    def promote_grad(self, policy: Policy) -> None:
        """Reduce gradients by ``policy``'s ``dp.grad`` rules from now on (the guard's
        promotion, :mod:`commpress.dp.guard`): a fresh gradient path — its memory and
        rounding streams start anew with the new codec; the weights' codecs are kept."""
        self.policy = policy
        self.reducer = lambda: self._grad_path_of(policy)
        self.grad = self.reducer()
        self._exact_grad = None
        self.choices.pop("grad", None)  # the new codec is measured anew
        if policy.fallback == "measured" and self.grad.lossy:
            self.choices["grad"] = MeasuredChoice(self.label)

    def _fresh_choices(self) -> None:
        """fallback: measured — a choice per collective that is not exact already."""
        self.choices: dict[str, MeasuredChoice] = {}
        if self.policy.fallback == "measured":
            if self.grad is not None and self.grad.lossy:
                self.choices["grad"] = MeasuredChoice(self.label)
            if self.param_rule is not None and not self.param_rule.exact:
                self.choices["param"] = MeasuredChoice("dp.param")

    def _fresh_param(self) -> None:
        rule = self.param_rule
        self.param = None if rule is None else rule.build()
        self.param_memory = None if rule is None else rule.build_memory()

    # -- what the bucket's owner may ask -------------------------------------------------
    @property
    def alignment(self) -> int:
        """Element count every codec of the bucket splits evenly on."""
        units = [] if self.grad is None else [self.grad.alignment]
        if self.param is not None:
            units.append(self.weights_alignment)
        return math.lcm(*units)

    @property
    def grad_alignment(self) -> int:
        """Element count the gradient codecs split evenly on."""
        return self.grad.alignment

    @property
    def grad_dtypes(self) -> frozenset[torch.dtype]:
        """The gradient dtypes the gradient codecs take."""
        return self.grad.supported_dtypes

    @property
    def weights_alignment(self) -> int:
        """Element count the weight codec splits evenly on."""
        return max(self.param.alignment, 1)

    @property
    def grad_lossy(self) -> bool:
        """Whether the reduced gradients can differ from an exact reduction."""
        return self.grad.lossy

    @property
    def weights_lossy(self) -> bool:
        """Whether the gathered weights can differ from the ranks' own."""
        return self.param_rule.lossy

    @property
    def sends_differences(self) -> bool:
        """qWD: the weights travel as differences from a reference every replica holds."""
        return self.param_rule is not None and self.param_rule.delta

    # -- gradients --------------------------------------------------------------------
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       group: dist.ProcessGroup | None, op: str = "avg",
                       async_op: bool = False) -> torch.Tensor | Handle:
        """This rank's slice of the gradients reduced over ``group``."""
        return self._grad_call(lambda path, a, probe: path.reduce_scatter(
            torch.empty_like(output) if probe else output, input, group, op=op, async_op=a),
            group, input.numel(), async_op)

    def reduce_scatter_parts(self, parts: list[torch.Tensor],
                             group: dist.ProcessGroup | None, op: str = "avg") -> torch.Tensor:
        """:func:`commpress.reduce_scatter_parts` of uneven ``parts``."""
        return self._grad_call(lambda path, a, probe: path.reduce_scatter_parts(
            [p.clone() for p in parts] if probe else parts, group, op=op),
            group, sum(p.numel() for p in parts), False)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                   op: str = "avg", async_op: bool = False,
                   also_agree: dict[str, object] | None = None) -> torch.Tensor | Handle:
        """The gradients reduced over ``group``, in place; ``also_agree``: the owner's own
        fields, agreed in the same round (:func:`commpress.all_reduce`)."""
        extra = {"also_agree": also_agree} if also_agree else {}
        return self._grad_call(lambda path, a, probe: path.all_reduce(
            tensor.clone() if probe else tensor, group, op=op, async_op=a, **extra),
            group, tensor.numel(), async_op)

    def _grad_call(self, call: Callable[[Reducer, bool, bool], Any],
                   group: dist.ProcessGroup | None, numel: int, async_op: bool) -> Any:
        """``call(reducer, async_op, probe)`` with the gradient reducer the measured
        fallback chooses (the policy's, or exact; ``probe``: on scratch copies), or the
        policy's."""
        choice = self.choices.get("grad")
        if choice is None:
            return call(self.grad, async_op, False)
        return choice.run(lambda way, a, probe: call(self._reducer(way), a, probe), group,
                          self.topology, numel, async_op)

    def _reducer(self, way: str) -> Reducer:
        if way == "compressed":
            return self.grad
        if self._exact_grad is None:
            self._exact_grad = GradPath(Policy.preset("none"), self.topology, self.label)
        return self._exact_grad

    def reduce_scatter_steps(self, flat: torch.Tensor, sizes: int | list[int],
                             peers: tuple[Peers, Peers, Peers], stats: Stats,
                             op: str = "avg") -> Steps:
        """The steps of :meth:`reduce_scatter` for one (played) rank."""
        self._check_played()
        return self.grad.reduce_scatter_steps(flat, sizes, peers, stats, op)

    def all_reduce_steps(self, flat: torch.Tensor, peers: tuple[Peers, Peers, Peers],
                         stats: Stats, op: str = "avg") -> Steps:
        """The steps of :meth:`all_reduce` for one (played) rank."""
        self._check_played()
        return self.grad.all_reduce_steps(flat, peers, stats, op)

    def _check_played(self) -> None:
        if self.choices:
            raise InputError(f"policy {self.policy.name!r}: fallback=measured times the "
                             "collectives on the live links, and played ranks have none; "
                             "allowed in simulate: fallback off")

    # -- weights ----------------------------------------------------------------------
    def follow(self, mine: torch.Tensor) -> None:
        """qWD, for an engine that overwrites its own replica: the reference is now
        ``mine``, this rank's slice as every replica holds it (at set-up, after a checkpoint
        load, or each backward). Nothing without differences."""
        if not self.sends_differences:
            return
        if self.reference is None:
            self.reference = mine.detach().clone()
        else:
            self.reference.copy_(mine)

    def take_new_weights(self, mine: torch.Tensor) -> torch.Tensor:
        """The new weights to gather from ``mine``, this rank's slice of a replica the
        engine has just overwritten with them; with a reference (:meth:`follow`) ``mine``
        gets the reference back — the weights every replica holds, which the differences
        are taken against — and :meth:`weights_gathered` then makes it the next one."""
        if self.reference is None:
            return mine
        new = mine.clone()
        mine.copy_(self.reference)
        return new

    def weights_gathered(self, mine: torch.Tensor) -> None:
        """After the gather of :meth:`take_new_weights`: ``mine`` holds the new weights as
        every replica has them, the next reference."""
        if self.reference is not None:
            self.reference.copy_(mine)

    def gather_weights(self, weights: torch.Tensor, new: torch.Tensor,
                       group: dist.ProcessGroup, async_op: bool = False
                       ) -> torch.Tensor | Handle:
        """Every rank's ``new`` shard into the replicated ``weights`` with this bucket's
        weight codec (:func:`commpress.dp.weight_gather.gather_weights`); exact, where the
        measured fallback chose it (every replica then holds the exact weights, which is
        also what qWD's next differences are taken against)."""
        choice = self.choices.get("param")
        if choice is None:
            return gather_weights(weights, new, self.param, self.param_memory,
                                  self.param_rule, self.topology, group, async_op)
        exact = Rule()

        def call(way: str, a: bool, probe: bool) -> Any:
            if way == "compressed":
                return gather_weights(weights, new, self.param, self.param_memory,
                                      self.param_rule, self.topology, group, a)
            return gather_weights(weights.clone() if probe else weights, new, exact.build(),
                                  None, exact, self.topology, group, a)
        return choice.run(call, group, self.topology, new.numel(), async_op)

    def gather_weights_steps(self, weights: torch.Tensor, new: torch.Tensor,
                             peers: tuple[Peers, Peers, Peers], stats: Stats) -> Steps:
        """The steps of :meth:`gather_weights` for one (played) rank."""
        self._check_played()
        return weight_gather_steps(weights, new, self.param, self.param_memory, self.param_rule,
                                   peers, stats)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.grad is not None:
            state["grad"] = self.grad.state_dict()
        if self.param is not None:
            state["param"] = coder_state(self.param, self.param_memory)
        if self.reference is not None:
            state["reference"] = self.reference.detach().clone()
        if self.choices:
            state["fallback"] = {what: c.state_dict() for what, c in self.choices.items()}
        return state

    def load_state_dict(self, state: dict[str, Any], memory: bool = True) -> None:
        """Restore :meth:`state_dict`; ``memory=False`` checks its parts and starts the
        codecs fresh (the state was laid out for another world; a qWD reference then
        follows the loaded weights, as the front-end sets it)."""
        parts = {"grad"} if self.grad is not None else set()
        if self.param is not None:
            parts.add("param")
        if self.reference is not None:
            parts.add("reference")
        if self.choices:
            parts.add("fallback")
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        if not isinstance(state, dict) or set(state) != parts:
            raise InputError(f"bucket {self.label} codec state has {found}; this policy's "
                             f"bucket has {sorted(parts)}: resume with the same policy")
        saved = state.get("reference")
        if memory and saved is not None and (not isinstance(saved, torch.Tensor)
                                             or saved.shape != self.reference.shape):
            raise InputError(f"bucket {self.label} qWD reference of shape "
                             f"{tuple(getattr(saved, 'shape', ()))}; this bucket's is "
                             f"{tuple(self.reference.shape)}: resume with the same model")
        decided = state.get("fallback", {})
        if not isinstance(decided, dict) or set(decided) != set(self.choices):
            raise InputError(f"bucket {self.label} fallback state {decided!r}; this bucket "
                             f"measures {sorted(self.choices)}: resume with the same policy")
        if self.grad is not None:  # without memory: what every rank holds alike is kept
            self.grad.load_state_dict(state["grad"], memory)
        if not memory:  # another layout: the fallback measures again
            self._fresh_param()
            self._fresh_choices()
            return
        for what, choice in self.choices.items():
            choice.load_state_dict(decided[what])
        if self.param is not None:
            load_coder_state(self.param, self.param_memory, state["param"])
        if saved is not None:
            self.reference.copy_(saved)
