"""Ranks agree on every call, and one that never arrives is named.

**Agreement on every call.** Ranks that call a collective with different sizes,
dtypes or codecs — on any call, not only the first — would corrupt data, abort inside
Gloo or hang. So before each call the ranks all-gather a 32-byte header: the call's
sequence number on this group, a 128-bit BLAKE2 digest of everything they must
agree on (collective, label, codec spec, op, element count, dtype, ...), and a share of
a sum that checks what ranks claim of each other (an all-to-all's splits; zero
elsewhere). Equal
digests: go on. Different: the ranks exchange their full descriptors (any length)
and every rank raises the same :class:`CollectiveMismatchError` naming the ranks and
fields. The header travels on the CPU — over the group itself on Gloo, over a Gloo
side group on NCCL — so no GPU stream waits for the host. Point-to-point transfers
carry a header and descriptor ahead of the payload and an acknowledgement back
(:mod:`commpress.collectives.p2p`).

**A rank that never arrives** is named: a watchdog thread publishes, in the default
store, which call each rank has been waiting in for over a second; when the header
exchange times out, the error lists the ranks that never reached the call
(:mod:`commpress.collectives.watchdog`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from commpress.collectives.comm import group_timeout, resolve_group
from commpress.collectives.group_context import context, replayable
from commpress.collectives.mismatch import CollectiveMismatchError, CollectiveTimeoutError


def agree(group: dist.ProcessGroup | None, collective: str, /, **fields: object) -> int:
    """Check that every rank of ``group`` (default: the world) makes this call with these
    ``fields`` (:meth:`GroupContext.agree`): for the collectives commpress hands torch
    directly (a replica check, a buffer broadcast, an adapter's set-up), so that ranks
    that disagree, or one that never comes, get a named error rather than a hang."""
    return context(resolve_group(group)).agree(collective, **fields)


def allow_replay(group: dist.ProcessGroup | None) -> None:
    """Let ``group``'s :func:`replayable` calls skip their header where they repeat what
    every rank agreed at the same point of the previous step
    (:meth:`GroupContext.allow_replay`). Every member calls it, in an agreed call."""
    if group is None and not dist.is_initialized():
        return
    context(resolve_group(group)).allow_replay()


def refuse(group: dist.ProcessGroup | None, collective: str, error: Exception) -> NoReturn:
    """Raise ``error``, a refusal this rank found by itself (its model changed under a
    front-end), after an agreed call that tells the other ranks of ``group``: they meet it
    at their next collective there, which then fails on every rank with a mismatch naming
    the refusal — or, if every rank refused alike, passes and each raises ``error``. So no
    rank trains on into a collective the refusing one never reaches, and ranks that did
    not refuse pay nothing."""
    agree(group, collective, refused=str(error))
    raise error


def agree_across(collective: str, /, checks: list[tuple[dist.ProcessGroup, dict]]) -> None:
    """:func:`agree` on each ``(group, fields)`` of ``checks``, the groups of a mesh of up to
    three dimensions (HSDP's shard and replicate groups; Megatron's data-, tensor- and
    pipeline-parallel ones), so that every rank of the mesh is told when any ranks
    disagree — not only the ranks that share a group with one that differs, which would
    go on alone and wait for it. Every group is checked even after one failed (its peers
    wait there); then two rounds tell each group whether its members' other groups
    agreed, which reaches every rank of a mesh of three dimensions."""
    failed: list[CollectiveMismatchError] = []

    def each_group(fields_of: Callable[[dict], dict]) -> None:
        for group, fields in checks:
            try:
                agree(group, collective, **fields_of(fields))
            except CollectiveMismatchError as e:
                failed.append(e)

    each_group(lambda fields: fields)
    for _ in range(2):
        told = "disagreed (that rank's error names how)" if failed else "agreed"
        each_group(lambda fields, told=told: {"label": fields.get("label"),
                                              "other_groups_of_the_mesh": told})
    if failed:
        raise failed[0]


def rendezvous(group: dist.ProcessGroup | None, collective: str, /) -> None:
    """Wait until every rank of ``group`` (default: the world) reaches this call, through
    the default store rather than the group itself; raise :class:`CollectiveTimeoutError`
    naming the ranks that did not within the group's timeout (or the world group's, if
    shorter: an engine's cloned groups get torch's 30-minute default). For an adapter's
    set-up: a rank that never calls it goes on to the engine's own collectives on the same
    group, which a header exchange over the group would meet — a hang, or a Gloo abort on
    the size mismatch — where this names the rank instead."""
    if group is None and not dist.is_initialized():
        return
    ctx = context(resolve_group(group))
    if ctx.world == 1:
        return
    with ctx._lock:
        meeting = ctx._meetings
        ctx._meetings += 1
    keys = [f"commpress/meet/{ctx.name}/{meeting}/{r}" for r in range(ctx.world)]
    timeouts = [t for t in (group_timeout(resolve_group(group)), group_timeout(None)) if t]
    timeout = min(timeouts) if timeouts else timedelta(minutes=30)
    store = dist.distributed_c10d._get_default_store()
    store.set(keys[ctx.rank], collective)
    try:
        store.wait(keys, timeout)
    except Exception as e:  # noqa: BLE001 - the store's timeout error, named below
        missing = [ctx.ranks[r] for r, key in enumerate(keys) if not store.check([key])]
        raise CollectiveTimeoutError(
            f"commpress.{collective} (on group {ctx.name}) timed out after "
            f"{timeout.total_seconds():.0f} s: ranks {missing} never reached it (every rank "
            f"must call it, with the same arguments). Cause: {type(e).__name__}: {e}") from e


def all_gather_objects(obj: object, group: dist.ProcessGroup | None, label: str) -> list:
    """``obj`` of every rank of ``group`` (default: the world), in rank order, after the
    agreement check: how ranks tell each other that a file could not be read or
    written, so that every rank fails together. One process without torch.distributed:
    ``[obj]``."""
    if group is None and not dist.is_initialized():
        return [obj]
    group = resolve_group(group)
    with replayable(None):  # torch's object gather (sizes first) is not one to replay
        agree(group, "all_gather_object", label=label)
    out: list = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out
