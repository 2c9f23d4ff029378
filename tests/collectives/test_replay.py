"""A front-end's repeated calls replay without a header once every rank agreed them, and
a rank that parts ways while the others replay is named on every rank within seconds —
never a hang, never Gloo's abort on a header meeting a payload."""

import pytest

from commpress.launch import spawn
from tests.collectives import replay_workers as workers


@pytest.mark.parametrize("spec", ["none", "int8"])
def test_after_the_first_step_only_the_step_start_carries_a_header(spec):
    for r in spawn(workers.replayed_steps, 3, (spec,), timeout=120):
        # step 1 agrees every call; then only the call that starts a step has a header
        assert r["headers"] == [3, 1, 1, 1], r
        assert r["close"], r
        assert r["exact"] in (None, True), r  # exact calls: the exact sums


def test_a_change_every_rank_makes_alike_is_agreed_not_an_error():
    for r in spawn(workers.change_alike, 2, timeout=120):
        # step 3 ("b" grew on every rank) agrees "b" again; step 4 replays it
        assert r["headers"] == [3, 1, 2, 1] and r["b"], r


@pytest.mark.parametrize("how", ["size", "extra", "size, then a header"])
def test_a_rank_that_parts_ways_alone_is_named_on_every_rank_within_seconds(how):
    ranks = spawn(workers.part_ways, 3, (how,), timeout=120, pg_timeout_s=60)
    for r in ranks:
        assert r["error"] is not None and "CollectiveMismatchError" in r["error"], r
        assert "ranks disagree" in r["error"], r
        assert r["seconds"] < 20, r  # found by the peers' notes, not the 60 s timeout
        assert r["after"] is not None and "ranks disagree" in r["after"], r
    if how == "size":  # the fields that differ are named, with rank 1's value
        assert "tensor.numel differs (rank 1: 200; the others: 96)" in ranks[0]["error"]
    if how != "size, then a header":  # one message, left by the rank that saw it (there,
        # the headers met, each rank naming its own call, as any header mismatch does)
        assert len({r["error"] for r in ranks}) == 1


def test_a_rank_that_parts_ways_alone_in_a_two_level_collective_is_named_too():
    # the others wait in transfers on the node-level sub-groups, which look at the notes
    # of the group that made them
    ranks = spawn(workers.part_ways, 4, ("size", "two levels"), ranks_per_node=2,
                  timeout=120, pg_timeout_s=60)
    for r in ranks:
        assert r["error"] is not None and "CollectiveMismatchError" in r["error"], r
        assert "tensor.numel differs (rank 1: 200; the others: 96)" in r["error"], r
        assert r["seconds"] < 20 and r["after"] is not None, r


def test_a_header_mismatch_at_one_call_number_leaves_a_replaying_group_usable():
    for r in spawn(workers.plain_mismatch_then_go_on, 3, timeout=120):
        assert r["error"] is not None and "label differs" in r["error"], r
        assert r["replayed after"] == 2 and r["b"], r  # b and c replayed, sums exact
