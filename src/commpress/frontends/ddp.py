"""A DDP communication hook: compressed gradient all-reduce.

``model.register_comm_hook(*commpress.ddp_hook(model, "int2ef"))`` replaces DDP's
all-reduce with the policy's ``dp.grad`` codecs (:class:`GradPath`): one-level
:func:`commpress.all_reduce`, or — with ``intra``/``inter`` codecs and several nodes —
:func:`commpress.hierarchical_all_reduce`. Every rank decodes the same bytes, so
replicas stay identical.

**The hook buckets the gradients itself.** DDP's buckets change: the first iteration
of every process puts the whole model in one bucket, and the buckets are rebuilt after
it in the order gradients became ready. A quantizer's groups, its stochastic-rounding
streams and its error-feedback memory depend on where each element sits in the
compressed tensor, so compressing DDP's buckets as they come would compress
differently after a restart than in an uninterrupted run — a resumed run would not
be the same run. The hook therefore packs the gradients DDP hands it into *its own*
buckets: a fixed layout of the model's parameters (by name, reverse registration
order, about ``bucket_numel`` elements each), the same in every process. A DDP bucket's
future completes once the hook buckets holding its parameters are reduced; the
values are copied back into DDP's buffer. Codec state is keyed by those buckets, so a
checkpoint restores it exactly. The price is one copy of the gradients each way.

With ``overlap=True`` (default) each hook bucket's all-reduce runs on one
communication thread, in the order the buckets fill (the same on every rank), so
backward keeps computing while a bucket is encoded and sent, and the next bucket is
encoded while the previous one is on the wire; DDP waits for the futures before the
optimizer step. Blocking collectives release the GIL.

**The hook has a process group of its own.** DDP runs collectives of its own on its
group from the main thread — the unused-parameter map at the end of backward
(``find_unused_parameters=True``), buffer broadcasts in forward, bucket rebuilds —
while the hook's run on the communication thread. Two threads issuing on one group
interleave differently on different ranks: Gloo aborts on mismatched sizes, and were
the sizes equal one rank's gradients would be summed with another's unused-parameter
map. So the hook creates, once, when it is created, a group of the DDP group's ranks
(same backend and timeout) that carries its collectives alone; the order on it is the
hook buckets' order, the same on every rank. The alternative — no thread, collectives
in order inside DDP's callback — would give up the overlap.

A failed bucket (a mismatch, a timeout) fails its DDP buckets' futures with that
error, so DDP's backward raises it; every later bucket then fails at once rather than
wait on a group that is out of step.

With a convergence guard (``guard=``, :mod:`commpress.dp.guard`) each hook bucket's
all-reduce of a sampled iteration runs in its watch, on the thread that issues it; after
the iteration's last bucket, on the same thread and group, the ranks add up their signals
and promote the buckets over budget — before DDP's futures complete, so the next backward
already uses the new codecs, and a rank lost in the decision fails this backward.
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.
import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from commpress.codecs import codec as build_codec
from commpress.collectives import Topology, context
from commpress.collectives.agreement import agree, refuse
from commpress.collectives.comm import group_timeout
from commpress.collectives.group_context import release, replayable
from commpress.dp import DPBucket
from commpress.dp.fallback import tally
from commpress.dp.grad_path import make_levels_now, warn_if_uncompressed
from commpress.dp.guard import GradGuard
from commpress.dp.saved_state import check_resume, envelope, on_every_rank
from commpress.policy import Guard, Policy, list_presets
from commpress.validate import InputError, check_bool, check_int, few

STATE_FORMAT = "commpress.DDPHookState/4"
log = logging.getLogger(__name__)
BUCKET_NUMEL = 1 << 22  # elements per hook bucket, by default


def _report(run: Callable[[], None], done: Callable[[BaseException | None], None]) -> None:
    """Call ``run``, then ``done`` with the error it raised, or None."""
    try:
        run()
    except BaseException as e:  # noqa: BLE001 - delivered to the waiting rank
        done(e)
        return
    done(None)


class _CommThread:
    """One daemon thread running each bucket's collective in submission order.

    A job is split in two: ``start`` (reduce inside the node, encode, start the slow
    transfer) returns ``finish`` (wait, decode, share inside the node). Job ``k``
    finishes after job ``k + 1`` has started — or at once if it is the last of the
    iteration — so the slow link carries one bucket while the next is encoded. The
    order depends only on the bucket order, the same on every rank.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="commpress-ddp", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread after the jobs already submitted."""
        self._queue.put(None)
        self._thread.join()

    def submit(self, start: Callable[[], Callable[[], None]],
               done: Callable[[BaseException | None], None], last: bool) -> None:
        self._queue.put((start, done, last))

    def _loop(self) -> None:
        pending = None  # (finish, done) of the previous bucket
        while True:
            job = self._queue.get()
            if job is None:
                return
            start, done, last = job
            finish = None
            try:
                finish = start()
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting rank
                done(e)
            if pending is not None:
                _report(*pending)
                pending = None
            if finish is not None:
                if last:
                    _report(finish, done)
                else:
                    pending = (finish, done)


@dataclass
class _HookBucket:
    """A fixed group of parameters whose gradients are reduced together."""

    names: list[str]
    numels: list[int]
    dp: DPBucket  # its gradient reducer and the reducer's state
    offsets: list[int] = field(init=False)
    buffer: torch.Tensor | None = None  # allocated at first use, in the gradients' dtype
    ready: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.offsets = list(itertools.accumulate(self.numels[:-1], initial=0))


@dataclass
class _Waiting:
    """A DDP bucket handed to the hook: its future completes when ``left`` reaches 0."""

    bucket: Any  # dist.GradBucket
    future: torch.futures.Future
    left: int
    error: BaseException | None = None


class DDPHookState:
    """Hook state: the policy, the group, the hook's buckets and their codecs.

    Slots: hyperparameters (``policy``, ``topology``, ``overlap``); internal state (the
    hook buckets with their :class:`GradPath`, keyed by position in a fixed layout; the
    hook's own process group); stats (``calls``). The process groups and the thread are
    dropped when pickled.
    """

    def __init__(self, model: nn.Module, policy: str | dict | Policy = "none",
                 group: dist.ProcessGroup | None = None, topology: Topology | None = None,
                 label: str = "dp.grad", overlap: bool = True,
                 bucket_numel: int = BUCKET_NUMEL, fallback: str | None = None,
                 guard: Guard | dict | float | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ddp_hook: model must be the torch.nn.Module DDP wraps (or the "
                            f"DDP module); got {type(model).__name__} — call "
                            "commpress.ddp_hook(model, policy)")
        check_int("ddp_hook: bucket_numel", bucket_numel, ge=1)
        check_bool("ddp_hook: overlap", overlap)
        module = getattr(model, "module", model)
        # hyperparameters
        self.policy = grad_policy(policy).with_fallback(fallback).with_guard(guard)
        self.topology = topology or Topology()
        self.group = _ddp_group(model, group)
        self.overlap = overlap
        self.label = label
        # internal state
        ignored = ddp_ignored(model)
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in ignored]
        self.buckets = hook_layout(named, bucket_numel, self._make_dp)
        by_name = dict(named)
        self._where = {id(by_name[name]): (j, i)  # parameter → (hook bucket, position)
                       for j, b in enumerate(self.buckets) for i, name in enumerate(b.names)}
        self._module: nn.Module | None = module  # to see parameters unfrozen since
        self._ignored = ignored
        self._waiting: dict[int, list[_Waiting]] = {}  # hook bucket index → DDP buckets
        self._done_buckets = 0
        self._lock = threading.Lock()
        self._thread: _CommThread | None = None
        self._failure: BaseException | None = None  # the first bucket that failed
        self._removed = False
        self.hook_group: dist.ProcessGroup | None = self._make_hook_group()
        warn_if_uncompressed(self.policy, self.topology, self.hook_group, "ddp_hook")
        # the convergence guard (a policy's guard:) over the hook buckets; the ranks decide
        # from every rank's signals at the same iterations: one guard
        self.guard = (GradGuard(self.policy.guard, [b.dp for b in self.buckets], "ddp_hook")
                      if self.policy.guard is not None else None)
        agree(self.hook_group, "ddp_hook", label="guard",
              guard=None if self.guard is None else self.policy.guard.to_dict())
        self.iterations = 0  # backward passes whose gradients the hook reduced
        # stats
        self.calls = 0

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """With ``fallback="measured"``: how many hook buckets went each way
        (:func:`commpress.dp.fallback.tally`); empty without it."""
        return tally(c for b in self.buckets for c in b.dp.choices.values())

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state: error-feedback memory and rounding streams are each
        rank's own, so the state records the rank and the world size it belongs to."""
        return envelope(STATE_FORMAT, self.policy, *self._identity(), calls=self.calls,
                        iterations=self.iterations, **self._fields(),
                        codecs=[b.dp.state_dict() for b in self.buckets],
                        **({"guard": self.guard.state_dict()} if self.guard else {}))

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore a state this rank saved: another rank's, world size's, policy's or
        layout's is refused naming the field.

        ``elastic=True`` resumes on another number of ranks (or from another rank's
        state): what every rank holds alike is kept, while the error-feedback memory and
        rounding streams, laid out for the world that saved them, start fresh (said once,
        on rank 0)."""
        def check() -> bool:
            memory = check_resume(
                state, STATE_FORMAT, "DDP hook", self.policy, *self._identity(), elastic,
                "resume each rank from its own state (every rank saves its own: "
                "commpress.save_rank_state), with the same number of ranks, policy, model "
                "and bucket_numel (they fix the layout); another number of ranks, or one "
                "rank's state on every rank: load_state_dict(state, elastic=True)",
                self._fields())
            if self.guard is not None:  # refused on every rank together, before any load
                self.guard.check_state(state.get("guard"))
            return memory

        memory = on_every_rank(self.group, "DDP hook", check)
        if self.guard is not None:  # promoted codecs first: their state's layout follows
            self.guard.load_state_dict(state.get("guard"))
        for b, codecs in zip(self.buckets, state["codecs"], strict=True):
            b.dp.load_state_dict(codecs, memory)
        self.calls = state["calls"]
        self.iterations = state.get("iterations", 0)  # a state saved before it was counted

    def _make_dp(self, index: int, names: list[str]) -> DPBucket:
        """Hook bucket ``index``'s reducer, of the parameters ``names``: the policy's."""
        return DPBucket(self.policy, self.topology, self.label)

    def _identity(self) -> tuple[int, int]:
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _fields(self) -> dict[str, Any]:
        """What a resume must match beside the policy, rank and world size."""
        return {"layout": [b.names for b in self.buckets]}

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(group=None, hook_group=None, _thread=None, _lock=None, _waiting={},
                 _failure=None, _module=None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def remove(self, drain: bool = True) -> None:
        """Stop the communication thread and destroy the hook's process group (with the
        sub-groups made for it), after the last step: a process that trains one model
        after another must not keep every earlier hook's threads and sockets. torch cannot
        unregister a communication hook, so a later backward through the DDP module is
        refused by name. Its state stays readable (a checkpoint after the last step).
        ``drain=False`` after a failed run: no waiting for the other ranks (one may be
        dead), and nothing raised in place of the run's own error."""
        self._removed = True
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self.hook_group is not None:
            release(self.hook_group, drain=drain and self._failure is None)
            self.hook_group = None

    def _make_hook_group(self) -> dist.ProcessGroup:
        """A group of the DDP group's ranks for the hook's collectives alone; its control
        group and node levels are made now too, not on the communication thread."""
        hook_group = new_hook_group(self.group)
        context(hook_group).control_group()
        # the hook buckets' calls are fixed by their layout: after the first step only a
        # step's first bucket carries a header
        context(hook_group).allow_replay()
        make_levels_now(self.policy, self.topology, hook_group)
        return hook_group

    def _check_no_parameter_unfrozen(self) -> None:
        """Refuse parameters that require gradients now but did not when DDP was built:
        DDP never hands them to a hook, so every rank would train them apart (stock DDP
        lets them drift silently)."""
        if self._module is None:
            return
        unfrozen = [n for n, p in self._module.named_parameters()
                    if p.requires_grad and n not in self._ignored and id(p) not in self._where]
        if unfrozen:
            refuse(self.hook_group, "ddp_hook.parameters", InputError(
                f"commpress.ddp_hook: {len(unfrozen)} parameters require gradients but did "
                f"not when DDP was built ({few(unfrozen)}): DDP never reduces them, so every "
                "rank would train them apart. Allowed: build DDP and its hook after changing "
                "requires_grad (or keep them trainable from the start, with lr 0 in a "
                "parameter group of their own until they are to train)"))

    # -- the hook's work ------------------------------------------------------------
    def take(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Copy a DDP bucket's gradients into the hook buckets; start every hook bucket
        that is now complete; return a future for ``bucket``'s reduced values."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._removed:
            raise RuntimeError("commpress.ddp_hook: the hook was removed (remove()), and torch "
                               "cannot unregister it from this DDP module; allowed: a new "
                               "DDP module (with or without a new hook) to train on")
        if self.hook_group is None:  # unpickled: every rank's DDP reaches its first bucket
            self.hook_group = self._make_hook_group()
        if self._done_buckets == 0 and not any(hb.ready for hb in self.buckets):
            self._check_no_parameter_unfrozen()  # the first bucket of a backward
        complete, touched = [], set()
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            hb_index, i = self._where[id(p)]
            hb = self.buckets[hb_index]
            if i in hb.ready:
                raise RuntimeError(
                    f"commpress.ddp_hook: DDP handed {hb.names[i]!r} to the hook twice before "
                    "the rest of its hook bucket: an earlier backward did not reduce every "
                    "parameter (a parameter unused in forward needs "
                    "DDP(find_unused_parameters=True))")
            if hb.buffer is None:
                hb.buffer = torch.zeros(sum(hb.numels), dtype=g.dtype, device=g.device)
            hb.buffer[hb.offsets[i]: hb.offsets[i] + hb.numels[i]].copy_(g.reshape(-1))
            hb.ready.add(i)
            touched.add(hb_index)
            if len(hb.ready) == len(hb.names):
                complete.append(hb_index)
        waiting = _Waiting(bucket, fut, len(touched))
        with self._lock:
            for j in touched:
                self._waiting.setdefault(j, []).append(waiting)
        for j in complete:
            self.buckets[j].ready.clear()
            self._done_buckets += 1
            last = self._done_buckets == len(self.buckets)
            if last:
                self._done_buckets = 0
            self._run(j, last)
            if last:
                self.iterations += 1
        # ``set_exception`` stores the error as the future's value, which DDP would read
        # as the gradient ("Unable to cast ... to Tensor"); raising it in ``then`` fails
        # the chained future instead, and DDP's backward raises with its message
        return fut.then(lambda f: f.wait())

    def _run(self, j: int, last: bool) -> None:
        hb = self.buckets[j]
        step, guard = self.iterations, self.guard
        # whether this iteration is the guard's sample: decided here, in step order (the
        # guard's counters move only in the decision that ends the previous iteration)
        sampled = guard is not None and self.hook_group.size() > 1 and guard.sampling(step)

        def start() -> Callable[[], None]:
            if self._failure is not None:
                raise RuntimeError(f"commpress.ddp_hook: not reducing bucket {j}: an earlier "
                                   f"bucket failed, so the hook's group is out of step "
                                   f"({type(self._failure).__name__}: {self._failure})")
            with replayable(f"hook bucket {j}"), _watching(guard, j, sampled):
                handle = hb.dp.all_reduce(hb.buffer, self.hook_group, op="avg", async_op=True)

            def finish() -> None:
                with _watching(guard, j, sampled):  # a two-stage all-reduce encodes again
                    handle.wait()
                if sampled and last:  # every bucket of the iteration reduced before it
                    guard.decide(step, self.hook_group)

            return finish

        done = functools.partial(self._reduced, j)
        if not self.overlap:
            _report(lambda: start()(), done)
            return
        if self._thread is None:
            self._thread = _CommThread()
        self._thread.submit(start, done, last)

    def _reduced(self, j: int, error: BaseException | None) -> None:
        """Hook bucket ``j`` is reduced: copy it back and complete the DDP buckets that
        now have every value."""
        with self._lock:
            waiters = self._waiting.pop(j, [])
        if error is not None and self._failure is None:
            self._failure = error
        for w in waiters:
            if error is None:
                self._copy_back(j, w.bucket)
            else:
                w.error = w.error or error
            w.left -= 1
            if w.left == 0:
                if w.error is not None:
                    w.future.set_exception(w.error)
                else:
                    w.future.set_result(w.bucket.buffer())

    def _copy_back(self, j: int, bucket: dist.GradBucket) -> None:
        hb = self.buckets[j]
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            hb_index, i = self._where[id(p)]
            if hb_index == j:
                g.view(-1).copy_(hb.buffer[hb.offsets[i]: hb.offsets[i] + hb.numels[i]])


def _watching(guard: GradGuard | None, j: int, sampled: bool) -> Any:
    return guard.watching(j, sampled) if guard is not None else nullcontext()


def ddp_ignored(model: nn.Module) -> set[str]:
    """Names of the parameters DDP leaves out of its reduction (set with
    ``DDP._set_params_and_buffers_to_ignore_for_model``, or delayed): DDP never hands
    them to a hook, so a hook bucket holding one would never complete."""
    if isinstance(model, DistributedDataParallel):
        return set(model.parameters_to_ignore)
    return set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))


