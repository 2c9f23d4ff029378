"""Outer synchronization across sites: DiLoCo and Streaming DiLoCo, pseudo-gradients
compressed.

DiLoCo (Douillard et al., 2023): each site — a node, or a DDP/FSDP group — takes
``sync_every`` (H) steps of its own inner optimizer; then the sites average the
*pseudo-gradient* ``Δ = θ_global − θ_local``, an outer optimizer (Nesterov SGD; lr 0.7,
momentum 0.9 unless the preset has its own ``outer_step``) moves ``θ_global`` by
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
outer step is skipped on every rank alike (the decision reads only decoded values), said
on the first rank, and the fragment's local weights go back to ``θ_global``; a site whose
own weights went non-finite restarts every fragment from ``θ_global`` and drops its inner
optimizer's non-finite state, so one bad step never stops the outer progress for good.
Sites that disagree on H, fragments, delay, policy or the model's shapes get a
:class:`~commpress.CollectiveMismatchError` at construction, on every rank; the trained
parameters are read by name at every sync and followed when they change
(:mod:`.outer_fragments`); what DiLoCo checks of each site — its own state after a
resume, DDP kept inside it — is :mod:`.outer_sites`.

The all-reduces run on a process group of their own (the same ranks), so a delayed one
on the communication thread never interleaves with the inner loop's collectives (DDP's,
FSDP's) on the user's group.

With a convergence guard (``guard=``, :mod:`commpress.dp.guard`) each fragment's sync
measures what its pseudo-gradient's codes lose (without error feedback) or leave in the
memory (with it); right after the all-reduce, on the thread and group that ran it, the
sites add up their signals and promote the fragment's ``outer.grad`` codecs one rung when
it was over budget in ``window`` of its syncs in a row — every sync sampled until a
fragment has ``window`` samples under its codec, then every ``every``-th.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.collectives import Topology
from commpress.collectives.agreement import agree, all_gather_objects
from commpress.collectives.group_context import release
from commpress.dp.fallback import tally
from commpress.dp.grad_path import make_levels_now, say_once, warn_if_uncompressed
from commpress.dp.guard import GradGuard
from commpress.dp.saved_state import check_resume, envelope, on_every_rank
from commpress.frontends.ddp import new_hook_group
from commpress.frontends.parts.outer_fragments import (
    Fragment,
    apply_change,
    change,
    check_layout,
    describe,
    named_parameters,
    orphans,
    refuse_orphans,
    split,
    trained,
)
from commpress.frontends.parts.outer_sites import (
    SiteCheck,
    check_inner,
    ddp_spanning_sites,
    drop_nonfinite_state,
    site_fingerprint,
    warn_if_sites_identical,
    weights_checksum,
)
from commpress.frontends.parts.replica_sync import broadcast_coalesced, group_source
from commpress.policy import Guard, Policy, outer_presets, preset_outer_step, preset_rules
from commpress.validate import (
    InputError,
    check_bool,
    check_float,
    check_int,
    few,
    raise_if_any,
)

log = logging.getLogger(__name__)

STATE_FORMAT = "commpress.DiLoCo/3"
LABEL = "outer.grad"
# The cross-site presets, as the one preset table (commpress.policy.PRESETS) holds them.
OUTER_PRESETS: dict[str, dict[str, Any]] = {name: preset_rules(name)
                                            for name in outer_presets()}
OUTER_STEP = (0.7, 0.9)  # DiLoCo's Nesterov lr and momentum, unless a preset says otherwise


def outer_step(spec: str | dict | Policy, lr: float | None = None,
               momentum: float | None = None) -> tuple[float, float]:
    """The outer SGD's ``(lr, momentum)``: those given, else those of the preset the policy
    is named for (its ``outer_step`` in :data:`commpress.policy.PRESETS`; any other:
    :data:`OUTER_STEP`). ``"none"`` (the trainer without ``--outer``) has DiLoCo's."""
    default = OUTER_STEP if spec == "none" else (
        preset_outer_step(outer_policy(spec).name) or OUTER_STEP)
    return (default[0] if lr is None else lr, default[1] if momentum is None else momentum)


