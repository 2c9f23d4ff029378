"""How runs are started and ended: one process group per launch, bounded waits,
refusals before work, and an exit status that says whether anything was trained."""

from commpress.launch import spawn
from tests.train import orchestration_workers as workers


def test_sub_groups_wait_no_longer_than_the_launch_timeout():
    # torch gives a new group its backend's default timeout (30 min on Gloo); the mesh's
    # and the node levels' groups must fail as soon as the default group would
    waited = spawn(workers.wait_in_sub_groups, 4, (), timeout=60)[0]
    assert all(s < 3 * workers.TIMEOUT_S for s in waited.values()), waited
