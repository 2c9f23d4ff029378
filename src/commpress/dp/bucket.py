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
from typing import Any

import torch
import torch.distributed as dist

from commpress.codecs.error_feedback import split
from commpress.collectives import Handle, Topology
from commpress.collectives.byte_stats import Stats
from commpress.collectives.transport import Peers, Steps
from commpress.dp.grad_path import GradPath
from commpress.dp.weight_gather import gather_weights, weight_gather_steps
from commpress.policy import Policy, Rule
from commpress.validate import InputError


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
                 axis: str = "dp", grads: bool = True, weights: bool = False,
                 param_rule: Rule | None = None,
                 reducer: Callable[[], Any] | None = None) -> None:
        self.policy, self.topology, self.label, self.grads = policy, topology, label, grads
        # axis "outer": DiLoCo's pseudo-gradients, by the policy's outer.grad rules
        self.reducer = reducer or (lambda: GradPath(policy, topology, label, axis))
        self.param_rule = param_rule or (policy.rule("dp", "param") if weights else None)
        self.reference: torch.Tensor | None = None
        self.fresh()

    def fresh(self) -> None:
        """The codecs as the policy builds them: no memory, rounding streams from their
        start (a new run, or an elastic resume on another number of ranks)."""
        self.grad = self.reducer() if self.grads else None
        self.param = None if self.param_rule is None else self.param_rule.build()

    @property
    def alignment(self) -> int:
        """Element count every codec of the bucket splits evenly on."""
        units = [] if self.grad is None else [self.grad.alignment]
        if self.param is not None:
            units.append(max(split(self.param)[0].alignment, 1))
        return math.lcm(*units)

    def gather_weights(self, weights: torch.Tensor, new: torch.Tensor,
                       group: dist.ProcessGroup, async_op: bool = False
                       ) -> torch.Tensor | Handle:
        """Every rank's ``new`` shard into the replicated ``weights`` with this bucket's
        weight codec (:func:`commpress.dp.weight_gather.gather_weights`)."""
        return gather_weights(weights, new, self.param, self.param_rule, self.topology, group,
                              async_op)

    def gather_weights_steps(self, weights: torch.Tensor, new: torch.Tensor,
                             peers: tuple[Peers, Peers, Peers], stats: Stats) -> Steps:
        """The steps of :meth:`gather_weights` for one (played) rank."""
        return weight_gather_steps(weights, new, self.param, self.param_rule, peers, stats)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.grad is not None:
            state["grad"] = self.grad.state_dict()
        if self.param is not None:
            state["param"] = self.param.state_dict()
        if self.reference is not None:
            state["reference"] = self.reference.detach().clone()
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
        if self.grad is not None:  # without memory: what every rank holds alike is kept
            self.grad.load_state_dict(state["grad"], memory)
        if not memory:
            self.param = None if self.param_rule is None else self.param_rule.build()
            return
        if self.param is not None:
            self.param.load_state_dict(state["param"])
        if saved is not None:
            self.reference.copy_(saved)
