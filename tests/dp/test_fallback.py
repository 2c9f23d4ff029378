"""The measured fallback: each bucket's collective times both ways on the live group,
the ranks decide alike, the decision is kept and restored, and training stays exact
across replicas whichever way each bucket goes."""

import pytest

from commpress.dp.fallback import SAMPLES, WARMUP
from commpress.launch import spawn
from commpress.train.config import TrainConfig
from tests.dp import fallback_workers as workers

CALLS = 2 * (WARMUP + SAMPLES)
CLEAR_CASE_CALLS = 2 * (WARMUP + 1)


def _measuring(ways):
    """The real calls' ways and the probes' ways of a choice's measuring calls."""
    return ([w for w, _, probe in ways if not probe], [w for w, _, probe in ways if probe])


def test_ranks_measure_on_probes_then_decide_by_the_slowest_rank():
    """Rank 1 is slow when compressing (30 ms against 10 ms exact); rank 0 is fast (1 ms):
    both decide exact, since every rank waits for the slowest — a clear case (3x), decided
    after one timed call each way. Until then every real call is the preset's (compressed)
    and the exact way runs as a probe on scratch copies beside every second one; measuring
    calls run synchronously; after the decision the call keeps its async_op."""
    ranks = spawn(workers.timed_choice, 2, ([1, 30], [10, 10]))
    for r in ranks:
        real, probes = _measuring(r["ways"])
        assert real == ["compressed"] * CLEAR_CASE_CALLS
        assert probes == ["exact"] * (CLEAR_CASE_CALLS // 2)
        assert all(not async_op for _, async_op, _ in r["ways"])  # timed to their end
        assert r["state"]["decision"] == "exact"
        assert r["state"]["seconds"][0] >= 0.030 > r["state"]["seconds"][1]
        assert r["after"] == ("exact", False)  # async from now on: the caller waits
        assert r["resumed"] == [("exact", False, False)]  # a loaded decision measures nothing
        assert "decided 'exact' on 2 ranks of 2 per node" in r["other layout"]
    agreed = [{k: r["state"][k] for k in ("decision", "seconds", "where")} for r in ranks]
    assert agreed[0] == agreed[1]  # each rank's own times ("measured") are its own


def test_a_faster_compressed_way_is_kept():
    ranks = spawn(workers.timed_choice, 2, ([5, 5], [20, 25]))
    assert all(r["state"]["decision"] == "compressed" for r in ranks)
    assert ranks[0]["state"]["seconds"][1] >= 0.025


def test_a_close_case_takes_every_sample_before_deciding():
    """12 ms compressed against 16 ms exact: under the clear-case ratio, so all samples
    are taken; compressed is kept."""
    ranks = spawn(workers.timed_choice, 2, ([12, 12], [16, 16]))
    for r in ranks:
        real, probes = _measuring(r["ways"])
        assert (len(real), len(probes)) == (CALLS, CALLS // 2)
        assert r["state"]["decision"] == "compressed"


def test_sharded_optimizer_buckets_decide_alike_and_resume_their_decisions(tmp_path):
    """zeropp (int8 gradients, 4-bit weights, two choices per bucket) on 2 ranks: after 10
    steps every bucket has decided both, the same on both ranks; the replicas hold the
    same bits; a new optimizer loading the state keeps the decisions and the samples they
    rest on, and measures no more."""
    ranks = spawn(workers.sharded_with_fallback, 2, ("zeropp", 10, str(tmp_path), False))
    first = ranks[0]["choices"]
    assert first and all(set(c) == {"grad", "param"} for c in first)
    assert all(decision in ("compressed", "exact")
               for c in first for decision, _, _ in c.values())
    assert [{w: v[:2] for w, v in c.items()} for c in first] == [
        {w: v[:2] for w, v in c.items()} for c in ranks[1]["choices"]]
    assert ranks[0]["hash"] == ranks[1]["hash"]
    resumed = spawn(workers.sharded_with_fallback, 2, ("zeropp", 2, str(tmp_path), True))
    for before, after in zip(ranks, resumed, strict=True):
        assert [{w: v[:2] for w, v in c.items()} for c in after["choices"]] == [
            {w: v[:2] for w, v in c.items()} for c in before["choices"]]
        # the samples it had, and no more: a loaded decision measures nothing
        assert [[v[2] for v in c.values()] for c in after["choices"]] == [
            [v[2] for v in c.values()] for c in before["choices"]]
    assert resumed[0]["hash"] == resumed[1]["hash"]


def test_ddp_hook_buckets_decide_alike():
    ranks = spawn(workers.ddp_with_fallback, 2, (10,))
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert all(d in ("compressed", "exact") for d in ranks[0]["decisions"])
    assert ranks[0]["hash"] == ranks[1]["hash"]


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(fallback="sometimes"), "fallback='sometimes' is not allowed; allowed: off, measured"),
])
def test_the_trainer_names_a_bad_fallback(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**kwargs)


def test_simulate_refuses_a_measured_fallback():
    """Played ranks have no links to time: refused by name before anything runs."""
    from commpress.train.run import Run

    cfg = TrainConfig(policy="zeropp", fallback="measured", model="gpt-tiny", seq_len=32,
                      nproc=2, max_data_bytes=100_000).resolved()
    with pytest.raises(ValueError, match="fallback=measured times the collectives on the "
                                         "live links"):
        Run(cfg, played=True)


def test_the_trainer_resolves_the_policy_with_its_fallback():
    cfg = TrainConfig(policy="sdp4bit", fallback="measured")
    assert cfg.policy_object().fallback == "measured"
    assert cfg.policy_object().to_dict()["fallback"] == "measured"
    assert TrainConfig(policy="sdp4bit").policy_object().fallback == "off"


def test_diloco_fragments_decide_alike_and_the_sites_stay_identical():
    ranks = spawn(workers.diloco_with_fallback, 2, (20,))
    assert ranks[0]["syncs"] == 10  # 8 measuring syncs, then decided
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert all(d in ("compressed", "exact") for d in ranks[0]["decisions"])
    assert ranks[0]["global"] == ranks[1]["global"]


def test_while_it_measures_the_run_is_the_presets_bit_for_bit():
    """The exact way runs only as a probe on scratch copies: through its first 3 steps (no
    bucket decides before 4 calls of each collective) a measured int2ef-like run holds the
    preset's weights, bit for bit, with its error-feedback memory and rounding state."""
    policy = {"name": "ef", "dp": {"grad": {"codec": "int4:rounding=stochastic",
                                            "error_feedback": True},
                                   "param": {"codec": "int4:group=2048", "delta": True}}}
    ranks = spawn(workers.measuring_is_the_preset, 2, (policy, 3))
    for r in ranks:
        assert r["measured"] == r["preset"]