def hook_layout(named: list[tuple[str, nn.Parameter]], bucket_numel: int,
                make_dp: Callable[[int, list[str]], DPBucket]) -> list[_HookBucket]:
    """Fixed buckets: parameters in reverse registration order (roughly the order their
    gradients become ready), one dtype per bucket, about ``bucket_numel`` elements each;
    ``make_dp(index, names)`` makes each one's :class:`DPBucket`."""
    groups: list[dict[str, int]] = []  # each bucket's parameters: name → numel
    dtype = None
    for name, p in reversed(named):
        if not groups or sum(groups[-1].values()) + p.numel() > bucket_numel or p.dtype != dtype:
            groups.append({})
        groups[-1][name] = p.numel()
        dtype = p.dtype
    return [_HookBucket(list(g), list(g.values()), make_dp(j, list(g)))
            for j, g in enumerate(groups)]


def grad_policy(spec: str | dict | Policy) -> Policy:
    """The hook's policy from a preset name, policy file, dict or policy — or from a codec
    spec such as ``"int4:hadamard=128"``, which every bucket's ``dp.grad`` then uses."""
    if (not isinstance(spec, str) or spec in list_presets()
            or spec.endswith((".yaml", ".yml", ".toml"))):
        return Policy.resolve(spec)
    try:
        build_codec(spec)
    except ValueError as e:
        raise InputError(f"ddp_hook: policy={spec!r} is neither a policy preset (allowed: "
                         f"{', '.join(list_presets())}, a policy file or dict) nor a codec "
                         f"spec: {e}") from None
    return Policy.from_dict({"name": spec, "dp": {"grad": spec}})


