"""PowerSGD with quantized factors (``lowrank_hook``) on real Gloo ranks: two ranks on
two nodes (one rank each), so the factors cross the "link" as int8 codes."""

import pytest
import torch

from commpress.frontends.ddp_lowrank import LowRankConfig, update_is_finite
from commpress.launch import spawn
from commpress.validate import InputError
from tests.frontends import lowrank_workers

PG_TIMEOUT_S = 30.0


def _spawn(fn, *args):
    return spawn(fn, 2, args, ranks_per_node=1, pg_timeout_s=PG_TIMEOUT_S, timeout=300)


SLOW = pytest.mark.slow  # the variants; the first of each test runs by default


@pytest.mark.parametrize("options", [{"factor_codec": "int8"},
                                     pytest.param({"factor_codec": "int4"}, marks=SLOW),
                                     pytest.param({"alternate": True}, marks=SLOW)])
def test_replicas_stay_bitwise_identical_and_train(options):
    ranks = _spawn(lowrank_workers.train, 6, options)
    for a, b in zip(*ranks):
        assert a["params"] == b["params"] and a["grads"] == b["grads"]
        assert a["finite"]
    losses = [s["loss"] for s in ranks[0]]
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow
def test_int8_factors_keep_a_steep_spectrum_as_fp32_factors_do():
    """Each factor column is its own codec group: the weak directions of a steep spectrum
    are not rounded on the scale of the strong ones (laid out row by row, int8 factors
    stalled at about 3× fp32's approximation error)."""
    exact, int8 = (_spawn(lowrank_workers.approximation_error, c)[0]["errors"]
                   for c in ("none", "int8"))
    assert exact[-1] < 0.5 * exact[0]  # the power steps converge
    assert int8[-1] < 1.1 * exact[-1], (int8, exact)


def test_int8_factors_keep_every_direction_of_a_spectrum_five_decades_steep():
    """``Q`` is orthogonalized before ``P = M Q``: its columns scale with the singular
    values, and a weak column's int8 rounding along a strong direction, multiplied by
    ``M``, swamped that column of ``P`` (with ``Q`` as sent, the weakest of the 16
    directions was not spanned at all: 0.00 of it)."""
    for codec in ("none", "int8"):
        captured = _spawn(lowrank_workers.approximation_error, codec, 8, 5)[0]["captured"]
        assert min(captured) > 0.95, (codec, captured)


def test_the_memory_keeps_no_difference_between_ranks_and_remembers_the_rounding():
    """Ranks whose gradients differ from the average by a fixed ``± D``, 12 steps: each
    rank's memory keeps nothing inside the subspace it sent and nothing of the vectors
    (PowerSGD's ``M − P Q̂ᵀ`` kept 12 × D of the vectors, and a quarter of the matrix
    memory's norm inside ``P``); the vectors' int8 rounding is remembered by the codec,
    so their averages summed over the steps stay within one int8 step of the true sum
    (5.3 steps off with PowerSGD's memory, whose growth sets the codes' scale; 4.8
    without the codec's memory)."""
    for codec in ("none", "int8"):
        for r in _spawn(lowrank_workers.memory_after_fixed_differences, codec):
            assert r["vector"] == 0.0, (codec, r)
            assert r["inside"] < 1e-5, (codec, r)
            assert r["drift"] < 1.0, (codec, r)


@pytest.mark.parametrize("options, warm", [({}, 0),
                                           pytest.param({"alternate": True}, 0, marks=SLOW),
                                           pytest.param({"alternate": True}, 1, marks=SLOW)])
