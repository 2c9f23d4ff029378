"""torchft's fault-tolerant all-reduce, sent as commpress codes.

torchft (PyTorch's fault-tolerance engine) averages across *replica groups* with
``Manager.allreduce``: its DiLoCo, Streaming DiLoCo, LocalSGD and DDP all go through it,
and it hands each tensor to the Manager's process group as a SUM. Wrapping that process
group is the one seam that reaches all of them::

    from torchft import Manager, ProcessGroupGloo
    import commpress.torchft

    comp = commpress.torchft.compress(ProcessGroupGloo(), policy="diloco-int4")
    manager = Manager(pg=comp.process_group, ...)  # then torchft's DiLoCo / LocalSGD / DDP
    ...
    comp.remove()                          # after the last step

Floating-point SUM and AVG all-reduces then cross replica groups through
:func:`commpress.all_reduce` with the policy's between-site codec (``outer.grad``'s
``inter`` rule, as :class:`commpress.DiLoCo` uses); every other collective is torchft's
own. Every replica decodes the same bytes, so live replicas keep bitwise-identical
results; a healing replica's zeroed tensor encodes to exact zeros.

**Quorum changes.** torchft rebuilds the process group (``configure``) whenever the set
of live replica groups changes. The new members first announce their policy in the
quorum's store — a replica that announces none within the timeout runs torchft's own
process group, without commpress, or died as the quorum formed — then agree on it
before their first payload. torchft retries a failed step forever, so a replica of
another policy, or one without commpress, would leave the job retrying with the reason
only in torchft's log: the error (:class:`~commpress.CollectiveMismatchError`, naming the
replicas and policies) is raised into the training loop instead, from
``Manager.should_commit`` — at once for another policy, after
:data:`SILENT_QUORUMS` quorums in a row for a replica that announces nothing (a dead one
is gone from the next quorum; torchft retries that as any fault).

**What is compressed.** SUM and AVG all-reduces of float32, bfloat16 and float16 tensors
(a 0-d loss too); float64 and integer tensors, and every other collective, are torchft's
own.
The codecs allowed in the process group keep no state that another replica must share: no
error-feedback memory and no stochastic-rounding counter. Error-feedback memory belongs to
one tensor, and torchft hands the process group anonymous ones — after a retried step,
another fragment or a new quorum, a memory would be added to the wrong values, or a
rejoining replica would apply memory the others dropped. So such policies are refused
there; :class:`DiLoCo` below keeps them per fragment.

**Error feedback: commpress's DiLoCo on torchft's Manager.** :class:`DiLoCo` runs
:class:`commpress.DiLoCo` — its fragments, each with its own error-feedback memory — on a
``Manager`` instead of a fixed group: each sync forms torchft's quorum, all-reduces on the
quorum's group, and applies the outer step only if torchft's commit vote passes. The
memory rule:

- a replica that heals (rejoins, or joins at the start) takes ``θ_global``, the outer
  momentum and the schedule from a live peer, and its error-feedback memory starts fresh
  — a peer's memory holds that peer's residuals, never this replica's;
- live replicas keep their memory through quorum changes;
- a sync that is not committed (a peer died in it, too few replicas) is discarded as
  torchft discards a step: the fragment's weights go back to ``θ_global`` and its memory
  back to what it held before the sync, so no residual of a discarded pseudo-gradient is
  ever sent later.

Each rule is said in the log when it applies.

The process group's all-reduce is synchronous (it returns once the reduced values are in
the tensor), so torchft's ``fragment_sync_delay`` overlaps nothing; errors (a replica that
died, a timeout) are raised into torchft, which reports them and does not commit the step.
Leave torchft's ``should_quantize`` off: it would quantize before this group sees it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroup as TorchftProcessGroup
from torchft.process_group import ProcessGroupWrapper
from torchft.work import _DummyWork

from commpress.collectives import CollectiveMismatchError, CollectiveTimeoutError, Topology
from commpress.collectives.agreement import agree
from commpress.collectives.group_context import release
from commpress.dp import DPBucket
from commpress.dp.grad_path import make_levels_now
from commpress.frontends.diloco import LABEL, outer_policy
from commpress.frontends.diloco import DiLoCo as SitesDiLoCo
from commpress.frontends.parts.outer_fragments import Fragment, named_parameters, trained
from commpress.frontends.parts.outer_sites import weights_checksum
from commpress.policy import Policy
from commpress.validate import InputError, few

log = logging.getLogger(__name__)
WHAT = "commpress.torchft"
_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"))
# torchft's process groups that run collectives in this process on a c10d group
_IN_PROCESS = ("ProcessGroupGloo",)
# the presets without state another replica must share (the others are refused here)
STATELESS = ("diloco", "diloco-int8", "diloco-int4")
# quorums in a row with a member that announced no policy before it is taken for one
# without commpress (a replica that died as a quorum formed is gone from the next)
SILENT_QUORUMS = 3
STATE_FORMAT = "commpress.torchft/1"


class CompressedProcessGroup(ProcessGroupWrapper):
    """A torchft process group whose floating-point SUM/AVG all-reduces are commpress's
    compressed all-reduce (module docstring). ``pg``: torchft's ``ProcessGroupGloo``;
    ``policy``: a name of :data:`commpress.OUTER_PRESETS` or a policy with an
    ``outer.grad`` rule, without error feedback or stochastic rounding."""

    def __init__(self, pg: TorchftProcessGroup, policy: str | dict | Policy = "diloco-int4",
                 timeout: timedelta = timedelta(seconds=60)) -> None:
        if type(pg).__name__ not in _IN_PROCESS or not isinstance(pg, ProcessGroupWrapper):
            raise InputError(f"{WHAT}: pg={type(pg).__name__} is not allowed; "
                             f"allowed: torchft's {', '.join(_IN_PROCESS)} (a process group "
                             "that runs its collectives in this process)")
        super().__init__(timeout=timeout, pg=pg)
        self.policy = outer_policy(policy, WHAT, STATELESS)
        # replicas are sites: what crosses between them is the inter level's (or the one)
        _check_stateless(self.policy)
        self.dp = DPBucket(self.policy, Topology(1), LABEL, axis="outer", level="inter")
        self._dtypes = self.dp.grad_dtypes  # the rest: torchft's own
        self._timeout = timeout
        self._fatal: Exception | None = None  # a quorum that can never agree
        self._silent_quorums = 0  # quorums in a row with a replica that announced nothing
        self._removed = False

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  *args: Any, **kwargs: Any) -> None:
        """torchft's reconfiguration for a new quorum; then the members announce their
        policy in the quorum's store and agree on it (before any payload on the new
        group). A quorum that cannot agree is remembered: :meth:`errored` raises it."""
        # announced before torchft connects: a peer slow to configure is not taken for one
        # without commpress
        store = _announce(store_addr, rank, self.policy, self._timeout)
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
        self._fatal = None
        try:
            _read_announcements(store, rank, world_size, self.policy, self._timeout)
            agree(self._group(), "torchft.configure", label=LABEL, policy=self.policy.to_dict())
        except _Unannounced as e:
            # a replica that died as the quorum formed is gone from the next one; one that
            # runs torchft's own group is in every quorum: told after a few
            self._silent_quorums += 1
            if self._silent_quorums >= SILENT_QUORUMS:
                self._fatal = CollectiveMismatchError(
                    f"{e} (in {self._silent_quorums} quorums in a row)")
            raise
        except CollectiveMismatchError as e:
            self._fatal = e
            raise
        self._silent_quorums = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:
        if self._removed:
            raise RuntimeError(f"{WHAT}: this process group's compression was removed "
                               "(remove()); allowed: a Manager on a new process group")
        given = getattr(opts, "reduceOp", opts)  # a ReduceOp compares equal, hashes apart
        op = next((name for reduce_op, name in _OPS if given == reduce_op), None)
        if op is None or not all(t.dtype in self._dtypes for t in tensors):
            return super().allreduce(tensors, opts)
        group = self._group()
        for t in tensors:
            self.dp.all_reduce(t, group, op=op)
        return _DummyWork(tensors)

    def errored(self) -> Exception | None:
        """torchft's error of the step; a quorum of replicas that can never agree (another
        policy, or no commpress) is raised instead — torchft asks this in
        ``Manager.should_commit``, on the training thread, and would otherwise retry the
        step forever."""
        if self._fatal is not None:
            raise self._fatal
        return self._pg.errored()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._pg.set_timeout(timeout)

    def getBackendName(self) -> str:
        return f"commpress-{super().getBackendName()}"

    def end_compression(self) -> None:
        """Refuse later all-reduces by name and release commpress's state for the current
        quorum's group (:meth:`Compression.remove`)."""
        self._removed = True
        try:
            group = self._group()
        except Exception:  # noqa: BLE001 - never configured: nothing of commpress's to free
            return
        release(group, drain=False)

    def _group(self) -> dist.ProcessGroup:
        """The c10d group torchft built for this quorum (not registered with
        torch.distributed: commpress's collectives take it as it is)."""
        return self.parent.parent

    def __repr__(self) -> str:
        return f"CompressedProcessGroup(pg={self._pg!r}, policy={self.policy.name!r})"


