"""A sub-group is connected within its timeout: a member that never comes is an error
after the timeout, not a wait as long as the member stays away (Gloo's lazy connect
alone ignores the timeout), and a member that comes late but in time is waited for."""

from commpress.launch import spawn
from tests.collectives import subgroups_workers as workers


def test_a_member_that_never_comes_fails_the_making_within_the_timeout():
    ranks = spawn(workers.make_without_one_member, 3, (), timeout=60)
    for r in ranks[:-1]:
        assert r["waited"] < 3 * workers.TIMEOUT_S, r
        assert "did not all connect within its timeout of 1 s" in r["error"], r
        assert "global ranks [0, 1, 2]" in r["error"], r


def test_a_member_late_within_the_timeout_is_waited_for():
    assert spawn(workers.make_and_use, 3, (), timeout=60) == [3.0, 3.0, 3.0]
