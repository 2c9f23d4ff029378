"""Parameters frozen, unfrozen, added or replaced mid-run: the DDP hook and the sharded
optimizer keep every replica identical or refuse by name, on every rank, with the way
that works — never a silent divergence (stock DDP lets an unfrozen parameter drift apart
on each rank; a frozen one kept moving in the sharded optimizer's flat buckets)."""

import pytest

from commpress.launch import spawn
from tests.frontends import parameter_set_workers as workers

AFTER = workers.CHANGE_AFTER


def _run(front_end, change):
    return spawn(workers.changed_mid_run, 2, (front_end, change), timeout=300,
                 pg_timeout_s=30)


@pytest.mark.parametrize("front_end, change, needle", [
    ("ddp", "unfreeze", "1 parameters require gradients but did not when DDP was built "
                        "(wte.weight)"),
    ("sharded", "freeze", "1 of its parameters no longer require gradients "
                          "(blocks.1.mlp.fc.weight)"),
    ("sharded", "unfreeze", "require gradients but are not among those it was built over "
                            "(wte.weight: unfrozen"),
    ("sharded", "assign", "require gradients but are not among those it was built over"),
    ("sharded", "add", "add_param_group is not supported"),
])
def test_a_change_the_front_end_cannot_follow_is_refused_on_every_rank(front_end, change,
                                                                       needle):
    ranks = _run(front_end, change)
    for r in ranks:
        assert r["error"] is not None and needle in r["error"], r["error"]
        # refused at the change (add_param_group) or at the very next step: none trained
        assert len(r["hashes"]) == AFTER + (change != "add")
    assert ranks[0]["hashes"] == ranks[1]["hashes"]
    if change != "add":
        assert "parameter group of their own" in ranks[0]["error"]  # the way that works


@pytest.mark.parametrize("front_end, change", [("ddp", "freeze"), ("sharded", "hold still")])
def test_a_parameter_held_still_stays_put_and_replicas_identical(front_end, change):
    ranks = _run(front_end, change)
    for r in ranks:
        assert r["error"] is None
        held = [h["held"] for h in r["hashes"][AFTER:]]
        assert len(set(held)) == 1  # not moved once held still (no momentum, no decay)
        assert r["hashes"][-1]["all"] != r["hashes"][AFTER]["all"]  # the rest trains
    assert ranks[0]["hashes"] == ranks[1]["hashes"]


@pytest.mark.parametrize("front_end, change", [("ddp", "unfreeze@0"), ("sharded", "freeze@0")])
def test_a_change_on_one_rank_alone_is_told_to_the_others_not_waited_for(front_end, change):
    # the rank that refuses tells the others at their next collective: they fail there
    # with a mismatch naming its refusal, within seconds, instead of waiting for it (in
    # the sharded optimizer the frozen bucket is already late in backward: the ranks'
    # reduce-scatters disagree first, and say so)
    ranks = _run(front_end, change)
    for r in ranks:
        assert "CollectiveMismatchError" in r["error"], r
        if front_end == "ddp":
            assert "refused differs" in r["error"] and "require gradients" in r["error"], r
        else:  # the bucket without the frozen parameter has other sizes on rank 0
            assert "reduce_scatter: ranks disagree" in r["error"], r
            assert "numel differs" in r["error"], r
