"""Collectives in flight from several threads, each on its own group over the same ranks,
are as safe as torch's own: every thread gets, bit for bit, what it gets alone, and
nothing hangs. (When the node levels' sub-groups were shared by rank set, two threads'
payloads paired in a different order on different ranks: wrong sums, then a deadlock.)"""

import pytest

from commpress.launch import spawn
from tests.collectives import concurrency_workers as workers


@pytest.mark.parametrize("world, ranks_per_node, threads", [
    (4, 2, 2), pytest.param(8, 4, 3, marks=pytest.mark.slow)])
def test_threads_on_groups_of_the_same_ranks_get_what_they_get_alone(world, ranks_per_node,
                                                                     threads):
    ranks = spawn(workers.threads_on_groups_of_the_same_ranks, world,
                  (threads, 4, ranks_per_node, 4008), ranks_per_node=ranks_per_node,
                  timeout=180, pg_timeout_s=60)
    for r in ranks:
        assert r["errors"] == [] and r["same"], r
