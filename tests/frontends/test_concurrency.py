"""Front-ends side by side, their collectives in flight at once on groups of the same
ranks (two-level policies: the node sub-groups too): every model trains exactly as it
does alone, bit for bit, and its replicas stay identical. (With node sub-groups shared
by rank set, two Streaming DiLoCo synchronizers left θ_global different across ranks.)"""

import pytest

from commpress.launch import spawn
from tests.frontends import concurrency_workers as workers

WORLD = 4


def _run(entries, steps):
    return spawn(workers.side_by_side, WORLD, (entries, steps),
                 ranks_per_node=workers.RANKS_PER_NODE, timeout=300, pg_timeout_s=60)


@pytest.mark.parametrize("entries", [
    [("streaming", 0), ("streaming", 1)],                 # two synchronizers' threads
    pytest.param([("ddp", 0), ("streaming", 1)],          # a hook's thread and DiLoCo's
                 marks=pytest.mark.slow),
    pytest.param([("sharded", 0), ("ddp", 1)],            # overlapped backward + a hook
                 marks=pytest.mark.slow),
    pytest.param([("ddp", 0), ("ddp", 1), ("diloco", 2)],  # two models' hooks, and DiLoCo
                 marks=pytest.mark.slow),
])
def test_front_ends_side_by_side_train_as_they_do_alone(entries):
    steps = 5
    together = _run(entries, steps)
    for i, entry in enumerate(entries):
        alone = _run([entry], steps)
        for rank in range(WORLD):
            assert together[rank][i] == alone[0][0], (entry, rank)