def _ddp_group(model: nn.Module, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The DDP module's process group, checked against ``group`` when both are given."""
    ddp_group = model.process_group if isinstance(model, DistributedDataParallel) else None
    if group is None or ddp_group is None:
        return group if group is not None else ddp_group
    ours, theirs = dist.get_process_group_ranks(group), dist.get_process_group_ranks(ddp_group)
    if ours != theirs:
        raise InputError(f"ddp_hook: group has ranks {ours} but the DDP module reduces over "
                         f"ranks {theirs}; allowed: the DDP module's process_group (or None)")
    return group


def new_hook_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks (default: the world), with its backend and
    timeout. Every member must call this together, as DDP's constructor is called."""
    if not dist.is_initialized():
        raise RuntimeError("ddp_hook: torch.distributed is not initialized; call "
                           "dist.init_process_group before wrapping the model in DDP")
    parent = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    backend = str(dist.get_backend(parent))
    # a sub-group (one of several data-parallel groups) is made by its members alone
    return dist.new_group(ranks, backend=backend, timeout=group_timeout(parent),
                          use_local_synchronization=len(ranks) < dist.get_world_size())


def compressed_allreduce_hook(state: DDPHookState,
                              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over the group with the policy's ``dp.grad`` codecs.

    Sends about ``2 · numel · bits / 8`` bytes per rank (reduce-scatter + all-gather);
    two-level, ``2 · (nodes − 1) / nodes · numel · bits_inter / 8`` per node cross nodes.
    """
    state.calls += 1
    return state.take(bucket)


def ddp_hook(model: nn.Module, policy: str | dict | Policy = "none",
             group: dist.ProcessGroup | None = None, topology: Topology | None = None,
             overlap: bool = True, bucket_numel: int = BUCKET_NUMEL,
             fallback: str | None = None, guard: Guard | dict | float | None = None):
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Args:
        model: the DDP module (or the module it wraps): its parameters' names fix the
            hook's bucket layout and key its checkpointed state.
        policy: preset name, policy file, dict or :class:`~commpress.Policy`; or a codec
            spec (``"int4:hadamard=128"``) for every bucket.
        group: the DDP process group (default: the DDP module's, else the world). The
            hook reduces over a new group of the same ranks, made here: every rank of
            the group calls ``ddp_hook`` together, as it calls ``DDP(...)``.
        topology: node layout for two-level policies (default from ``LOCAL_WORLD_SIZE``).
        overlap: run the collectives on a communication thread during backward.
        bucket_numel: elements per hook bucket.
        fallback: ``"measured"``: each bucket times its all-reduce compressed and exact in
            its first calls and keeps compression only where it is faster
            (:mod:`commpress.dp.fallback`); None: the policy's (``fallback:`` in a policy
            file; default off).
        guard: the convergence guard (:mod:`commpress.dp.guard`): a relative-error budget
            (``0.3``) or ``{"max_rel_error": …, "window": …, "every": …,
            "max_memory_ratio": …}``; buckets over it are promoted to more bits on every
            rank alike. None: the policy's (``guard:`` in a policy file; default off).

    Example::

        model = DDP(model)
        model.register_comm_hook(*commpress.ddp_hook(model, "int2ef"))
    """
    state = DDPHookState(model, policy, group, topology, overlap=overlap,
                         bucket_numel=bucket_numel, fallback=fallback, guard=guard)
    return state, compressed_allreduce_hook
