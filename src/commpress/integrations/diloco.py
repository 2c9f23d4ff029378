"""Outer synchronization across sites: DiLoCo and Streaming DiLoCo, pseudo-gradients
compressed.

DiLoCo (Douillard et al., 2023): each site — a node, or a DDP/FSDP group — takes
``sync_every`` (H) steps of its own inner optimizer; then the sites average the
*pseudo-gradient* ``Δ = θ_global − θ_local``, an outer optimizer (Nesterov SGD; lr 0.7,
momentum 0.9 unless the preset has its own, :data:`OUTER_STEPS`) moves ``θ_global`` by
it, and every site restarts from the new ``θ_global``. Traffic between sites drops by H.
Streaming DiLoCo (Douillard et al., 2025) splits the model into ``fragments`` (F) and
syncs one fragment every H / F steps, staggered, its all-reduce overlapping ``delay`` (τ)
inner steps before it is applied; the fragment's local weights then become
``alpha · local + (1 − alpha) · θ_global``.

What crosses sites is chosen by the policy's ``outer.grad`` rule, one or two levels:
inside a site (``intra``, exact by default) and between sites (``inter``) —
:data:`OUTER_PRESETS` lists the presets with their bits per element. Each fragment
keeps its own codecs (error-feedback memory, rounding counters), checkpointed.

Invariants: every rank holds the same ``θ_global`` after each sync, bitwise — every
rank decodes the same bytes and applies the same outer step; with ``alpha = 0`` the
local weights equal it too. A non-finite averaged pseudo-gradient stays non-finite: the
outer step is skipped on every rank alike (the decision reads only decoded values) and
the fragment's local weights go back to ``θ_global``. Sites that disagree on H,
fragments, delay, policy or the model's shapes get a
:class:`~commpress.CollectiveMismatchError` at construction, on every rank.

The all-reduces run on a process group of their own (the same ranks), so a delayed one
on the communication thread never interleaves with the inner loop's collectives (DDP's,
FSDP's) on the user's group.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.collectives import Topology
from commpress.collectives.agreement import agree, release
from commpress.dp import DPBucket
from commpress.dp.grad_path import warn_if_uncompressed
from commpress.dp.saved_state import check_resume, envelope
from commpress.integrations.ddp import new_hook_group
from commpress.integrations.replica_sync import broadcast_coalesced, group_source
from commpress.policy import Policy
from commpress.validate import InputError, check_bool, check_float, check_int

STATE_FORMAT = "commpress.DiLoCo/2"
LABEL = "outer.grad"
_TRITS_EF = {"codec": "int2:packing=trits,scale_dtype=fp16", "error_feedback": True}
# Pseudo-gradients, exact inside a site, coded between sites. Bits per element between
# sites: exact 32; int8 (group 128, fp32 scales) 8.25; int4 + Hadamard-128 4.25; ternary
# trits (five per byte, fp16 scales per 128) 1.725, with error feedback; top-k 2 % as
# fp32 values + int32 indices (1.28) with error feedback, SparseLoCo-style.
OUTER_PRESETS: dict[str, dict[str, Any]] = {
    "diloco": {},
    "diloco-int8": {"outer": {"grad": {"intra": "none", "inter": "int8"}}},
    "diloco-int4": {"outer": {"grad": {"intra": "none", "inter": "int4:hadamard=128"}}},
    "diloco-int2ef": {"outer": {"grad": {"intra": "none", "inter": _TRITS_EF}}},
    "diloco-sparse": {"outer": {"grad": {"intra": "none", "inter": {
        "codec": "topk:ratio=0.02", "error_feedback": True}}}},
}


# The outer SGD's (lr, momentum) by preset: DiLoCo's Nesterov 0.7 / 0.9, except top-k,
# whose error feedback already carries the past (SparseLoCo's plain averaging, lr 1, no
# momentum): with momentum on top, residuals sent late overshoot at every sync.
OUTER_STEP = (0.7, 0.9)
OUTER_STEPS: dict[str, tuple[float, float]] = {"diloco-sparse": (1.0, 0.0)}


def outer_step(spec: str | dict | Policy, lr: float | None = None,
               momentum: float | None = None) -> tuple[float, float]:
    """The outer SGD's ``(lr, momentum)``: those given, else those of the preset the policy
    is named for (:data:`OUTER_STEPS`; any other: :data:`OUTER_STEP`). ``"none"`` (the
    trainer without ``--outer``) has DiLoCo's."""
    default = OUTER_STEP if spec == "none" else OUTER_STEPS.get(outer_policy(spec).name,
                                                                 OUTER_STEP)
    return (default[0] if lr is None else lr, default[1] if momentum is None else momentum)


