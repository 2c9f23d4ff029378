"""Ranks that disagree on any call — not only the first — get an error naming them,
on every rank, before any payload moves; a rank that never comes is named."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commpress.launch import spawn
from tests.collectives import agreement_workers as workers

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "hierarchical_all_reduce",
               "hierarchical_reduce_scatter"]


def test_a_later_call_that_disagrees_raises_on_every_rank():
    cases = [(c, f) for c in COLLECTIVES for f in ("numel", "dtype", "codec")]
    ranks = spawn(workers.later_calls_disagree, 4, (cases,), ranks_per_node=2, timeout=240)
    for r in ranks:
        assert len(r) == 3 * len(cases)
        for k, (collective, field) in enumerate(cases):
            first, second, third = r[3 * k: 3 * k + 3]
            assert first == second == "ok", (collective, field, r[3 * k: 3 * k + 3])
            assert f"commpress.{collective}: ranks disagree" in third, third
            # the field that differs and the rank holding the odd value are named; the
            # group still works for the next case
            name = "inter" if field == "codec" and collective.startswith("hier") else field
            assert f"{name} differs" in third and "rank 1:" in third, third


def test_a_skipped_call_is_caught_at_the_next_one():
    for m in spawn(workers.skipped_call, 3, timeout=60):
        assert "label differs (ranks [0, 1]: a; rank 2: b)" in m, m


@pytest.mark.parametrize("length", [600, 5000])
def test_long_labels_are_compared_in_full(length):
    for m in spawn(workers.long_labels, 2, (length,)):
        assert "label differs" in m, m[:300]


@pytest.mark.parametrize("field", ["codec", "numel", "dtype"])
def test_a_send_and_receive_that_disagree_raise_on_both_sides(field):
    sender, receiver = spawn(workers.p2p_disagrees, 2, (field,), timeout=60)
    for side in (sender, receiver):
        assert "ranks disagree" in side["first"] and "differs" in side["first"], side
    assert receiver["untouched"] and receiver["second_equal"], receiver


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_within_the_timeout():
    results = spawn(workers.one_rank_never_comes, 3, pg_timeout_s=4, timeout=60)
    assert results[2] == "absent"
    for r in results[:2]:
        assert r["error"] is not None and "ranks [2] never reached it" in r["error"], r
        assert r["seconds"] < 4 + 10, r


CALL = st.tuples(st.sampled_from(COLLECTIVES), st.integers(1, 700), st.integers(0, 1),
                 st.integers(0, 3),
                 st.lists(st.none() | st.tuples(st.just("numel"), st.integers(1, 5))
                          | st.tuples(st.just("dtype"), st.integers(0, 1))
                          | st.tuples(st.just("codec"), st.integers(0, 3)),
                          min_size=4, max_size=4))


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(CALL, min_size=10, max_size=10))
def test_fuzz_per_call_disagreement_never_returns_a_wrong_result(calls):
    ranks = spawn(workers.fuzz_calls, 4, (calls,), ranks_per_node=2, timeout=240)
    for i in range(len(calls)):
        kinds = {r[i][0] for r in ranks}
        # every rank raised, or none did
        assert len(kinds) == 1, (calls[i], [r[i] for r in ranks])
        if kinds == {"ok"}:
            for r in ranks:
                _, err, _, single = r[i]
                # agreed calls are right: within the codec's own error (two stages,
                # bf16 outputs round too)
                assert err <= 2.0 * single + 1e-2, (calls[i], err, single)
            if calls[i][0] in ("all_reduce", "all_gather", "hierarchical_all_reduce"):
                assert len({r[i][2] for r in ranks}) == 1, calls[i]


TRANSFER = st.tuples(st.integers(1, 500), st.integers(0, 1), st.integers(0, 3),
                     st.lists(st.none() | st.tuples(st.just("numel"), st.integers(1, 5))
                              | st.tuples(st.just("dtype"), st.integers(0, 1))
                              | st.tuples(st.just("codec"), st.integers(0, 3)),
                              min_size=3, max_size=3))


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transfers=st.lists(TRANSFER, min_size=8, max_size=8))
def test_fuzz_point_to_point_disagreement(transfers):
    ranks = spawn(workers.fuzz_p2p, 3, (transfers,), timeout=180)
    for i in range(len(transfers)):
        for r in range(3):
            send, _, _ = ranks[r][i]
            _, recv, good = ranks[(r + 1) % 3][i]
            # the sender learns of a refusal exactly when its receiver refused
            assert send == recv, (transfers[i], ranks[r][i], ranks[(r + 1) % 3][i])
            # a refused receive leaves the tensor untouched; an accepted one holds the
            # sender's decoded values
            assert good, (transfers[i], r)


@pytest.mark.slow
def test_agreement_cost_is_one_small_exchange():
    # the cost per call, measured (BENCHMARKS.md has the figure for this machine)
    for r in spawn(workers.agreement_cost, 4, (1 << 16, 20)):
        assert r["agree_s"] < r["all_reduce_s"], r


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
def test_one_rank_that_differs_in_a_mesh_is_told_to_every_rank(shape):
    # rank 0 alone differs: the ranks that share no group with it learn it from peers
    # whose groups failed (one round more for each dimension), and the groups still work
    world = 1
    for n in shape:
        world *= n
    for rank, (first, second) in enumerate(spawn(workers.mesh_disagreement, world,
                                                 (shape, 0), timeout=120)):
        assert "commpress.mesh: ranks disagree" in first, (rank, first)
        assert "value differs" in first or "other_groups_of_the_mesh differs" in first, first
        assert second == "ok"
