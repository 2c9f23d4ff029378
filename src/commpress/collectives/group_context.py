"""One state object per process group: its call sequence, node levels and stats.

torch.distributed keeps a process group's state in the group; commpress does the same.
A :class:`GroupContext` is created at a group's first compressed call and held in a
weak mapping keyed by the group object, so it is dropped with the group; a lock
guards it where the DDP hook's communication thread and the main thread both reach
it. The sub-groups it makes (node levels; on NCCL, the Gloo control group) are the
group's own (:mod:`commpress.collectives.subgroups`): collectives on two groups of the
same ranks, from two threads, never meet on a shared connection.

:meth:`GroupContext.agree` is the per-call check of :mod:`commpress.collectives.agreement`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from commpress.collectives import subgroups
from commpress.collectives.byte_stats import Stats, retire
from commpress.collectives.comm import (
    Gather,
    all_gather_single,
    group_timeout,
    rank_in,
    registered,
)
from commpress.collectives.levels import levels_used
from commpress.collectives.mismatch import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    describe_call,
    deviation_message,
    digest,
    mismatch_message,
)
from commpress.collectives.watchdog import (
    no_store,
    passed_by_peers,
    reported,
    say_replaying,
    say_waiting,
    tell,
    told,
    wait_polling,
    waiting_ranks,
    watch_replaying,
    watched,
    who,
)

HEADER_WORDS = 4  # sequence number, 128-bit digest as two int64, a balance share
CYCLE_LIMIT = 4096  # calls of one cycle whose agreed form is kept
T = TypeVar("T")

# the front-end call being made on this thread (replayable())
_REPLAY_KEY: ContextVar[list | None] = ContextVar("commpress_replay_key", default=None)


@contextmanager
def replayable(key: str | None) -> Iterator[None]:
    """The collectives called inside are a front-end's repeated call ``key`` (a bucket's
    gradient reduction, its weight gather): on a group that allows it
    (:meth:`GroupContext.allow_replay`), each may skip its header where every rank made
    the same call at the same point of the previous cycle (:class:`Cycle`). ``None``:
    calls that must carry their header. Several calls inside (a low-rank hook's two
    all-reduces) are told apart by their order: ``key#0``, ``key#1``, …"""
    token = _REPLAY_KEY.set(None if key is None else [key, 0])
    try:
        yield
    finally:
        _REPLAY_KEY.reset(token)


def _scope_key() -> str | None:
    """The key of the next call in this thread's :func:`replayable` scope, if any."""
    scope = _REPLAY_KEY.get()
    if scope is None:
        return None
    key, scope[1] = f"{scope[0]}#{scope[1]}", scope[1] + 1
    return key


class Cycle:
    """The replayable calls a front-end makes on a group each step, in the form all ranks
    last agreed at each point of the step.

    A cycle starts at each call of the first replayable call's key (a step's first
    bucket), which always carries a header. A call's *point* is how many replayable calls
    this rank made since; other calls, which carry a header each, do not count. A call
    that equals, at its point, the call every rank agreed there in an earlier cycle —
    same key, same digest of what its header would carry — is *replayed* without a
    header: every rank that replays it makes that same call. Any other call carries its
    header: where every rank's calls changed alike (a measured fallback decided, the
    graph changed the buckets' order) the ranks agree on the new ones; where one rank's
    changed alone, it waits in a header while the others replay, and
    :meth:`GroupContext._passed_by_peers` finds it out.
    """

    def __init__(self) -> None:
        self.start_key: str | None = None
        self.count = 0  # points placed in this cycle
        self.agreed: dict[int, tuple[str, tuple[int, int], str]] = {}  # key, form, text

    def place(self, key: str) -> int:
        """This call's point."""
        point = 0 if self.start_key is None or key == self.start_key else self.count
        self.count = point + 1
        return point

    def agreed_at(self, point: int) -> tuple[str, tuple[int, int], str] | None:
        """What every rank agreed at ``point`` in an earlier cycle (none at a start)."""
        return self.agreed.get(point) if point else None

    def record(self, point: int, key: str, form: tuple[int, int], text: str) -> None:
        """Every rank agreed to this call through its header."""
        if point == 0:
            self.start_key = key
        if point < CYCLE_LIMIT:
            self.agreed[point] = (key, form, text)


