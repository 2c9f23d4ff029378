"""Naming the ranks that never arrive: what a timed-out collective says.

A watchdog thread publishes, in the default store, which call each rank has been waiting
in for over :data:`PUBLISH_AFTER_S`; when a header exchange times out, or a transfer fails
after every rank agreed to it, each rank reports in the store and looks for the others'
reports for :data:`GRACE_S`, and the error lists the ranks that never reached the call
(dead, or stuck elsewhere). Everything here is best effort: with the store gone, or none
to ask, the error says so instead.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from commpress.collectives.mismatch import CollectiveMismatchError

if TYPE_CHECKING:
    from commpress.collectives.group_context import GroupContext

PUBLISH_AFTER_S = 1.0  # a wait longer than this is published for the timeout diagnosis
GRACE_S = 5.0  # how long a timed-out rank looks for the others' published waits

_WATCH_LOCK = threading.Lock()
_WATCHED: dict[int, tuple[GroupContext, int, float, bool]] = {}
_WATCHDOG: threading.Thread | None = None


def _store_key(ctx: GroupContext, seq: int, rank: int) -> str:
    return f"commpress/wait/{ctx.name}/{seq}/{rank}"


def _publish(ctx: GroupContext, seq: int) -> None:
    try:
        dist.distributed_c10d._get_default_store().set(_store_key(ctx, seq, ctx.rank), b"1")
    except Exception:  # noqa: BLE001 - best effort: the diagnosis says so when it fails
        pass


@contextmanager
def watched(ctx: GroupContext, seq: int) -> Iterator[None]:
    """While inside, a wait of more than PUBLISH_AFTER_S is published in the store."""
    token = threading.get_ident()
    with _WATCH_LOCK:
        _WATCHED[token] = (ctx, seq, time.monotonic(), False)
        _start_watchdog()
    try:
        yield
    finally:
        with _WATCH_LOCK:
            _WATCHED.pop(token, None)


def _start_watchdog() -> None:
    global _WATCHDOG
    if _WATCHDOG is None or not _WATCHDOG.is_alive():
        _WATCHDOG = threading.Thread(target=_watch, name="commpress-watchdog", daemon=True)
        _WATCHDOG.start()


def _watch() -> None:
    while True:
        time.sleep(PUBLISH_AFTER_S / 2)
        now = time.monotonic()
        with _WATCH_LOCK:
            due = [(t, e) for t, e in _WATCHED.items()
                   if not e[3] and now - e[2] > PUBLISH_AFTER_S]
            for token, (ctx, seq, since, _) in due:
                _WATCHED[token] = (ctx, seq, since, True)
            quiet = [c for c in _REPLAYING if c.last_replayed > c.last_said
                     and now - c.last_replayed_at > PUBLISH_AFTER_S]
        for _, (ctx, seq, _, _) in due:
            _publish(ctx, seq)
        for ctx in quiet:
            say_replaying(ctx)


def waiting_ranks(ctx: GroupContext, seq: int) -> set[int] | None:
    """Group ranks that published a wait in call ``seq``; None if the store is gone."""
    return reported(ctx, lambda rank: _store_key(ctx, seq, rank))


def reported(ctx: GroupContext, key_of: Callable[[int], str]) -> set[int] | None:
    """Publish this rank's ``key_of(rank)``, then the group ranks whose key is in the
    store within GRACE_S (all of them, as soon as they are); None if the store is gone."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(key_of(ctx.rank), b"1")
        deadline = time.monotonic() + GRACE_S
        while True:
            found = {r for r in range(ctx.world) if store.check([key_of(r)])}
            if len(found) == ctx.world or time.monotonic() > deadline:
                return found
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store died with its host rank
        return None


def no_store() -> str:
    """Why the ranks' reports could not be read: no default store to ask, or it is gone."""
    if not dist.is_initialized():
        return ("this process has no torch.distributed default store to ask: its groups "
                "are made outside torch.distributed, as torchft's are")
    return "the default store is unreachable: the rank that hosts it is gone?"


def who(ctx: GroupContext, reported: set[int] | None, absent: str, present: str,
         everyone: str, unknown: str) -> str:
    """Which ranks of ``ctx`` did not report (by global rank) and which did, in words."""
    if reported is None:
        return unknown
    missing = [ctx.ranks[r] for r in range(ctx.world) if r not in reported]
    seen = sorted(ctx.ranks[r] for r in reported)
    return f"ranks {missing} {absent}; ranks {seen} {present}" if missing else (
        f"every rank ({seen}) {everyone}")


# -- replayed calls (GroupContext.allow_replay): what a rank says while a wait is long ----

