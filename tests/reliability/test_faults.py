"""Faults: a killed rank, NaN gradients — errors, never hangs or silent corruption."""

import pytest

from commpress.launch import spawn
from tests.reliability import workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank

PG_TIMEOUT = 15.0


def test_a_killed_rank_makes_every_other_rank_fail_fast():
    results = spawn(workers.killed_mid_step, 3, (1,), pg_timeout_s=PG_TIMEOUT, timeout=120,
                    allow_errors=True)
    assert_survivors_name_the_dead_rank(results, victim=1, timeout_s=PG_TIMEOUT)


def test_nan_gradient_skips_the_step_on_every_rank():
    results = spawn(workers.nonfinite_gradient, 3, ("skip",), ranks_per_node=3)
    for r in results:
        assert r["finite"] and r["skipped"] == 1 and r["outcome"] == "ok"
        assert [s for s, _ in r["hashes"]] == [True, True, False, True]
        # the skipped step left the weights exactly as they were
        assert r["hashes"][2][1] == r["hashes"][1][1]
    for step in range(4):
        assert len({r["hashes"][step][1] for r in results}) == 1


def test_nan_gradient_raises_on_every_rank_when_asked():
    results = spawn(workers.nonfinite_gradient, 2, ("raise",))
    for r in results:
        assert r["outcome"].startswith("raised: ShardedOptimizer step 2: the global gradient "
                                       "norm is nan")
        assert r["finite"]


@pytest.mark.slow
def test_a_rank_killed_in_a_guard_decision_leaves_no_codec_half_promoted():
    results = spawn(workers.killed_in_a_guard_decision, 3, (2,), pg_timeout_s=PG_TIMEOUT,
                    timeout=120, allow_errors=True)
    assert_survivors_name_the_dead_rank(results, victim=2, timeout_s=PG_TIMEOUT)
    survivors = [r for r in results if isinstance(r, dict)]
    assert len(survivors) == 2
    # the decision every bucket's promotion hung on was taken by no one: a decision is
    # read from every rank's signals, so a survivor never promotes on its own
    for r in survivors:
        assert r["events"] == [] and set(r["codecs"]) == {"int2:hadamard=0"}, r
