"""What one rank asks of the others, and how torch.distributed answers it.

Every collective is written once, as the steps one rank takes (a generator): it
encodes, ``yield``\\ s a request — an all-to-all of byte rows, an all-gather of one row,
an exact reduction — and gets back what the other ranks sent it; then it decodes,
sums, and may ask again. Two transports answer the requests:

* :func:`run` (here): one rank over a real process group; each request starts a
  torch.distributed transfer, and the call returns a :class:`Handle` once the slow
  transfer has started, so an async caller overlaps it with compute;
* :class:`commpress.collectives.played.Played`: ``N`` ranks in one process, each
  request answered by indexing the ranks' rows — what ``commpress simulate`` runs.

So a collective's control flow, codecs, random streams and byte accounting exist once
and the two transports agree bit for bit. The alternative — a played copy of every
collective "as the real one does it" — drifted each time either changed.

Steps keep only codes across a ``yield`` (``del`` their inputs once encoded): the
played transport holds every rank's suspended steps at once.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives.byte_stats import Stats
from commpress.collectives.chunks import Rows
from commpress.collectives.comm import (
    REDUCE_OPS,
    Exchange,
    Gather,
    all_gather_single,
    reduce_scatter_single,
)
from commpress.collectives.group_context import transfer_failed, wait_transfer
from commpress.collectives.handle import Handle, completed
from commpress.collectives.mismatch import CollectiveMismatchError


@dataclass(frozen=True)
class Peers:
    """The ranks a step talks to: this rank's index among them, their number, and the
    transport's name for them (a process group, or the played member ranks)."""

    rank: int
    size: int
    group: Any


@dataclass
class Request:
    """One exchange among ``peers``. ``eager``: the caller waits for it at once (a fast
    link inside the node); the first request that is not eager is where an async call
    returns. ``stats``/``label`` time the transfer."""

    peers: Peers
    stats: Stats
    label: str
    eager: bool


@dataclass
class AllToAll(Request):
    """Send ``rows[i]`` to peer ``i`` → what each peer sent this rank, in peer order:
    a ``(size, width)`` tensor (any dtype) or a list of 1-D tensors. Rows of uneven sizes
    with a known ``received`` size (every peer sends this rank that many bytes: uneven
    parts of a fixed-rate codec) arrive as a ``(size, received)`` tensor; with
    ``received[j]`` from each peer ``j`` (an all-to-all's splits), as a list. Either way
    with no exchange of sizes first."""

    rows: Rows = None
    received: int | list[int] | None = None


@dataclass
class AllGather(Request):
    """Every peer's ``row`` (all of one size when ``fixed``) → ``then(rows)``, where
    ``rows`` is a ``(size, width)`` tensor or a list. ``then`` must depend on the bytes
    alone (every peer computes it alike: the played transport computes it once);
    ``out``, a ``size × width`` buffer the real transport may gather into."""

    row: torch.Tensor = None
    fixed: bool = True
    then: Callable[[Rows], Any] = None
    out: torch.Tensor | None = None


@dataclass
class Reduce(Request):
    """torch's own uncompressed reduction of ``x`` (``op``: avg or sum): the whole tensor
    (``scatter=False``) or chunk ``rank`` of it into ``out``. The played transport sums
    in rank order; a backend in its own, so they agree to rounding, not bit for bit."""

    x: torch.Tensor = None
    op: str = "sum"
    scatter: bool = False
    out: torch.Tensor | None = None


Steps = Generator[Request, Any, Any]


def run(steps: Steps, then: Callable[[Any], Any] = lambda result: result) -> Handle:
    """Run one rank's ``steps`` over torch.distributed: start each request as it comes;
    return once a request that is not eager has started; ``wait()`` runs the rest and
    ``then(result)`` (at once when nothing had to be sent)."""
    try:
        request = next(steps)
        transfer = _start(request)
        while request.eager:
            request = steps.send(_finish(request, transfer))
            transfer = _start(request)
    except StopIteration as done:
        with torch.no_grad():  # results are written in place, as in Handle.wait()
            return completed(then(done.value))

    def finish() -> Any:
        nonlocal request, transfer
        try:
            while True:
                request = steps.send(_finish(request, transfer))
                transfer = _start(request)
        except StopIteration as done:
            return then(done.value)

    return Handle(finish)


def run_into(target: torch.Tensor, steps_of: Callable[[torch.Tensor], Steps]) -> Handle:
    """:func:`run` the steps ``steps_of(flat)`` on a flat view of ``target`` (a contiguous
    copy, written back, when it is not contiguous) and copy their result into it."""
    copied = not target.is_contiguous()
    flat = target.contiguous().view(-1)

    def then(values: torch.Tensor) -> torch.Tensor:
        # cast to the target's dtype; nothing to do when the steps wrote into ``flat``
        if values.data_ptr() != flat.data_ptr() or values.numel() != flat.numel():
            flat.view(values.shape).copy_(values)
        if copied:
            target.copy_(flat.view(target.shape))
        return target

    return run(steps_of(flat), then)


def _start(r: Request) -> Any:
    # a transfer that fails (a peer died mid-call) raises an error naming the ranks that
    # never finished it, not the backend's bare connection error (here and in _finish)
    with r.stats.timed(r.label, "comm_s", _device(r)):
        try:
            return _begin(r)
        except RuntimeError as e:
            raise transfer_failed(r.peers.group, r.label, e) from e


def _begin(r: Request) -> Any:
    """Start ``r``'s torch.distributed transfer."""
    group = r.peers.group
    if isinstance(r, AllToAll):
        return Exchange(r.rows, group, r.received)
    if isinstance(r, AllGather):
        if r.out is not None:
            return all_gather_single(r.out, r.row, group, async_op=True)
        return Gather(r.row, r.fixed, group)
    if r.scatter:
        if r.out is None:  # a level's partial result: the caller gave no buffer
            r.out = r.x.new_empty(r.x.numel() // r.peers.size)
        return reduce_scatter_single(r.out, r.x, r.op, group, async_op=True)
    return dist.all_reduce(r.x, op=REDUCE_OPS[r.op], group=group, async_op=True)


def _finish(r: Request, transfer: Any) -> Any:
    with r.stats.timed(r.label, "comm_s", _device(r)):
        try:
            received = wait_transfer(transfer, r.peers.group)
        except CollectiveMismatchError:  # a peer deviated from a replayed call
            raise
        except RuntimeError as e:
            raise transfer_failed(r.peers.group, r.label, e) from e
    if isinstance(r, AllGather):
        if r.out is not None:
            received = r.out.view(r.peers.size, -1)
        return r.then(received)
    if isinstance(r, Reduce):
        return r.out if r.scatter else r.x
    return received


def _device(r: Request) -> torch.device:
    for t in (getattr(r, "row", None), getattr(r, "x", None)):
        if t is not None:
            return t.device
    rows = r.rows
    return (rows if isinstance(rows, torch.Tensor) else rows[0]).device