POLL_S = 1.0  # when a long wait on a replaying group first looks at what its peers said
POLL_MAX_S = 4.0  # and the longest it waits between looks (below GRACE_S: see tell)
_REPLAYING: weakref.WeakSet = weakref.WeakSet()  # the contexts that replay calls


def wait_polling(work, backend: str, on_slow: Callable[[], None]) -> Any:
    """``work.wait()``, calling ``on_slow()`` (which may raise) while it lasts — after
    :data:`POLL_S`, then at doubling intervals up to :data:`POLL_MAX_S` (the store serves
    every waiting rank) — on Gloo, whose ``wait(timeout)`` leaves the transfer running;
    ``work`` a torch work or one of commpress's transfers holding one (``.work``).
    Elsewhere a plain wait. A wait that ends in time costs nothing more."""
    inner = work if isinstance(work, dist.Work) else getattr(work, "work", None)
    if "gloo" not in backend or not isinstance(inner, dist.Work):
        return work.wait()
    interval = POLL_S
    while True:
        try:
            inner.wait(timedelta(seconds=interval))
            return work.wait()
        except RuntimeError as e:
            if "timed out" not in str(e):
                raise
            if inner.is_completed():  # it finished as the wait gave up: not slow
                return work.wait()
        on_slow()
        interval = min(2 * interval, POLL_MAX_S)


def tell(ctx: GroupContext, message: str) -> str:
    """Leave ``message`` (a deviation) where the peers of ``ctx`` look while they wait,
    and wait up to :data:`GRACE_S` for each to have read it (the store may live in this
    process, and go with it) → the message every rank raises: the first one left, if a
    peer's came first."""
    key = f"commpress/deviated/{ctx.tag}"
    try:
        store = dist.distributed_c10d._get_default_store()
        message = store.compare_set(key, "", message).decode()
    except Exception:  # noqa: BLE001 - best effort: the peers then time out instead
        return message
    reported(ctx, lambda rank: f"commpress/read/{ctx.tag}/{rank}")
    return message


def told(ctx: GroupContext) -> None:
    """Raise the mismatch a peer of ``ctx`` left (:func:`tell`), if any; this rank then
    takes no more calls on the group either."""
    key = f"commpress/deviated/{ctx.tag}"
    try:
        store = dist.distributed_c10d._get_default_store()
        message = store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - no store: the group's timeout ends the wait
        return
    if message is not None:
        ctx.deviated = message
        with suppress(Exception):  # the rank that left it waits for this
            store.set(f"commpress/read/{ctx.tag}/{ctx.rank}", b"1")
        raise CollectiveMismatchError(message)


def watch_replaying(ctx: GroupContext) -> None:
    """From now on, a ``ctx`` whose last call was replayed over :data:`PUBLISH_AFTER_S`
    ago says so (:func:`say_replaying`) from the watchdog thread, wherever its rank is
    blocked — in a transfer, a size exchange, a device sync — so a peer waiting in a
    header at that call finds it out."""
    with _WATCH_LOCK:
        _REPLAYING.add(ctx)
        _start_watchdog()


def say_replaying(ctx: GroupContext) -> None:
    """This rank is in a long transfer after its last replayed call on ``ctx``: a peer
    waiting in a header at that call, or an earlier one, learns that this rank went past
    it without a header (:func:`passed_by_peers`)."""
    ctx.last_said = replayed = ctx.last_replayed
    _say(ctx, f"replayed {replayed}")


def say_waiting(ctx: GroupContext, seq: int) -> None:
    """This rank is in a long wait in call ``seq``'s header on ``ctx``: it went past every
    earlier call."""
    _say(ctx, f"header {seq}")


def _say(ctx: GroupContext, where: str) -> None:
    try:
        dist.distributed_c10d._get_default_store().set(
            f"commpress/where/{ctx.tag}/{ctx.rank}", where)
    except Exception:  # noqa: BLE001 - best effort: the peers then time out instead
        pass


def passed_by_peers(ctx: GroupContext, seq: int) -> list[int]:
    """The peers of ``ctx`` (global ranks) that went past call ``seq`` without its header:
    they replayed it or a later call, or wait in a later call's header."""
    found = []
    try:
        store = dist.distributed_c10d._get_default_store()
        for r in range(ctx.world):
            key = f"commpress/where/{ctx.tag}/{r}"
            if r == ctx.rank or not store.check([key]):
                continue
            kind, at = store.get(key).decode().split()
            if int(at) > seq or (kind == "replayed" and int(at) == seq):
                found.append(ctx.ranks[r])
    except Exception:  # noqa: BLE001 - no store: the group's timeout ends the wait
        return []
    return found