def outer_policy(spec: str | dict | Policy) -> Policy:
    """The policy of an outer synchronizer: a name of :data:`OUTER_PRESETS`, or a policy
    (file, dict, :class:`Policy`) whose ``outer.grad`` rule says what crosses sites."""
    if isinstance(spec, str) and spec in OUTER_PRESETS:
        return Policy.from_dict({"name": spec, **OUTER_PRESETS[spec]})
    if isinstance(spec, str) and not spec.endswith((".yaml", ".yml", ".toml")):
        raise InputError(f"DiLoCo: policy={spec!r} is not allowed; allowed: "
                         f"{', '.join(OUTER_PRESETS)}, a policy file or dict with outer.grad")
    return Policy.resolve(spec)


@dataclass(frozen=True)
class DiLoCoConfig:
    """The schedule and outer optimizer (a checkpoint must match them)."""

    sync_every: int = 32
    fragments: int = 1
    delay: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    alpha: float = 0.0

    def __post_init__(self) -> None:
        check_int("DiLoCo: sync_every", self.sync_every, ge=1)
        check_int("DiLoCo: fragments", self.fragments, ge=1, le=self.sync_every)
        if self.sync_every % self.fragments:
            raise InputError(f"DiLoCo: fragments={self.fragments} is not allowed with "
                             f"sync_every={self.sync_every}; allowed: a divisor of sync_every "
                             "(one fragment every sync_every / fragments steps)")
        check_int("DiLoCo: delay", self.delay, ge=0, le=self.sync_every // self.fragments - 1)
        check_float("DiLoCo: outer_lr", self.outer_lr, gt=0)
        check_float("DiLoCo: outer_momentum", self.outer_momentum, ge=0, lt=1)
        check_float("DiLoCo: alpha", self.alpha, ge=0, le=1)
        check_bool("DiLoCo: nesterov", self.nesterov)

    def sync_offset(self, fragment: int) -> int:
        """Fragment ``fragment`` starts its all-reduce after inner steps ``t`` with
        ``t % sync_every`` equal to this (the last fragment at multiples of H)."""
        return (fragment + 1) * (self.sync_every // self.fragments) % self.sync_every


class _Fragment:
    """One fragment: its parameters, ``θ_global`` and momentum (flat fp32), its codecs
    (a :class:`DPBucket` of the policy's ``outer.grad`` rules)."""

    def __init__(self, index: int, params: list[nn.Parameter], policy: Policy,
                 topology: Topology) -> None:
        self.index = index
        self.params = params
        self.numels = [p.numel() for p in params]
        # θ_global starts from the (broadcast) local weights
        self.global_ = torch.cat([p.detach().reshape(-1).float() for p in params])
        self.momentum = torch.zeros_like(self.global_)
        # the fragments' codecs are their own objects: one label counts them all
        self.dp = DPBucket(policy, topology, LABEL, axis="outer")

    def local(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    @torch.no_grad()
    def set_local(self, flat: torch.Tensor) -> None:
        for p, part in zip(self.params, flat.split(self.numels)):
            p.copy_(part.view_as(p))


class DiLoCo:
    """Outer synchronizer for an existing training loop (module docstring).

    Args:
        model: the model each site trains (a DDP/FSDP-wrapped one too); its parameters
            that require gradients are synchronized, in registration order.
        inner_optimizer: the site's own optimizer; each of its steps counts as an inner
            step (a post-step hook). None: call :meth:`step` after each inner step.
        sync_every: inner steps between two syncs of a fragment (H).
        policy: a name of :data:`OUTER_PRESETS`, or a policy with an ``outer.grad`` rule.
        outer_lr, outer_momentum, nesterov: the outer SGD; None: the preset's
            (:func:`outer_step`: 0.7 and 0.9, ``diloco-sparse`` 1.0 and 0).
        fragments: Streaming DiLoCo's fragments (a divisor of ``sync_every``).
        delay: inner steps a fragment's all-reduce overlaps before it is applied
            (``< sync_every / fragments``).
        alpha: share of the local weights kept when a fragment is applied.
        group: the ranks whose pseudo-gradients are averaged (default: the world);
            every rank of it constructs the synchronizer together.
        topology: sites as nodes of ``group`` (default from ``LOCAL_WORLD_SIZE``; one
            rank per site: ``Topology(1)``).

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sync = commpress.DiLoCo(model, opt, sync_every=32, policy="diloco-int2ef")
        for x, y in batches:
            model(x, y).backward(); opt.step(); opt.zero_grad()   # sync runs every 32
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer | None = None,
                 *, sync_every: int = 32, policy: str | dict | Policy = "diloco",
                 outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool = True,
                 fragments: int = 1, delay: int = 0, alpha: float = 0.0,
                 group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"DiLoCo: model must be a torch.nn.Module; got "
                            f"{type(model).__name__}")
        # hyperparameters
        self.policy = outer_policy(policy)
        self.config = DiLoCoConfig(sync_every, fragments, delay,
                                   *outer_step(self.policy, outer_lr, outer_momentum),
                                   nesterov, alpha)
        self.topology = topology or Topology()
        params = [p for p in model.parameters() if p.requires_grad]
        _check_inner(params, inner_optimizer)
        if len(params) < fragments:
            raise InputError(f"DiLoCo: fragments={fragments} is not allowed for a model of "
                             f"{len(params)} trained parameters; allowed: at most "
                             f"{len(params)}")
        self.group = new_hook_group(group)
        # ranks that disagree on the schedule, the policy or the model are told so now
        agree(self.group, "DiLoCo", label=LABEL, config=asdict(self.config),
              policy=self.policy.to_dict(), params=_shapes_digest(params))
        if self.policy.two_level("outer"):  # the site groups now, not on the thread
            self.topology.resolve(self.group)
        broadcast_coalesced([p.detach() for p in model.parameters()], group_source(self.group),
                            self.group, params[0].device, "DiLoCo initial weights")
        warn_if_uncompressed(self.policy, self.topology, self.group, "DiLoCo", axis="outer")
        # internal state
        self.fragments = [_Fragment(i, part, self.policy, self.topology)
                          for i, part in enumerate(_split(params, fragments))]
        self.inner_steps = 0
        self._pending: dict[int, tuple[int, Any]] = {}  # fragment → (due step, result)
        self._thread = (concurrent.futures.ThreadPoolExecutor(1, "commpress-diloco")
                        if delay else None)
        self._hook = (inner_optimizer.register_step_post_hook(lambda *_: self.step())
                      if inner_optimizer is not None else None)
        # stats
        self.syncs = 0
        self.skipped = 0  # outer steps skipped: a non-finite averaged pseudo-gradient

    # -- the schedule ------------------------------------------------------------------
    def step(self) -> None:
        """Count one inner step; apply the fragments whose all-reduce is due, then start
        those whose turn it is (both in fragment order, the same on every rank)."""
        self.inner_steps += 1
        t = self.inner_steps
        for i in sorted(self._pending):
            if self._pending[i][0] == t:
                self._apply(self.fragments[i], self._result(self._pending.pop(i)[1]))
        for fragment in self.fragments:
            if t % self.config.sync_every == self.config.sync_offset(fragment.index):
                self._start(fragment)

    def _start(self, fragment: _Fragment) -> None:
        delta = fragment.global_ - fragment.local()
        step = self.inner_steps

        def all_reduce() -> None:
            # sites whose inner steps drifted apart (a step one site's GradScaler skipped)
            # would average pseudo-gradients of different steps: agree on it first, on
            # the thread that runs the all-reduce
            agree(self.group, "DiLoCo.sync", label=LABEL, step=step, fragment=fragment.index)
            fragment.dp.grad.all_reduce(delta, self.group, op="avg")

        if self._thread is None:
            all_reduce()
            self._apply(fragment, delta)
            return
        job = self._thread.submit(all_reduce)
        self._pending[fragment.index] = (self.inner_steps + self.config.delay, (job, delta))

    @staticmethod
    def _result(pending: Any) -> torch.Tensor:
        if isinstance(pending, torch.Tensor):  # restored from a checkpoint
            return pending
        job, delta = pending
        job.result()  # re-raises the all-reduce's error here, on the training thread
        return delta

    @torch.no_grad()
    def _apply(self, fragment: _Fragment, delta: torch.Tensor) -> None:
        """The outer step on ``θ_global`` with the averaged ``delta``, then the local
        weights from it; skipped on every rank alike when ``delta`` is not finite."""
        self.syncs += 1
        c = self.config
        if not bool(torch.isfinite(delta).all()):
            self.skipped += 1
            fragment.set_local(fragment.global_)
            return
        m = fragment.momentum
        m.mul_(c.outer_momentum).add_(delta)  # torch's SGD: buf = μ·buf + Δ
        update = delta.add(m, alpha=c.outer_momentum) if c.nesterov else m
        fragment.global_.sub_(update, alpha=c.outer_lr)
        if c.alpha == 0:
            fragment.set_local(fragment.global_)
        else:
            fragment.set_local(fragment.local().mul_(c.alpha).add_(fragment.global_,
                                                                     alpha=1 - c.alpha))

    def wait(self) -> None:
        """Finish every all-reduce in flight (its result is applied when it is due)."""
        for i, (due, pending) in list(self._pending.items()):
            self._pending[i] = (due, self._result(pending))

    def remove(self) -> None:
        """Stop synchronizing: finish the all-reduces in flight (not applied), drop the
        inner optimizer's hook, end the thread and destroy the synchronizer's group."""
        self.wait()
        self._pending.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        if self.group is not None:
            release(self.group)
            self.group = None

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Outer state: ``θ_global``, momentum and codec state of each fragment, the inner
        step, and the averaged pseudo-gradients in flight (waited for). The local weights
        and the inner optimizer are the user's to save."""
        self.wait()
        return envelope(
            STATE_FORMAT, self.policy, *self._identity(), config=asdict(self.config),
            inner_steps=self.inner_steps, syncs=self.syncs, skipped=self.skipped,
            fragments=[{"global": f.global_.clone(), "momentum": f.momentum.clone(),
                        "codecs": f.dp.state_dict()} for f in self.fragments],
            pending={i: (due, r.clone()) for i, (due, r) in self._pending.items()})

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore :meth:`state_dict`'s state; one of another schedule, policy, rank or
        world size, or model, is refused naming the field.

        ``elastic=True`` resumes on another number of ranks or sites (any rank's state
        will do: θ_global, the momentum and the averages in flight are every rank's
        alike); the error-feedback memory, laid out for the world that saved it, starts
        fresh (said once, on rank 0)."""
        memory = check_resume(
            state, STATE_FORMAT, "DiLoCo", self.policy, *self._identity(), elastic,
            "resume with the same sync_every, fragments, delay, outer optimizer, policy, "
            "model and ranks (another number of ranks: load_state_dict(state, "
            "elastic=True))", {"config": asdict(self.config),
                               "fragments": [f.global_.numel() for f in self.fragments]},
            views={"fragments": lambda fs: [f["global"].numel() for f in fs]})
        self.wait()
        for f, saved in zip(self.fragments, state["fragments"]):
            f.global_.copy_(saved["global"])
            f.momentum.copy_(saved["momentum"])
            f.dp.load_state_dict(saved["codecs"], memory)
        device = self.fragments[0].global_.device
        self._pending = {int(i): (due, r.to(device)) for i, (due, r) in
                         state["pending"].items()}
        self.inner_steps, self.syncs = state["inner_steps"], state["syncs"]
        self.skipped = state["skipped"]

    def _identity(self) -> tuple[int, int]:
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def global_weights(self) -> list[torch.Tensor]:
        """``θ_global`` of each fragment (flat fp32): the same bits on every rank."""
        return [f.global_ for f in self.fragments]


def _check_inner(params: list[nn.Parameter], inner_optimizer: Any) -> None:
    """Refuse what the outer step cannot reach: an inner optimizer that keeps master weights
    of its own (its next step would write them back over θ_global), and sharded
    parameters (each rank's shard would be averaged with other shards)."""
    if hasattr(inner_optimizer, "buckets") and hasattr(inner_optimizer, "policy"):
        raise InputError("DiLoCo: inner_optimizer is a commpress.ShardedOptimizer, whose fp32 "
                         "master shards would undo every sync; allowed: an optimizer that steps "
                         "the parameters themselves (DDP inside a site)")
    sharded = [type(p).__name__ for p in params
               if type(p).__name__ in ("FlatParameter", "DTensor") or hasattr(p, "_local_tensor")]
    if sharded:
        raise InputError(f"DiLoCo: the model's parameters are sharded ({sharded[0]}: FSDP); "
                         "allowed: whole parameters on every rank (DDP or one process per "
                         "site)")


def _split(params: list[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """Contiguous fragments in registration order, about equal in elements, none empty."""
    total = sum(p.numel() for p in params)
    out: list[list[nn.Parameter]] = [[]]
    seen = 0
    for i, p in enumerate(params):
        left_params, left_fragments = len(params) - i, fragments - len(out)
        # a parameter whose middle lies past this fragment's share starts the next
        full = seen + p.numel() / 2 > len(out) * total / fragments and out[-1]
        if left_fragments and (full or left_params == left_fragments):
            out.append([])
        out[-1].append(p)
        seen += p.numel()
    return out


def _shapes_digest(params: list[nn.Parameter]) -> str:
    text = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