class Compression:
    """What :func:`compress` returns, the handle every adapter returns:
    ``process_group`` for ``torchft.Manager(pg=...)``; :meth:`state_dict` /
    :meth:`load_state_dict` (the codecs allowed here keep no state of their own: what is
    saved is the policy, and a state of another policy is refused); :meth:`remove`."""

    def __init__(self, process_group: CompressedProcessGroup) -> None:
        self.process_group = process_group

    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "policy": self.process_group.policy.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        policy = self.process_group.policy
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        if found != STATE_FORMAT:
            raise InputError(f"{WHAT}: a saved state of format {found!r} is not allowed; "
                             f"allowed: {STATE_FORMAT!r}, from {WHAT}'s state_dict()")
        if state.get("policy") != policy.to_dict():
            raise InputError(f"{WHAT}: the saved state is of policy "
                             f"{_name(repr(state.get('policy')))!r}; this run compresses with "
                             f"{policy.name!r}: resume with the same policy")

    def remove(self) -> None:
        """End compression on this process group after the last step: commpress's state
        for its current group is released, and a later all-reduce through it is refused
        by name (a Manager cannot take its process group back; a new one trains without
        commpress)."""
        self.process_group.end_compression()


def compress(pg: TorchftProcessGroup, policy: str | dict | Policy = "diloco-int4",
             timeout: timedelta = timedelta(seconds=60)) -> Compression:
    """``pg`` (torchft's ``ProcessGroupGloo``) with its all-reduces compressed by
    ``policy``: pass the handle's ``process_group`` to ``torchft.Manager(pg=...)``."""
    return Compression(CompressedProcessGroup(pg, policy, timeout))