@dataclass(frozen=True)
class Levels:
    """The resolved two levels of a group for this rank."""

    ranks_per_node: int
    nodes: int
    node: int
    local_rank: int
    intra: dist.ProcessGroup | None  # None when there is one rank per node
    inter: dist.ProcessGroup | None  # None when there is one node


class GroupContext:
    """State commpress keeps for one process group.

    Slots: identity (``rank``, ``world``, ``ranks``, ``name``); internal state (call
    sequence numbers, point-to-point counters and inboxes, node levels, the control group);
    ``stats`` (this group's byte and time counters).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        # identity
        known = registered(group)  # torchft's groups are not: their own ranks then
        self.rank = rank_in(group)
        self.world = group.size()
        self.ranks = (tuple(dist.get_process_group_ranks(group)) if known
                      else tuple(range(self.world)))
        self.name = getattr(group, "group_name", "") or f"unregistered-{id(group):x}"
        self.backend = str(dist.get_backend(group)) if known else group.name()
        # internal state
        self._lock = threading.RLock()
        self._seq = 0
        self._meetings = 0  # rendezvous() calls on this group
        self._p2p: dict[tuple[str, int, int], int] = defaultdict(int)
        self._p2p_inboxes: dict[tuple[int, int], object] = {}
        self._levels: dict[int, Levels] = {}
        self._control: dist.ProcessGroup | None = group if "gloo" in self.backend else None
        self._incarnation: int | None = None  # of this group's name, once it owns sub-groups
        self._store: dist.Store | None = None  # its sub-groups' connection to the store
        # (the connection of the thread that made its first one)
        self.subgroups: list[dist.ProcessGroup] = []  # made for it, destroyed with it
        self._held: list = []  # (work, buffers) sent without a caller to wait on them
        self._cycle: Cycle | None = None  # set by allow_replay()
        self.replayed = 0  # calls that skipped their header
        self.last_replayed = -1  # the sequence number of the last
        self.last_replayed_at = 0.0  # when (time.monotonic())
        self.last_said = -1  # the last replayed call this rank told the store of
        self.deviated: str | None = None  # why this group can take no more calls
        self.tag = self.name  # its name and incarnation, once it replays
        self._group_ref = weakref.ref(group)
        # stats
        self.stats = Stats()

    # -- agreement ------------------------------------------------------------------
    def agree(self, collective: str, /, **fields: object) -> int:
        """Check that every rank of the group makes this call with these ``fields``.

        Returns the call's sequence number. Raises :class:`CollectiveMismatchError` on
        every rank if any field (or the sequence number) differs.
        """
        return self.agree_balanced(collective, 0, **fields)[0]

    def agree_balanced(self, collective: str, balance: int, /,
                       **fields: object) -> tuple[int, bool]:
        """:meth:`agree`, carrying ``balance`` — this rank's share of a sum that is zero
        (mod 2⁶⁴) when what the ranks claim of each other matches (an all-to-all's
        splits: :func:`~commpress.collectives.compressed_all_to_all.split_balance`) — in
        the same header → ``(sequence number, whether the shares sum to zero)``. No extra
        round trip."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            if self.world == 1:
                return seq, balance % 2**64 == 0
            if self.deviated is not None:
                raise CollectiveMismatchError(self.deviated)
            key = _scope_key() if self._cycle is not None and balance == 0 else None
            plain = agreed = None
            if key is not None:  # which of the front-end's calls it is, agreed too
                fields = {**fields, "front_end_call": key}
                plain = describe_call(collective, None, fields)
                form = digest(plain)
                point = self._cycle.place(key)
                agreed = self._cycle.agreed_at(point)
                if agreed is not None and agreed[:2] == (key, form):
                    self.replayed += 1
                    self.last_replayed, self.last_replayed_at = seq, time.monotonic()
                    return seq, True
            text = describe_call(collective, seq, fields)
            share = (balance + 2**63) % 2**64 - 2**63  # as a signed int64
            header = torch.tensor([seq, *digest(text), share], dtype=torch.int64)
            gathered = torch.empty(self.world * HEADER_WORDS, dtype=torch.int64)
            control = self.control_group()
            work = all_gather_single(gathered, header, control, async_op=True)
            departure = (f"commpress.{collective}", plain or text,
                         None if agreed is None else agreed[2])
            self._wait(work, seq, collective, fields.get("label"), departure)
            rows = gathered.view(self.world, HEADER_WORDS)
            heads = rows[:, :3]
            if bool((heads == heads[0]).all()):
                if key is not None:
                    self._cycle.record(point, key, form, plain)
                return seq, sum(rows[:, 3].tolist()) % 2**64 == 0
            texts = _gather_texts(text, control)
            message = mismatch_message(f"commpress.{collective}", texts, self.ranks)
            if len(set(rows[:, 0].tolist())) > 1:  # ranks at other calls: some replayed,
                self.deviated = message  # their transfers in flight: no more calls
        raise CollectiveMismatchError(message)

    def allow_replay(self) -> None:
        """Let this group's :func:`replayable` calls skip their header where they repeat
        the call all ranks agreed at the same point of the previous cycle (:class:`Cycle`).

        For a front-end whose calls on the group are fixed by a layout the ranks agreed
        (the sharded optimizer's buckets, a DDP hook's), made by every member in an
        agreed call (its construction). On Gloo the headers move to a control group of
        their own, so that a header one rank sends where the others replay never meets
        their payload on one connection (Gloo aborts the process on such a mismatch).
        Groups made outside torch.distributed (torchft's) keep a header on every call."""
        with self._lock:
            group = self._group_ref()
            if self._cycle is not None or self.world == 1 or group is None or not registered(group):
                return
            if "gloo" not in self.backend:  # not run on NCCL yet: a header on every call
                return
            self._control = self._subgroup("control", list(self.ranks), "gloo")
            # where peers leave word while they wait (watchdog.tell, say_replaying)
            self.tag = f"{self.name}/{self._incarnation}"
            self._cycle = Cycle()
            watch_replaying(self)

    def _passed_by_peers(self, seq: int, departure: tuple[str, str, str | None]) -> None:
        """While this rank waits in call ``seq``'s header on a replaying group: raise the
        mismatch a peer left (:func:`told`), or, if a peer went past this call without
        its header — it replayed there, as it says while it waits — raise it here and
        leave it for the others. Such a peer made the call every rank agreed at this
        point of the previous step, where this rank made another (``departure``: the
        collective, this rank's call and the agreed one, when there was one)."""
        told(self)
        say_waiting(self, seq)
        past = passed_by_peers(self, seq)
        if not past:
            return
        what, mine, agreed = departure
        rank = self.ranks[self.rank]
        if agreed is not None:
            message = deviation_message(what, mine, agreed, rank, seq)
        else:
            message = (f"{what}: ranks disagree, so the call would corrupt data or hang; at "
                       f"call #{seq} ranks {past} replayed, without a header, the call every "
                       f"rank agreed at this point of the previous step, where rank {rank} "
                       "made this call")
        self.deviated = message = tell(self, message)
        raise CollectiveMismatchError(message)

    def gather_words(self, words: list[int], collective: str, label: object) -> torch.Tensor:
        """Every rank's ``words`` (as many on each) → ``(world, len(words))``: what ranks
        exchange once a balanced agreement failed, to name who claimed what."""
        with self._lock:
            mine = torch.tensor(words, dtype=torch.int64)
            gathered = torch.empty(self.world * len(words), dtype=torch.int64)
            work = all_gather_single(gathered, mine, self.control_group(), async_op=True)
            self._wait(work, self._seq - 1, collective, label)
            return gathered.view(self.world, len(words))

    def next_p2p(self, direction: str, peer: int, tag: int) -> int:
        """Sequence number of the next ``direction`` ("send"/"recv") with ``peer``, ``tag``."""
        with self._lock:
            key = (direction, peer, tag)
            seq = self._p2p[key]
            self._p2p[key] += 1
            return seq

    def p2p_inbox(self, peer: int, tag: int, make: Callable[[], T]) -> T:
        """The state of what ``peer`` sends this rank on ``tag`` (``make()`` at first use)."""
        with self._lock:
            inbox = self._p2p_inboxes.get((peer, tag))
            if inbox is None:
                inbox = self._p2p_inboxes[(peer, tag)] = make()
            return inbox  # type: ignore[return-value]

    def hold(self, work, *buffers: torch.Tensor) -> None:
        """Keep an asynchronous send and its buffers alive until it completes (a send
        posted on an error path, which nobody waits on)."""
        with self._lock:
            self._held = [(w, b) for w, b in self._held if not w.is_completed()]
            self._held.append((work, buffers))

    def control_group(self) -> dist.ProcessGroup:
        """The group that carries headers as CPU tensors (on NCCL a Gloo sub-group this
        group owns)."""
        with self._lock:
            if self._control is None:
                # every member reaches its first collective on the group: making the
                # side group here cannot wait for a rank that never comes
                self._control = self._subgroup("control", list(self.ranks), "gloo")
            return self._control

    def _subgroup(self, kind: str, ranks: list[int], backend: str) -> dist.ProcessGroup:
        """A sub-group of ``ranks`` this group owns (:mod:`~commpress.collectives.subgroups`),
        made by its members in the call that needs it; destroyed with the group."""
        group = self._group_ref()
        if group is None or not registered(group):
            raise RuntimeError(f"commpress: group {self.name} is not known to "
                               "torch.distributed (torchft's are not), so no node levels or "
                               "control group can be made of it; allowed there: one level "
                               "(Topology(1) or a one-level codec) on a Gloo group")
        if self._incarnation is None:
            self._incarnation = subgroups.next_incarnation(self.name)
            self._store = subgroups.store_client()
        made = subgroups.make(self.name, self._incarnation, kind, ranks, backend,
                              group_timeout(group), self._store)
        self.subgroups.append(made)
        _PARENTS[made] = weakref.ref(self)  # its transfers wait as this group's do
        return made

    def _wait(self, work, seq: int, collective: str, label: object,
              departure: tuple[str, str, str | None] | None = None) -> None:
        with watched(self, seq):
            try:
                if self._cycle is None or departure is None:
                    work.wait()
                else:  # peers may be replaying where this rank sent a header
                    wait_polling(work, "gloo", lambda: self._passed_by_peers(seq, departure))
            except CollectiveMismatchError:
                raise
            except RuntimeError as e:
                if self._cycle is not None:  # a peer's word, if it left one and exited
                    told(self)
                raise self._timeout_error(seq, collective, label, e) from e

    def _timeout_error(self, seq: int, collective: str, label: object,
                       cause: Exception) -> CollectiveTimeoutError:
        where = f"commpress.{collective} (label {label!r}, call #{seq} on group {self.name})"
        named = who(self, waiting_ranks(self, seq), "never reached it", "were waiting there",
                    "reached it; a connection failed",
                    f"could not tell which ranks are missing ({no_store()})")
        return CollectiveTimeoutError(f"{where} timed out: {named}. Cause: "
                                      f"{type(cause).__name__}: {cause}")

    # -- node levels -------------------------------------------------------------------
    def levels(self, group: dist.ProcessGroup, ranks_per_node: int) -> Levels:
        """The two levels of ``group`` for ``ranks_per_node`` (sub-groups made once, owned
        by ``group``)."""
        with self._lock:
            levels = self._levels.get(ranks_per_node)
            if levels is not None and not _alive(levels.intra, levels.inter):
                self._incarnation = None  # made again: under names never used before
                levels = None
            if levels is None:
                levels = self._make_levels(group, ranks_per_node)
                self._levels[ranks_per_node] = levels
            return levels

    def _make_levels(self, group: dist.ProcessGroup, rpn: int) -> Levels:
        me, ranks = self.rank, self.ranks
        nodes = self.world // rpn
        used = levels_used(True, self.world, rpn) if self.world > 1 else ()
        intra = inter = None
        if used == ("intra", "inter"):
            node, local = me // rpn, me % rpn
            backend = self.backend
            intra = self._subgroup(f"intra{rpn}", [ranks[node * rpn + i] for i in range(rpn)],
                                   backend)
            inter = self._subgroup(f"inter{rpn}",
                                   [ranks[n * rpn + local] for n in range(nodes)], backend)
        elif used == ("intra",):
            intra = group
        elif used == ("inter",):
            inter = group
        return Levels(rpn, nodes, me // rpn, me % rpn, intra, inter)


def _gather_texts(text: str, group: dist.ProcessGroup) -> list[str]:
    raw = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    rows = Gather(raw, fixed_size=False, group=group).wait()
    return [bytes(row.tolist()).decode(errors="replace") for row in rows]


# -- the registry: one context per live group ------------------------------------------

_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# sub-group → (a weak reference to) the context of the group that made it
_PARENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def context(group: dist.ProcessGroup) -> GroupContext:
    """The context of ``group``, created at its first use, dropped with the group."""
    with _REGISTRY_LOCK:
        ctx = _CONTEXTS.get(group)
        if ctx is None:
            ctx = GroupContext(group)
            _CONTEXTS[group] = ctx
            # the group's counters outlive it in the process totals
            weakref.finalize(group, retire, ctx.stats)
        return ctx


def release(group: dist.ProcessGroup, drain: bool = True) -> None:
    """Destroy ``group``, the sub-groups it owns (node levels, control group) and its
    context. Each process group holds backend threads and sockets until it is destroyed:
    a process that runs many jobs one after another (``compare``'s policies, a sweep of
    runs) must release each job's groups. Local: every member calls it after its last
    collective on ``group``. The default group is left (its sub-groups go with it at
    ``destroy_process_group()``). ``drain=False``: destroy it at once, without waiting
    for the others (the run failed: a peer may be dead or still inside a collective on
    it)."""
    with _REGISTRY_LOCK:
        ctx = _CONTEXTS.pop(group, None)
    if group is not dist.group.WORLD and _alive(group):
        if drain:  # no member may still be sending on it (a held send, a peer's receive)
            dist.barrier(group=group)
        if ctx is not None:
            subgroups.destroy(ctx.subgroups)
        dist.destroy_process_group(group)


def live_contexts() -> list[GroupContext]:
    with _REGISTRY_LOCK:
        return list(_CONTEXTS.values())


def _alive(*groups: dist.ProcessGroup | None) -> bool:
    """Whether the groups are still registered (not destroyed by the user)."""
    registered = dist.distributed_c10d._world.pg_map
    return all(g is None or g in registered for g in groups)


def wait_transfer(transfer: Any, group: dist.ProcessGroup) -> Any:
    """Wait for a payload ``transfer`` on ``group``. On a group that replays calls (or a
    level of one), a long wait also says in the store that this rank replayed — a peer
    waiting in a header at that call then raises the mismatch — and raises the mismatch
    a peer left there (:meth:`GroupContext._passed_by_peers`) instead of waiting for the
    timeout."""
    ctx = _replaying(group)
    if ctx is None:
        return transfer.wait()

    def on_slow() -> None:
        say_replaying(ctx)
        told(ctx)

    try:
        return wait_polling(transfer, ctx.backend, on_slow)
    except CollectiveMismatchError:
        raise
    except RuntimeError:  # the peer that left word may have exited since: its word first
        told(ctx)
        raise


def _replaying(group: dist.ProcessGroup) -> GroupContext | None:
    """The replaying context ``group`` belongs to: its own, or its parent's for a
    sub-group (a node level) the parent made."""
    ctx = _CONTEXTS.get(group)
    if ctx is None:
        parent = _PARENTS.get(group)
        ctx = parent() if parent is not None else None
    return ctx if ctx is not None and ctx._cycle is not None else None


def transfer_failed(group: dist.ProcessGroup, label: str,
                    cause: Exception) -> CollectiveTimeoutError:
    """The error for a payload transfer on ``group`` that failed after every rank had
    agreed to the call (a peer died mid-call, or its connection broke): each rank that
    sees the failure reports it in the store and looks for the others' reports; the
    ranks that never report are named (dead, or stuck outside this collective)."""
    ctx = context(group)
    where = f"commpress transfer (label {label!r}, after call #{ctx._seq - 1} on group {ctx.name})"
    named = who(ctx, reported(ctx, lambda rank: f"commpress/failed/{ctx.name}/{rank}"),
                "never finished it (dead, or stuck elsewhere)", "saw the transfer fail",
                "saw the transfer fail: a connection broke",
                f"could not tell which rank failed ({no_store()})")
    return CollectiveTimeoutError(f"{where} failed: {named}. Cause: {type(cause).__name__}: "
                                  f"{cause}")
