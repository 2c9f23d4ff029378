"""Ranks that send each other on the same tag in one batch (a pipeline stage exchanging
with its neighbour): every transfer arrives whole and in order, and a size mismatch
raises on both sides — Gloo never aborts and nothing hangs."""

import pytest

from commpress.launch import spawn
from tests.collectives import p2p_exchange_workers as workers

# a hang must fail the test within seconds, not wait out Gloo's default
PG_TIMEOUT_S = 20


def _failed(results: list[dict]) -> list:
    return [(rank, case) for rank, r in enumerate(results) for case, ok in r.items() if not ok]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(workers.two_ranks, 2, pg_timeout_s=PG_TIMEOUT_S, timeout=120)


def test_two_ranks_exchange_on_one_tag_call_after_call(two_ranks):
    results = [r["exchange"] for r in two_ranks]
    assert len(results[0]) == len(workers.CODECS) * len(workers.TAGS) * len(workers.SIZES)
    assert not _failed(results)


def test_two_transfers_each_way_in_one_batch_match_in_order(two_ranks):
    assert not _failed([r["two_each_way"] for r in two_ranks])


@pytest.mark.parametrize("case", workers.MISMATCHES)
def test_an_exchange_that_disagrees_raises_on_both_sides(two_ranks, case):
    for rank, r in enumerate(two_ranks):
        outcomes, untouched, right_after = r["mismatch"][case]
        errors = [o for o in outcomes if o != "ok"]
        assert errors, (rank, outcomes)
        assert all("ranks disagree" in e and "numel differs" in e for e in errors), errors
        refused = case == "both expect more" or rank == 1
        # a refused receive leaves the tensor as it was
        assert untouched == refused, (rank, outcomes)
        # the tag's traffic was drained: the next exchange on it is right
        assert right_after, (rank, outcomes)


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_a_ring_sends_both_ways_at_once_on_one_tag(world):
    results = spawn(workers.ring_both_ways, world, pg_timeout_s=PG_TIMEOUT_S, timeout=90)
    assert len(results[0]) == 3 * len(workers.CODECS)
    assert not _failed(results)