def outer_policy(spec: str | dict | Policy, what: str = "DiLoCo",
                 allowed: tuple[str, ...] = tuple(OUTER_PRESETS)) -> Policy:
    """The policy of an outer synchronizer: a name of :data:`OUTER_PRESETS`, or a policy
    (file, dict, :class:`Policy`) whose ``outer.grad`` rule says what crosses sites.
    An unknown name is refused naming ``what`` asks and the presets it ``allowed``."""
    if isinstance(spec, str) and spec in OUTER_PRESETS:
        return Policy.preset(spec)
    if isinstance(spec, str) and not spec.endswith((".yaml", ".yml", ".toml")):
        raise InputError(f"{what}: policy={spec!r} is not allowed; allowed: "
                         f"{', '.join(allowed)}, a policy file or dict with outer.grad")
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


class DiLoCo:
    """Outer synchronizer for an existing training loop (module docstring).

    Args:
        model: the model each site trains (a DDP/FSDP-wrapped one too); its parameters
            that require gradients are synchronized, in registration order, looked up by
            name at every sync (the set may change: :mod:`.outer_fragments`).
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
        fallback: ``"measured"``: each fragment times its sync compressed and exact in its
            first syncs and keeps compression only where it is faster
            (:mod:`commpress.dp.fallback`); None: the policy's (default off).
        guard: the convergence guard of the fragments' pseudo-gradient codecs
            (:mod:`commpress.dp.guard`; ``every`` and ``window`` count a fragment's
            syncs); None: the policy's (``guard:`` in a policy file; default off).

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sync = commpress.DiLoCo(model, opt, sync_every=32, policy="diloco-int2ef",
                                topology=commpress.Topology(1))   # one rank per site
        for x, y in batches:
            model(x, y).backward(); opt.step(); opt.zero_grad()   # sync runs every 32
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer | None = None,
                 *, sync_every: int = 32, policy: str | dict | Policy = "diloco",
                 outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool = True,
                 fragments: int = 1, delay: int = 0, alpha: float = 0.0,
                 group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None, fallback: str | None = None,
                 guard: Guard | dict | float | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"DiLoCo: model must be a torch.nn.Module; got "
                            f"{type(model).__name__}")
        # hyperparameters (the guard is part of the policy the sites agree on)
        self.policy = outer_policy(policy).with_fallback(fallback).with_guard(guard)
        self.config = DiLoCoConfig(sync_every, fragments, delay,
                                   *outer_step(self.policy, outer_lr, outer_momentum),
                                   nesterov, alpha)
        self.topology = topology or Topology()
        self.model = model
        self.inner_optimizer = inner_optimizer
        named = trained(model)
        check_inner([p for _, p in named], inner_optimizer)
        if len(named) < fragments:
            raise InputError(f"DiLoCo: fragments={fragments} is not allowed for a model of "
                             f"{len(named)} trained parameters; allowed: at most "
                             f"{len(named)}")
        self.group: dist.ProcessGroup | None = None
        self._open(group, named)
        # internal state
        self.fragments = [Fragment(i, part, self.policy, self.topology, LABEL)
                          for i, part in enumerate(split(named, fragments))]
        self.guard = (GradGuard(self.policy.guard, [f.dp for f in self.fragments], "DiLoCo",
                                kind=LABEL, aligned=False)
                      if self.policy.guard is not None else None)
        self.inner_steps = 0
        self._pending: dict[int, tuple[int, Any]] = {}  # fragment → (due step, result)
        self._thread = (concurrent.futures.ThreadPoolExecutor(1, "commpress-diloco")
                        if delay else None)
        self._hook = (inner_optimizer.register_step_post_hook(lambda *_: self.step())
                      if inner_optimizer is not None else None)
        self._site_check: SiteCheck | None = None  # set by load_state_dict
        self._first_sync = True
        # stats
        self.syncs = 0
        self.skipped = 0  # outer steps skipped: a non-finite averaged pseudo-gradient

    def _open(self, group: dist.ProcessGroup | None,
              named: list[tuple[str, torch.Tensor]]) -> None:
        """The sites' group, made and agreed on at construction; the sites start from rank
        0's weights. (:class:`commpress.torchft.DiLoCo` opens a group per quorum instead.)"""
        self.group = new_hook_group(group)
        spans = ddp_spanning_sites(self.model, self.group, self.topology)
        # ranks that disagree on the schedule, the policy or the model are told so now
        self._agree_on_run(named, ddp_across_sites=bool(spans))
        if spans:
            raise InputError(f"DiLoCo: model is a DistributedDataParallel over {spans}: DDP "
                             "would all-reduce every gradient between the sites in full "
                             "precision each step, undoing what DiLoCo saves; allowed: DDP "
                             "over each site's own ranks (DDP(model, process_group=<the "
                             "site's group>)), or one rank per site without DDP "
                             "(topology=commpress.Topology(1))")
        make_levels_now(self.policy, self.topology, self.group, "outer")  # not on the thread
        broadcast_coalesced([p.detach() for p in self.model.parameters()],
                            group_source(self.group), self.group, named[0][1].device,
                            "DiLoCo initial weights")
        warn_if_uncompressed(self.policy, self.topology, self.group, "DiLoCo", axis="outer")

    def _agree_on_run(self, named: list[tuple[str, torch.Tensor]], **also: Any) -> None:
        """Every rank of the group has this schedule, policy and trained set (else a
        :class:`~commpress.CollectiveMismatchError` on every rank)."""
        agree(self.group, "DiLoCo", label=LABEL, config=asdict(self.config),
              policy=self.policy.to_dict(), trained=describe(named), **also)

    # -- the schedule ------------------------------------------------------------------
    def step(self) -> None:
        """Count one inner step; apply the fragments whose all-reduce is due, then start
        those whose turn it is (both in fragment order, the same on every rank)."""
        self.inner_steps += 1
        t = self.inner_steps
        for i in sorted(self._pending):
            if self._pending[i][0] == t:
                self._apply(self.fragments[i], self._result(self._pending.pop(i)[1]))
        if self._starting(t) and self._begin_sync():
            starting = self._starting(self.inner_steps)  # a replica healed: the peers' step
            now = trained(self.model)
            fields = self._sync_fields(now)
            agreed = self._follow_the_model(now, fields)
            for fragment in starting:
                self._start(fragment, fields, agreed)
                agreed = False

    def _starting(self, t: int) -> list[Fragment]:
        """The fragments whose all-reduce starts after inner step ``t``."""
        return [f for f in self.fragments
                if t % self.config.sync_every == self.config.sync_offset(f.index)]

    def _begin_sync(self) -> bool:
        """Before fragments start their all-reduce: whether they run it (the sites'
        group is fixed here; a torchft quorum is formed in
        :class:`commpress.torchft.DiLoCo`)."""
        return True

    def _follow_the_model(self, now: list[tuple[str, torch.Tensor]],
                          fields: dict[str, Any]) -> bool:
        """Before a sync: re-form the fragments if the trained parameters changed
        (:mod:`.outer_fragments`). Returns whether the sync's ``fields`` were agreed on
        here (a change: the sites agree on the new set before anything moves), else they
        are with the all-reduce."""
        changed = change(self.fragments, now)
        if not changed and not fields["orphans"]:
            return False
        self.wait()  # nothing in flight while the sites agree and the weights move
        agree(self.group, "DiLoCo.sync", label=LABEL, step=self.inner_steps, **fields)
        refuse_orphans(fields["orphans"])
        for i in sorted(self._pending):  # in-flight results belong to the old fragments
            self._apply(self.fragments[i], self._result(self._pending.pop(i)[1]))
        joined = [p.detach() for _, p in changed.joined]
        broadcast_coalesced(joined, group_source(self.group), self.group,
                            self.fragments[0].global_.device, "DiLoCo joining parameters")
        touched = apply_change(self.fragments, changed, named_parameters(self.model))
        if self.guard is not None:  # a re-formed fragment's signals start again
            self.guard.restart(touched)
        say_once(log, ("reformed", id(self), self.inner_steps), self._rank(),
                 "DiLoCo: the trained parameters changed by inner step %d: %d left (%s), %d "
                 "joined (%s); fragments %s re-formed, their codecs (error-feedback memory) "
                 "fresh", self.inner_steps, len(changed.left), few(changed.left) or "-",
                 len(changed.joined), few([n for n, _ in changed.joined]) or "-", touched)
        return True

    def _sync_fields(self, now: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """What the sites must agree on at a sync, besides its step and fragment."""
        return {"trained": describe(now),
                "orphans": orphans(self.inner_optimizer, self.model)}

    def _start(self, fragment: Fragment, fields: dict[str, Any], agreed: bool) -> None:
        if not fragment.names:  # every parameter of it left the trained set
            return
        model = named_parameters(self.model)
        delta = fragment.global_ - fragment.local(model)
        step = self.inner_steps
        first, self._first_sync = self._first_sync, False
        site_check, self._site_check = self._site_check, None
        local = weights_checksum(fragment.params(model)) if first else None

        # sites whose inner steps drifted apart (a step one site's GradScaler skipped) would
        # average pseudo-gradients of different steps: they agree on it in the all-reduce's
        # own round (orphans, if any, were agreed and refused before: _follow_the_model)
        sync = None if agreed else {"sync": "DiLoCo.sync", "step": step, **fields}
        # the guard samples this fragment's sync by its count of syncs
        guard = self.guard if self.group is not None and self.group.size() > 1 else None
        sampled = guard is not None and guard.sampling((step - 1) // self.config.sync_every,
                                                       [fragment.index])

        def all_reduce() -> None:
            if site_check is not None:  # the first sync since a load: every site's verdict
                raise_if_any(all_gather_objects(site_check.problem(), self.group,
                                                "DiLoCo: resumed site state"),
                             self.group.rank(), "resumed another site's state")
            if local is not None:
                warn_if_sites_identical(local, self.group, self.topology)
            with guard.watching(fragment.index, sampled) if sampled else nullcontext():
                fragment.dp.all_reduce(delta, self.group, op="avg", also_agree=sync)
            if sampled:  # on every site alike, before the next sync of this fragment
                guard.decide(step, self.group, [fragment.index])

        if self._thread is None:
            self._apply(fragment, self._result((_run_now(all_reduce), delta)))
            return
        job = self._thread.submit(all_reduce)
        self._pending[fragment.index] = (self.inner_steps + self.config.delay, (job, delta))

    def _result(self, pending: Any) -> torch.Tensor | None:
        """The averaged pseudo-gradient of an all-reduce started by :meth:`_start` (None:
        it failed, and the failure was handed to torchft)."""
        if pending is None or isinstance(pending, torch.Tensor):  # failed, or restored
            return pending
        job, delta = pending
        job.result()  # re-raises the all-reduce's error here, on the training thread
        return delta

    @torch.no_grad()
    def _apply(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """The outer step on ``θ_global`` with the averaged ``delta``, then the local
        weights from it. When ``delta`` is not finite (a site went non-finite) the step is
        skipped on every rank alike and the sites restart from ``θ_global``
        (:meth:`_restart_from_global`)."""
        self.syncs += 1
        c = self.config
        finite = bool(torch.isfinite(delta).all())
        if finite:
            fragment.outer_step(delta, c.outer_lr, c.outer_momentum, c.nesterov)
        else:
            self.skipped += 1
            if self._rank() == 0:
                log.warning("DiLoCo: the averaged pseudo-gradient of fragment %d at inner "
                            "step %d is not finite (a site's weights or gradients went "
                            "non-finite): the outer step is skipped on every site and the "
                            "fragment restarts from θ_global", fragment.index, self.inner_steps)
        for who, optimizer in self._each_site():
            model = named_parameters(self.model)
            if not finite:
                self._restart_from_global(fragment, model, optimizer, who)
            elif c.alpha == 0:
                fragment.set_local(model, fragment.global_)
            else:
                fragment.set_local(model, fragment.local(model).mul_(c.alpha).add_(
                    fragment.global_, alpha=1 - c.alpha))

    def _each_site(self) -> Iterator[tuple[str, torch.optim.Optimizer | None]]:
        """Each site this process holds — its name and inner optimizer — its weights in
        the model meanwhile: here one, this rank's (a played run holds every site:
        :class:`commpress.frontends.played.diloco.PlayedDiLoCo`)."""
        yield f"rank {self._rank()}", self.inner_optimizer

    def _rank(self) -> int:
        return self.group.rank() if self.group is not None else 0

    @torch.no_grad()
    def _restart_from_global(self, skipped: Fragment, model: dict[str, torch.Tensor],
                             optimizer: torch.optim.Optimizer | None, who: str) -> None:
        """After a skipped outer step: the site ``who`` puts ``skipped``'s local weights
        back to its ``θ_global`` (a decision read from decoded values alone: every rank
        alike); a site whose other fragments are non-finite too does the same for them,
        and drops the inner optimizer's non-finite state — else its next forward and step
        would poison the fragment again, and with fragments every later sync (each
        fragment then restarts before its own sync comes). Said on every site it happens
        to."""
        skipped.set_local(model, skipped.global_)
        poisoned = [f for f in self.fragments if f is not skipped
                    and not bool(torch.isfinite(f.local(model)).all())]
        for f in poisoned:
            f.set_local(model, f.global_)
        dropped = drop_nonfinite_state(optimizer)
        if poisoned or dropped:
            log.warning("DiLoCo (%s): this site's weights were non-finite: fragments %s "
                        "restart from θ_global%s", who, [f.index for f in poisoned] or "none "
                        "other", f"; the inner optimizer's non-finite state of {dropped} "
                        "parameters is dropped (it starts again as for a new parameter)"
                        if dropped else "")

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
        if self._site_check is not None:
            self._site_check.close()
            self._site_check = None
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        if self.group is not None:
            release(self.group)
            self.group = None

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """With ``fallback="measured"``: how many fragments' syncs went each way
        (:func:`commpress.dp.fallback.tally`); empty without it."""
        return tally(c for f in self.fragments for c in f.dp.choices.values())

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Outer state: ``θ_global``, momentum, codec state and parameter names of each
        fragment, the inner step, the averaged pseudo-gradients in flight (waited for),
        and checksums of this site's local weights and inner optimizer state. Those two
        are the site's own to save beside it (each rank its own file:
        :func:`commpress.save_rank_state`); a resume checks them at its first inner step."""
        self.wait()
        return envelope(
            STATE_FORMAT, self.policy, *self._identity(), config=asdict(self.config),
            inner_steps=self.inner_steps, syncs=self.syncs, skipped=self.skipped,
            fragments=[f.state_dict() for f in self.fragments],
            **({"guard": self.guard.state_dict()} if self.guard else {}),
            pending={i: (due, r.clone()) for i, (due, r) in self._pending.items()
                     if r is not None},  # None: failed, and torchft voted it out
            site=site_fingerprint(self._all_params(), self.inner_optimizer))

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore :meth:`state_dict`'s state; one of another schedule, policy, rank or
        world size, or of parameters this model does not have, is refused naming the
        field. The fragments take the saved parameter sets (the trained set then follows
        the model at the next sync).

        The site's own state — its local weights and inner optimizer — must be the one
        saved with it: at the first inner step after the load it is compared with the
        checksums saved, and the next sync refuses, on every site, a run whose sites
        restored another site's (a loop that saves rank 0's model and optimizer only).

        ``elastic=True`` resumes on another number of ranks or sites, or from another
        rank's state (θ_global, the momentum and the averages in flight are every rank's
        alike); the error-feedback memory, laid out for the world that saved it, starts
        fresh (said once, on rank 0), and the site's own state is not checked."""
        rank, world = self._identity()
        model = named_parameters(self.model)

        def check() -> tuple[dict[str, Any], bool, list]:
            converted = _former_sparse(_from_format_2(state, self.fragments), self.policy)
            memory = check_resume(
                converted, STATE_FORMAT, "DiLoCo", self.policy, rank, world, elastic,
                "resume with the same sync_every, fragments, delay, outer optimizer, "
                "policy (a 'diloco-sparse' state of top-k 2 %, saved before that preset "
                "became SparseLoCo's chunked top-k: policy='diloco-topk') and ranks, "
                "each rank from its own state (save every rank's: "
                "commpress.save_rank_state(..., f'.../commpress-rank{rank}.pt')); another "
                "number of ranks, or one rank's state on every rank: "
                "load_state_dict(state, elastic=True)", {"config": asdict(self.config)},
                formats={"commpress.DiLoCo/2": "a DiLoCo state of an older commpress "
                         "whose fragments do not have this model's sizes"})
            if self.guard is not None:  # refused on every rank together, before any load
                self.guard.check_state(converted.get("guard"))
            return converted, memory, [check_layout(f, model) for f in converted["fragments"]]

        self.wait()  # the all-reduce in flight on the thread uses the group too
        state, memory, layout = on_every_rank(self._resume_group(), "DiLoCo", check)
        if self.guard is not None:  # promoted codecs first: their state follows them
            self.guard.load_state_dict(state.get("guard"))
        for f, saved, named in zip(self.fragments, state["fragments"], layout):
            f.load_state_dict(saved, named, memory)
        device = self.fragments[0].global_.device
        self._pending = {int(i): (due, r.to(device)) for i, (due, r) in
                         state["pending"].items()}
        self.inner_steps, self.syncs = state["inner_steps"], state["syncs"]
        self.skipped = state["skipped"]
        self._first_sync = False
        if self._site_check is not None:
            self._site_check.close()
        self._site_check = SiteCheck(None if elastic else state.get("site"),
                                     self._all_params, self.inner_optimizer)

    def _all_params(self) -> list[torch.Tensor]:
        """Every fragment's parameters, as the model holds them now."""
        model = named_parameters(self.model)
        return [p for f in self.fragments for p in f.params(model)]

    def _resume_group(self) -> dist.ProcessGroup | None:
        """The ranks that resume together and agree on every rank's verdict."""
        return self.group

    def _identity(self) -> tuple[int, int]:
        return self.group.rank(), self.group.size()

    def global_weights(self) -> list[torch.Tensor]:
        """``θ_global`` of each fragment (flat fp32): the same bits on every rank."""
        return [f.global_ for f in self.fragments]


def _run_now(fn: Any) -> concurrent.futures.Future:
    """``fn()`` run on this thread, its outcome held as a thread's job would hold it."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    try:
        done.set_result(fn())
    except Exception as e:  # noqa: BLE001 - re-raised by _result, as a thread's would be
        done.set_exception(e)
    return done


def _former_sparse(state: Any, policy: Policy) -> Any:
    """A state saved under ``diloco-sparse`` when that preset was top-k 2 % (what
    ``diloco-topk`` is now), resumed under ``diloco-topk``: as that policy's. Under any
    other policy it is left to the policy check, which refuses it naming both."""
    former = {**Policy.preset("diloco-topk").to_dict(), "name": "diloco-sparse"}
    if (policy.name != "diloco-topk" or not isinstance(state, dict)
            or state.get("policy") != former):
        return state
    return {**state, "policy": policy.to_dict()}


def _from_format_2(state: Any, fragments: list[Fragment]) -> Any:
    """A state of the former format (fragments by size, no names) as this one, when its
    fragments have the sizes of this synchronizer's (the same model and trained set):
    its parameters are then this synchronizer's, in order. Any other is left to the
    format check, which names it."""
    if not isinstance(state, dict) or state.get("format") != "commpress.DiLoCo/2":
        return state
    saved = state.get("fragments") or []
    sizes = [s["global"].numel() for s in saved if isinstance(s, dict) and "global" in s]
    if sizes != [f.global_.numel() for f in fragments]:
        return state
    log.warning("DiLoCo: loading a state of the former format (fragments by size): its "
                "parameters are taken to be this synchronizer's, in order (the same model "
                "and trained parameters)")
    return {**state, "format": STATE_FORMAT, "site": None,
            "fragments": [{**s, "names": list(f.names)} for s, f in zip(saved, fragments)]}