def test_bytes_per_step_match_the_factor_formula(options, warm):
    ranks = _spawn(lowrank_workers.wire_bytes, options, warm)
    for r in ranks:
        # per hook bucket one int8 packet per exchange: P with the vectors, then Q (or,
        # alternating, P or Q with the vectors)
        assert r["counted"] == r["expected"]
    n_pq = ranks[0]["elements"]
    # the factors are a small fraction of the gradient, at 8.25 bits instead of 32
    assert n_pq < ranks[0]["numel"] / 3
    assert ranks[0]["counted"] < 0.3 * 4 * n_pq


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, pytest.param({"alternate": True}, marks=SLOW)])
def test_state_dict_round_trip_resumes_bit_for_bit(options):
    ranks = _spawn(lowrank_workers.resume, options)
    for r in ranks:
        assert [s["params"] for s in r["straight"]] == [s["params"] for s in r["resumed"]]
        assert "DDP hook checkpoint lowrank.rank" in r["refused"]
        assert "does not match" in r["refused"]


@pytest.mark.slow
def test_a_non_finite_gradient_stays_non_finite_and_does_not_poison_the_memory():
    ranks = _spawn(lowrank_workers.train, 5, None, (2, 1))  # rank 1's loss is NaN at step 2
    for r in ranks:
        assert [s["finite"] for s in r] == [True, True, False, True, True]
    for a, b in zip(*ranks):
        assert a["params"] == b["params"] and a["grads"] == b["grads"]


@pytest.mark.parametrize("field, value", [("rank", 0), ("rank", True), ("start_iter", -1),
                                          ("start_iter", True), ("seed", 1.5),
                                          ("seed", 2**70), ("seed", -1), ("alternate", "no"),
                                          ("min_compression_rate", 0.5),
                                          ("min_compression_rate", float("nan")),
                                          ("factor_codec", "int7")])
def test_bad_options_are_refused_naming_the_field(field, value):
    with pytest.raises(InputError, match=field if field != "factor_codec" else "int7") as e:
        LowRankConfig(**{field: value})
    assert "allowed" in str(e.value)


def _factors(p_scale=1.0, q_scale=1.0):
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(6, 2, generator=g) * p_scale, torch.randn(5, 2, generator=g) * q_scale
    vectors = torch.randn(3, generator=g)
    return torch.cat([(p @ q.t()).reshape(-1), vectors]), [p], [q], vectors


@pytest.mark.parametrize("case, finite", [("plain", True), ("nan_p", False), ("inf_q", False),
                                          ("nan_vector", False), ("overflow", False),
                                          ("large_but_finite", True)])
def test_update_is_finite_agrees_with_a_scan_of_the_whole_result(case, finite):
    scales = {"overflow": (1e20, 1e20), "large_but_finite": (1e18, 1e18)}.get(case, (1, 1))
    result, ps, qs, vectors = _factors(*scales)
    if case == "nan_p":
        ps[0][1, 0] = float("nan")
    elif case == "inf_q":
        qs[0][0, 1] = float("inf")
    elif case == "nan_vector":
        vectors[1] = float("nan")
    if case in ("nan_p", "inf_q", "nan_vector"):  # the result as the hook builds it
        result = torch.cat([(ps[0] @ qs[0].t()).reshape(-1), vectors])
    assert bool(torch.isfinite(result).all()) is finite  # the case is what it claims
    assert update_is_finite(result, [2], ps, qs, vectors) is finite


@pytest.mark.parametrize("hook", ["lowrank", pytest.param("int2ef", marks=SLOW)])
def test_ranks_with_other_seeds_steps_or_swapped_states_are_refused(hook):
    """A per-rank seed or a rank resumed from another step's state would let ``alternate``
    multiply by unaveraged factors (replicas drifted by ~1e-3, silently); a state loaded
    on another rank would apply that rank's memory. Each is refused; each rank's own state
    resumes."""
    ranks = _spawn(lowrank_workers.disagreeing_states, hook)
    for r in ranks:
        if hook == "lowrank":
            assert "CollectiveMismatchError" in r["seed"] and "seed differs" in r["seed"]
            assert "iter differs" in r["steps"], r["steps"]
        else:  # int2ef's memory is each rank's own; its step counter is not agreed on
            assert r["steps"] is None
        # refused on every rank together, with the first refusing rank's reason
        assert "InputError" in r["swapped"] and "checkpoint rank" in r["swapped"]
        assert "does not match this run's 0" in r["swapped"] and "refused it" in r["swapped"]
        assert r["own"] is None