class _Unannounced(CollectiveTimeoutError):
    """Quorum members announced no commpress policy within the timeout."""


def _announce(store_addr: str, rank: int, policy: Policy, timeout: timedelta) -> Any:
    """Write this replica's policy in the quorum's store; the store client."""
    from torchft.process_group import create_store_client

    store = create_store_client(store_addr, timeout=timeout)
    store.set(f"commpress/policy/{rank}", repr(policy.to_dict()))
    return store


def _read_announcements(store: Any, rank: int, world_size: int, policy: Policy,
                        timeout: timedelta) -> None:
    """Read every quorum member's announced policy within ``timeout``: a member that wrote
    none is named (:class:`_Unannounced`: it died as the quorum formed, or runs torchft's
    own process group, whose collectives would meet the agreement's); one that wrote
    another policy too (:class:`CollectiveMismatchError`)."""
    keys = [f"commpress/policy/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception:  # noqa: BLE001 - the store's timeout: who never wrote is named below
        silent = [r for r, key in enumerate(keys) if not store.check([key])]
        raise _Unannounced(
            f"{WHAT}: replica ranks {silent} of this quorum announced no commpress policy "
            f"within {timeout.total_seconds():.0f} s: they died as the quorum formed, or run "
            f"torchft's own process group. Every replica must wrap it the same way: "
            f"{WHAT}.compress(ProcessGroupGloo(), {policy.name!r})") from None
    mine = repr(policy.to_dict())
    others = {r: store.get(key).decode() for r, key in enumerate(keys)}
    differ = sorted(r for r, text in others.items() if text != mine)
    if differ:
        raise CollectiveMismatchError(
            f"{WHAT}: replicas disagree on the policy: rank {rank} has {policy.name!r}, "
            f"ranks {differ} have {[_name(others[r]) for r in differ]}; every replica must "
            "compress with the same policy")


def _name(policy_repr: str) -> str:
    """The preset name in a policy's announced ``repr`` (the whole text if none)."""
    import ast

    try:
        return ast.literal_eval(policy_repr).get("name", policy_repr)
    except (ValueError, SyntaxError):
        return policy_repr


def _check_stateless(policy: Policy) -> None:
    rule = policy.rule("outer", "grad", "inter")
    if rule.error_feedback:
        raise InputError(f"{WHAT}: policy {policy.name!r} uses error feedback, whose "
                         "memory belongs to one tensor, and torchft hands the process group "
                         "anonymous tensors (retried steps, fragments and new quorums would "
                         "add it to other values); allowed: a policy without error feedback "
                         f"({', '.join(STATELESS)}), or commpress.DiLoCo for memory per "
                         "fragment")
    if getattr(rule.build(), "rounding", "nearest") != "nearest":
        raise InputError(f"{WHAT}: policy {policy.name!r} rounds stochastically, from "
                         "a counter a rejoining replica would not share; allowed: "
                         "rounding=nearest")


class DiLoCo(SitesDiLoCo):
    """:class:`commpress.DiLoCo` across torchft replica groups (module docstring: the
    memory rule). ``manager``: torchft's ``Manager``, built with ``use_async_quorum=False``
    on torchft's ``ProcessGroupGloo``, whose ``state_dict`` / ``load_state_dict`` carry
    the model and the inner optimizer (a healing replica takes them from a live peer);
    the other arguments are :class:`commpress.DiLoCo`'s, any policy of
    :data:`commpress.OUTER_PRESETS` (error feedback too). Each member of the Manager's
    group is one site.

    Example::

        manager = Manager(pg=ProcessGroupGloo(), use_async_quorum=False,
                          state_dict=lambda: {"model": model.state_dict(),
                                              "inner": inner.state_dict()}, ...)
        sync = commpress.torchft.DiLoCo(manager, model, inner, sync_every=32,
                                        policy="diloco-sparse")
        for x, y in batches:
            model(x, y).backward(); inner.step(); inner.zero_grad()  # syncs every 32
    """

    def __init__(self, manager: Any, model: torch.nn.Module,
                 inner_optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        for name in ("group", "topology"):
            if name in kwargs:
                raise InputError(f"{WHAT}.DiLoCo: {name}= is not allowed; the sites are "
                                 "the Manager's replica groups, one per member of its "
                                 "process group")
        if kwargs.get("guard") is not None or outer_policy(kwargs.get("policy", "diloco")).guard:
            # a promotion decided in a sync that torchft then votes out would leave the
            # replicas' codecs apart from the committed state
            raise InputError(f"{WHAT}.DiLoCo: a convergence guard (guard=, or guard: in the "
                             "policy) is not allowed yet; allowed: commpress.DiLoCo's guard "
                             "on a fixed group, or no guard here")
        _check_manager(manager)
        self.manager = manager
        self._before: dict[int, dict[str, Any]] = {}  # fragment → codec state before a sync
        self._place: tuple[int, int] | None = None  # (rank, size) the memory is laid out for
        self._failure = "its all-reduce failed"  # why the last all-reduce failed
        super().__init__(model, inner_optimizer, topology=Topology(1), **kwargs)
        # torchft's healing (init_sync) gives every replica the same start: no check of
        # distinct sites at the first sync, which a replica healing later would not join
        self._first_sync = False

    def _open(self, group: dist.ProcessGroup | None,
              named: list[tuple[str, torch.Tensor]]) -> None:
        # no group yet: each quorum brings its own (_begin_sync)
        self.manager.register_state_dict_fn(STATE_KEY, self._load_healed, self._healing_state)

    def _begin_sync(self) -> bool:
        """torchft's quorum for this sync (a replica behind heals here: :meth:`_load_healed`);
        on a new quorum's group the replicas agree on the run before any payload. A sync
        that cannot run is voted out here (:meth:`_discard_begun`)."""
        self.manager.start_quorum()
        if self.manager.errored() is not None:  # the quorum's group failed to form
            return self._discard_begun("the quorum's group did not form")
        group = self.manager._pg.parent  # the c10d group torchft built for this quorum
        if group is self.group:
            return True
        if self.manager.num_participants() != group.size():
            raise InputError(f"{WHAT}.DiLoCo: {self.manager.num_participants()} of the "
                             f"quorum's {group.size()} replicas take part in this sync; "
                             "allowed: every replica (use_async_quorum=False, "
                             "world_size_mode=DYNAMIC)")
        old, self.group = self.group, group
        try:
            # θ_global too: replicas that started apart (init_sync=False, other seeds)
            # would otherwise each keep their own for good
            self._agree_on_run(trained(self.model), global_weights=weights_checksum(
                self.global_weights()))
            make_levels_now(self.policy, self.topology, group, "outer")
        except Exception as e:
            self.group = old  # agreed again at the next quorum
            if not _transient(e):
                raise  # replicas that can never agree: into the training loop
            self.manager.report_error(e)
            return self._discard_begun(f"agreeing on the run failed ({type(e).__name__})")
        if old is not None:
            release(old, drain=False)
        self._follow_the_quorum(group)
        return True

    def _follow_the_quorum(self, group: dist.ProcessGroup) -> None:
        """The memory rule at a new quorum: a live replica keeps its error-feedback memory
        while its rank and the quorum's size stay (the memory is laid out by both: the
        padded length of the group, this rank's chunk); otherwise it starts fresh."""
        place, old = (group.rank(), group.size()), self._place
        self._place = place
        if old is None:
            return
        if place == old:
            log.warning("%s.DiLoCo: a new quorum of %d replicas at inner step %d, this "
                        "replica rank %d as before: it keeps its error-feedback memory", WHAT,
                        place[1], self.inner_steps, place[0])
            return
        for f in self.fragments:
            f.dp.fresh()
        log.warning("%s.DiLoCo: a new quorum at inner step %d: this replica is rank %d of "
                    "%d (was %d of %d); its error-feedback memory, laid out for the old "
                    "quorum, starts fresh", WHAT, self.inner_steps, *place, *old)

    def _discard_begun(self, why: str) -> bool:
        """A sync begun (a quorum asked for) that runs no all-reduce: voted out as torchft
        votes out a failed step, the starting fragments back to θ_global."""
        self.manager.should_commit()
        model = named_parameters(self.model)
        for f in self._starting(self.inner_steps):
            f.set_local(model, f.global_)
        log.warning("%s.DiLoCo: the sync at inner step %d was not committed (%s): the "
                    "fragments restart from θ_global", WHAT, self.inner_steps, why)
        return False

    def _start(self, fragment: Fragment, fields: dict[str, Any], agreed: bool) -> None:
        if not fragment.names:  # nothing to send: the begun sync is voted on all the same
            self.manager.should_commit()
            return
        self._before[fragment.index] = fragment.dp.state_dict()
        super()._start(fragment, fields, agreed)

    def _result(self, pending: Any) -> torch.Tensor | None:
        try:
            return super()._result(pending)
        except Exception as e:
            if not _transient(e):
                raise  # a bad input or a mismatch would fail every retry alike
            self.manager.report_error(e)  # a replica died: torchft votes the sync out
            self._failure = f"its all-reduce failed: {type(e).__name__}"
            return None

    @torch.no_grad()
    def _apply(self, fragment: Fragment, delta: torch.Tensor | None) -> None:
        """The outer step if torchft commits the sync; else the sync is discarded."""
        before = self._before.pop(fragment.index, None)
        if self.manager.should_commit() and delta is not None:
            super()._apply(fragment, delta)
            return
        fragment.set_local(named_parameters(self.model), fragment.global_)
        if before is not None:
            fragment.dp.load_state_dict(before, True)
        log.warning("%s.DiLoCo: the sync of fragment %d at inner step %d was not committed "
                    "(%s): its pseudo-gradient is discarded, the fragment restarts from "
                    "θ_global and its error-feedback memory is back to before the sync",
                    WHAT, fragment.index, self.inner_steps,
                    self._failure if delta is None else "torchft's vote")

    def _healing_state(self) -> dict[str, Any]:
        """What a healing replica takes from this one: no codec state (the memory rule)."""
        if self._pending:
            raise RuntimeError(f"{WHAT}.DiLoCo: a healing state was asked for with an "
                               "all-reduce in flight")
        return {"format": STATE_KEY, "policy": self.policy.to_dict(),
                "config": asdict(self.config), "inner_steps": self.inner_steps,
                "syncs": self.syncs, "skipped": self.skipped,
                "fragments": [{"names": list(f.names), "global": f.global_.clone(),
                               "momentum": f.momentum.clone()} for f in self.fragments]}

    def _load_healed(self, state: dict[str, Any]) -> None:
        mine = {"format": STATE_KEY, "policy": self.policy.to_dict(),
                "config": asdict(self.config)}
        for field, value in mine.items():
            if state.get(field) != value:
                raise CollectiveMismatchError(
                    f"{WHAT}.DiLoCo: the live replica this one heals from has {field} "
                    f"{state.get(field)!r}; this replica has {value!r}")
        names = [f["names"] for f in state["fragments"]]
        if names != [f.names for f in self.fragments]:
            raise CollectiveMismatchError(
                f"{WHAT}.DiLoCo: the live replica this one heals from trains the "
                f"parameters {few(sum(names, []))} in its fragments; this replica trains "
                f"{few([n for f in self.fragments for n in f.names])}")
        for f, saved in zip(self.fragments, state["fragments"]):
            f.global_.copy_(saved["global"])
            f.momentum.copy_(saved["momentum"])
            f.dp.fresh()
        self.inner_steps, self.syncs = state["inner_steps"], state["syncs"]
        self.skipped = state["skipped"]
        self._pending.clear()
        self._before.clear()
        self._place = None  # a fresh memory, laid out by the quorum it joins
        log.warning("%s.DiLoCo: healed from a live replica at inner step %d: θ_global, the "
                    "outer momentum and the schedule taken; this replica's error-feedback "
                    "memory starts fresh", WHAT, self.inner_steps)

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore a state this class saved: θ_global, momentum and schedule; the
        error-feedback memory starts fresh (laid out for the quorum that saved it), and an
        all-reduce in flight when it was saved is discarded (torchft never voted on it).
        Replicas resumed from different states are made alike by torchft's healing."""
        super().load_state_dict(state, elastic=True)
        if self._site_check is not None:
            self._site_check.close()
        self._site_check = None  # replicas resume and heal on their own: no joint check
        model = named_parameters(self.model)
        for i in sorted(self._pending):
            self.fragments[i].set_local(model, self.fragments[i].global_)
        self._pending.clear()
        self._place = None

    def remove(self) -> None:
        """:meth:`commpress.DiLoCo.remove`, and the Manager no longer serves this
        synchronizer's state to healing replicas."""
        super().remove()
        self.manager._load_state_dict_fns.pop(STATE_KEY, None)
        self.manager._user_state_dicts.pop(STATE_KEY, None)

    def _resume_group(self) -> dist.ProcessGroup | None:
        return None  # each replica checks its own state; torchft heals those behind

    def _identity(self) -> tuple[int, int]:
        return self._place or (0, 0)  # its place in the last quorum (loads are elastic)


def _transient(error: Exception) -> bool:
    """A failure torchft recovers from by voting the sync out (a replica that died, a
    timeout); not a mismatch or a bad input, which every retry would meet again."""
    if isinstance(error, CollectiveMismatchError | InputError):
        return False
    # commpress names a transfer that failed or waited too long (CollectiveTimeoutError);
    # what torch raises itself is a DistError
    return isinstance(error, CollectiveTimeoutError | dist.DistError | ConnectionError
                      | TimeoutError)


STATE_KEY = "commpress.torchft.DiLoCo/1"


def _check_manager(manager: Any) -> None:
    """A Manager this DiLoCo can run on (one whose every replica joins each sync)."""
    from torchft.manager import Manager, WorldSizeMode

    if not isinstance(manager, Manager):
        raise InputError(f"{WHAT}.DiLoCo: manager={type(manager).__name__} is not allowed; "
                         "allowed: a torchft.Manager")
    if getattr(manager, "_use_async_quorum", False):
        raise InputError(f"{WHAT}.DiLoCo: a Manager with use_async_quorum=True is not "
                         "allowed (a healing replica would sit out the sync with memory "
                         "of its own); allowed: use_async_quorum=False")
    mode = getattr(manager, "_replica_world_size_mode", WorldSizeMode.DYNAMIC)
    if mode != WorldSizeMode.DYNAMIC:
        raise InputError(f"{WHAT}.DiLoCo: a Manager with world_size_mode={mode} is not "
                         "allowed (spares sit out syncs); allowed: WorldSizeMode.DYNAMIC")
    known = getattr(manager, "_user_state_dicts", {})
    if STATE_KEY in known:
        raise InputError(f"{WHAT}.DiLoCo: this Manager already serves a DiLoCo's state; "
                         "allowed: one DiLoCo per Manager (remove() the other first)")
    if not known:
        raise InputError(f"{WHAT}.DiLoCo: a Manager without state_dict/load_state_dict is not "
                         "allowed: a healing replica must take the model and the inner "
                         "optimizer from a live peer; allowed: Manager(state_dict=lambda: "
                         "{'model': model.state_dict(), 'inner': inner.state_dict()}, "
                         "load_state_dict=...)")
    pg = getattr(manager, "_pg", None)
    if type(pg).__name__ not in _IN_PROCESS:
        raise InputError(f"{WHAT}.DiLoCo: a Manager on {type(pg).__name__} is not allowed; "
                         f"allowed: torchft's {', '.join(_IN_PROCESS)} (not wrapped by "
                         f"{WHAT}.compress: the DiLoCo compresses its own all-reduces)")
