"""Measured fallback: a bucket's collective stays compressed only where that is faster.

Compression pays on slow links and large messages; on a fast link, or for a small
bucket, encoding and decoding cost more than the bytes save. With a policy's
``fallback: measured`` each data-parallel bucket learns which on the live group. Its
first calls of each collective (the gradient reduction, the weight gather) run the
policy's codecs as the fixed preset would, synchronously; every other one also runs
torch's exact collective on scratch copies — the caller's tensors and the codecs' state
untouched — and each way is timed: a warm-up each, then :data:`SAMPLES` of each. So
until a decision the run is the preset's, bit for bit. Then the ranks decide together:
each rank's median time per way, the largest over the group (every rank waits for the
slowest), and compression is kept only if it is faster. A clear case is decided after
the first timed call each way: when one way took :data:`DECISIVE` times the other's.
The decision is logged once per bucket, kept in the bucket's state (a resumed run keeps
it without measuring again) and never changes afterwards; after a decision for exact the
error-feedback memory's last residual is not sent.

A decision rests on timings: two runs from one seed may decide differently (each
decision is logged, and a resume keeps the saved ones), which is the reproducibility
this option trades for speed.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from commpress.collectives.agreement import all_gather_objects
from commpress.collectives.handle import Handle, completed
from commpress.collectives.topology import Topology
from commpress.validate import InputError

log = logging.getLogger(__name__)
T = TypeVar("T")

WAYS = ("compressed", "exact")
WARMUP = 1  # calls each way before the timed ones (allocations, connections, caches)
SAMPLES = 3  # timed calls each way; the median counts
DECISIVE = 2.0  # after one timed call each way, a ratio this large decides at once


class MeasuredChoice:
    """Which way one bucket's collective ``what`` runs: measured, then decided on every
    rank alike (:meth:`run`)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        self.decision: str | None = None
        self.agreed_seconds: list[float] | None = None  # the group's, per way
        self.where: list[int] | None = None  # the group's size and node size it held for
        self._layout_checked = False  # a loaded decision is checked at its first call

    def run(self, call: Callable[[str, bool, bool], T], group: dist.ProcessGroup | None,
            topology: Topology, numel: int, async_op: bool) -> T | Handle:
        """``call(way, async_op, probe)`` the way this collective runs now, its result as
        the caller asked for it (while measuring, calls run to their end: with
        ``async_op``, a completed handle). ``probe=True``: run ``way`` on scratch copies,
        for its time alone."""
        if self.decision is not None:
            if not self._layout_checked:  # once: a loaded decision must fit this group
                self._check_layout(group, topology, numel)
            return call(self.decision, async_op, False)
        way = WAYS[sum(map(len, self.seconds.values())) % 2]
        if way == "compressed":  # the preset's own call, timed
            result, seconds = _timed(lambda: call("compressed", False, False))
        else:  # the preset's call, then the exact one on scratch copies, timed
            result = call("compressed", False, False)
            _, seconds = _timed(lambda: call("exact", False, True))
        self.seconds[way].append(seconds)
        timed = min(len(s) for s in self.seconds.values()) - WARMUP
        if len(self.seconds["exact"]) == len(self.seconds["compressed"]) and timed in (
                1, SAMPLES):  # the same call count on every rank
            self._decide(group, topology, numel, final=timed == SAMPLES)
        return completed(result) if async_op else result

    def _layout(self, group: dist.ProcessGroup | None, topology: Topology) -> list[int]:
        """The group's size and its ranks per node: what a decision holds for."""
        world = dist.get_world_size(group)
        return [world, topology.ranks_per_node_in(world)]

    def _check_layout(self, group: dist.ProcessGroup | None, topology: Topology,
                      numel: int) -> None:
        here = self._layout(group, topology)
        if self.where != here:
            raise InputError(
                f"fallback: bucket {self.what} ({numel} elements) decided "
                f"{self.decision!r} on {self.where[0]} ranks of {self.where[1]} per node; "
                f"this run has {here[0]} of {here[1]}: the decision does not hold here; "
                "allowed: resume on the same layout, or load the state with memory=False "
                "(elastic) to measure again")
        self._layout_checked = True

    def _decide(self, group: dist.ProcessGroup | None, topology: Topology, numel: int,
                final: bool) -> None:
        """Every rank's median per way, the largest over the group: compressed if faster;
        before the last samples, only a clear case (:data:`DECISIVE`)."""
        mine = [statistics.median(self.seconds[way][WARMUP:]) for way in WAYS]
        every = all_gather_objects(mine, group, f"{self.what} fallback")
        worst = [max(times[i] for times in every) for i in range(len(WAYS))]
        if not final and max(worst) < DECISIVE * min(worst):
            return
        self.agreed_seconds = worst
        self.decision = "compressed" if worst[0] < worst[1] else "exact"
        self.where = self._layout(group, topology)
        self._layout_checked = True
        if dist.get_rank(group) == 0:
            log.info("commpress fallback: bucket %s (%d elements, %d ranks, %d per node): "
                     "compressed %.3f ms, exact %.3f ms (slowest rank's medians) -> %s",
                     self.what, numel, *self.where, 1e3 * worst[0], 1e3 * worst[1],
                     self.decision)

    def state_dict(self) -> dict[str, Any]:
        """The decision, the group's times and layout it was made for, and this rank's
        times so far (a run saved while measuring goes on where it stopped)."""
        return {"decision": self.decision, "seconds": self.agreed_seconds, "where": self.where,
                "measured": {way: list(times) for way, times in self.seconds.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = {"decision", "seconds", "where", "measured"}
        if (not isinstance(state, dict) or set(state) != keys
                or state["decision"] not in (None, *WAYS)
                or not isinstance(state["measured"], dict) or set(state["measured"]) != set(WAYS)):
            raise InputError(f"fallback state of bucket {self.what}: {state!r} is not "
                             "allowed; allowed: what MeasuredChoice.state_dict() saved")
        self.decision, self.agreed_seconds = state["decision"], state["seconds"]
        self.where = state["where"]
        self._layout_checked = False
        self.seconds = {way: [float(t) for t in state["measured"][way]] for way in WAYS}


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its seconds, to its end on the device."""
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if on_cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def tally(choices: Iterable[MeasuredChoice]) -> dict[str, dict[str, int]]:
    """How many buckets' collectives went each way, by collective (``dp.grad``,
    ``dp.param``, …): ``{"compressed": n, "exact": m, "measuring": k}``."""
    out: dict[str, dict[str, int]] = {}
    for choice in choices:
        row = out.setdefault(choice.what, {"compressed": 0, "exact": 0, "measuring": 0})
        row[choice.decision or "measuring"] += 1
    return out
