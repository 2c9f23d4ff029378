"""Rank functions for the replay tests: a front-end's repeated calls without headers, and
ranks whose calls part ways while the others replay."""

import time

import torch
import torch.distributed as dist

import commpress
from commpress.collectives.agreement import agree, allow_replay
from commpress.collectives.group_context import context, replayable
from commpress.collectives.mismatch import CollectiveMismatchError, CollectiveTimeoutError

SIZES = {"a": 64, "b": 96, "c": 40}


def _step(rank, sizes, spec, async_b=False, between=None, before_b=None):
    """One step of a front-end: calls ``a``, ``b``, ``c`` of the given sizes (``b`` may
    be left in flight), ``before_b()`` and ``between()`` before and after ``b``; returns
    their results."""
    out = {}
    handles = {}
    for key, numel in sizes.items():
        if key == "b" and before_b is not None:
            before_b()
        x = torch.arange(numel, dtype=torch.float32) + 1000 * rank
        with replayable(key):
            if spec == "two levels":  # transfers on the node-level sub-groups
                h = commpress.hierarchical_all_reduce(
                    x, intra="none", inter="int8", topology=commpress.Topology(2), op="sum",
                    label=f"step.{key}", async_op=async_b and key == "b")
            else:
                h = commpress.all_reduce(x, spec, op="sum", label=f"step.{key}",
                                         async_op=async_b and key == "b")
        handles[key] = h
        out[key] = x
        if key == "b" and between is not None:
            between()
    for h in handles.values():
        if not isinstance(h, torch.Tensor):
            h.wait()
    return out


def replayed_steps(rank, world, spec, steps=4):
    """Steps of three calls on a replaying group: the headers each step carries and the
    results, which equal the sums of every rank's inputs."""
    allow_replay(None)
    ctx = context(dist.group.WORLD)
    headers = []
    for _ in range(steps):
        seq, replayed = ctx._seq, ctx.replayed
        out = _step(rank, SIZES, spec)
        headers.append((ctx._seq - seq) - (ctx.replayed - replayed))
    want = {k: sum(torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world))
            for k, n in SIZES.items()}
    return {"headers": headers,
            "exact": all(torch.equal(out[k], want[k]) for k in SIZES) if spec == "none"
            else None,
            "close": all(torch.allclose(out[k], want[k], rtol=0.05, atol=50) for k in SIZES)}


def change_alike(rank, world):
    """Every rank changes call ``b``'s size at step 2: a header again, no error, and the
    new call replays from the step after."""
    allow_replay(None)
    ctx = context(dist.group.WORLD)
    headers = []
    for step in range(4):
        sizes = dict(SIZES, b=128) if step >= 2 else SIZES
        seq, replayed = ctx._seq, ctx.replayed
        out = _step(rank, sizes, "none")
        headers.append((ctx._seq - seq) - (ctx.replayed - replayed))
    want = sum(torch.arange(128, dtype=torch.float32) + 1000 * r for r in range(world))
    return {"headers": headers, "b": torch.equal(out["b"], want)}


def part_ways(rank, world, how, spec="int8"):
    """Two agreed steps, then rank 1 alone parts ways in step 3 while the others replay:
    ``size`` (its call ``b`` is bigger), ``extra`` (it makes an unreplayable call before
    ``b``), ``size, then a header`` (``b`` bigger; the others leave their ``b`` in flight
    and go on to a header of their own). Each rank's error, how long it took, and what
    a call after it meets."""
    allow_replay(None)
    for _ in range(2):
        _step(rank, SIZES, spec, async_b=True)
    sizes, between, before_b = SIZES, None, None
    if how.startswith("size") and rank == 1:
        sizes = dict(SIZES, b=200)
    if how == "extra" and rank == 1:
        before_b = lambda: agree(None, "probe", label="one rank alone")  # noqa: E731
    if how == "size, then a header":
        between = lambda: agree(None, "probe", label="after b")  # noqa: E731
    start = time.monotonic()
    try:
        _step(rank, sizes, spec, async_b=True, between=between, before_b=before_b)
        error = None
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    try:  # the group takes no more calls once a rank parted ways
        agree(None, "after", label="after")
        after = None
    except CollectiveMismatchError as e:
        after = str(e)
    return {"error": error, "seconds": seconds, "after": after}


def plain_mismatch_then_go_on(rank, world):
    """Two replayed steps, then a header mismatch at one call number (rank 1 passes
    another label): every rank raises, and the group goes on working — steps replay
    again."""
    allow_replay(None)
    ctx = context(dist.group.WORLD)
    for _ in range(2):
        _step(rank, SIZES, "none")
    try:
        agree(None, "probe", label=f"rank {min(rank, 1)}")
        error = None
    except CollectiveMismatchError as e:
        error = str(e)
    replayed = ctx.replayed
    out = _step(rank, SIZES, "none")
    want = sum(torch.arange(96, dtype=torch.float32) + 1000 * r for r in range(world))
    return {"error": error, "replayed after": ctx.replayed - replayed,
            "b": torch.equal(out["b"], want)}
