"""Rank functions for the sub-groups a group owns (commpress.collectives.subgroups)."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from commpress.collectives import subgroups

TIMEOUT_S = 1.0
ABSENT_S = 6.0  # how long the absent rank stays away: far past the timeout


def make_without_one_member(rank, world):
    """Every rank but the last makes a sub-group of all ranks with a 1 s timeout; the last
    never comes. Returns how long the making took and what it raised."""
    if rank == world - 1:
        time.sleep(ABSENT_S)
        return None
    store = subgroups.store_client()
    t0 = time.monotonic()
    try:
        subgroups.make("world", subgroups.next_incarnation("world"), "test",
                       list(range(world)), "gloo", timedelta(seconds=TIMEOUT_S), store)
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"waited": time.monotonic() - t0, "error": error}


def make_and_use(rank, world):
    """Every rank makes a sub-group of all ranks, the last one 2 s late (within the
    timeout), and sums over it: the late member connects, the sum is exact."""
    if rank == world - 1:
        time.sleep(2.0)
    group = subgroups.make("world", subgroups.next_incarnation("world"), "test",
                           list(range(world)), "gloo", timedelta(seconds=30),
                           subgroups.store_client())
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=group)
    subgroups.destroy([group])
    return x.item()
