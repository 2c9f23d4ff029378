"""FSDP2 with compressed collectives: the codec state (error-feedback residuals,
stochastic-rounding counters) checkpoints with torch.distributed.checkpoint and a
resumed run continues bit for bit."""

import pytest

from commpress.launch import spawn
from tests.engines import fsdp_workers

TOTAL, SPLIT = 6, 3
# Two nodes of one rank each, so the cross-node codec runs. int2ef: exact inside a node, ternary
# codes with error feedback across (state: the residuals). The stochastic policy's
# state is its codecs' call counters, which select the rounding noise.
STOCHASTIC = {"name": "stochastic",
              "dp": {"grad": "int4:rounding=stochastic,seed=1",
                     "param": "int8:group=256,rounding=stochastic,seed=2"}}
POLICIES = ["int2ef", STOCHASTIC]


def _resume(tmp_path, policy, save_codecs=True):
    args = (policy, TOTAL, SPLIT, str(tmp_path / "ckpt"), save_codecs)
    first = spawn(fsdp_workers.fsdp_resume_run, 2, args, ranks_per_node=1)
    second = spawn(fsdp_workers.fsdp_resume_run, 2, args, ranks_per_node=1)
    full = [r["full"] for r in first]
    resumed = [{"losses": a["first"]["losses"] + b["second"]["losses"],
                "hash": b["second"]["hash"]} for a, b in zip(first, second)]
    return full, resumed


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES, ids=["int2ef", "stochastic"])
def test_fsdp_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path, policy):
    full, resumed = _resume(tmp_path, policy)
    assert resumed == full


def test_fsdp_codec_state_of_other_modules_or_another_policy_is_refused():
    (result,) = spawn(fsdp_workers.fsdp_codec_state_mismatch, 1, ("int2ef", "sdp4bit"))
    # keyed by the FSDP modules' fully-qualified names, the root's being ""
    assert result["modules"][:3] == ["", "blocks.0", "blocks.1"]
    message = result["errors"]["modules"]
    assert "saved for other FSDP modules" in message
    assert "this model's [] are not in it" in message
    assert "'blocks.0'" in message and "'blocks.1'" in message
    assert "FSDP codec checkpoint policy.name 'int2ef' does not match" in result["errors"]["policy"]
    assert "does not match this run's 'sdp4bit'" in result["errors"]["policy"]


def test_a_codec_state_of_the_other_rank_or_cut_short_is_refused_by_name():
    ranks = spawn(fsdp_workers.fsdp_codec_state_swapped_or_truncated, 2, ("int2ef",),
                  ranks_per_node=1)
    for rank, errors in enumerate(ranks):
        other = 1 - rank
        assert f"holds the state of ['rank{other}'], not this rank's ('rank{rank}')" in (
            errors["swapped"] or ""), errors
        assert (f"FSDP codec checkpoint rank {other} does not match this run's {rank}"
                in (errors["entry swapped"] or "")), errors
        assert f"the entry 'rank{rank}' cannot be read" in (errors["truncated"] or ""), errors
        assert "truncated or corrupt" in errors["truncated"]


@pytest.mark.slow
@pytest.mark.parametrize("layout, saved, resumed", [("fsdp", 4, 2), ("fsdp", 2, 4),
                                                    ("hsdp", 8, 4), ("hsdp", 4, 8)])
def test_an_elastic_resume_on_another_number_of_ranks_starts_the_codecs_fresh(tmp_path, saved,
                                                                              resumed, layout):
    """DCP reshards the model and the optimizer; the codec state of another world is refused
    (by commpress on fewer ranks, by DCP on more) unless loaded through ``comm.elastic()``,
    which then continues exactly as a run that saved no codec state would (fresh memory,
    nothing of the old world applied), said once. HSDP: 2 replicas of 4 shards or of 2,
    its replicate all-reduce's codec fresh too."""
    from tests.engines.hsdp_workers import hsdp_model

    build = (fsdp_workers.fsdp_model_of,) if layout == "fsdp" else (hsdp_model,)
    per_node = {"fsdp": lambda world: 1, "hsdp": lambda world: world // 2}[layout]
    ckpt = str(tmp_path / "ckpt")
    (at_save, *_) = spawn(fsdp_workers.fsdp_elastic, saved, ("int2ef", ckpt, "save", *build),
                          ranks_per_node=per_node(saved))
    ranks = spawn(fsdp_workers.fsdp_elastic, resumed, ("int2ef", ckpt, "load", *build),
                  ranks_per_node=per_node(resumed))
    for r in ranks:
        if resumed < saved:
            assert f"world_size {saved} does not match this run's {resumed}" in r["strict"]
            assert "comm.elastic()" in r["strict"]
        else:  # the new ranks' entries are not in the checkpoint: DCP refuses, naming them
            assert f"Missing key in checkpoint state_dict: comm.rank{saved}." in r["strict"]
        assert r["loaded"] == at_save["hash"]
        assert r["elastic"] == r["without codecs"] == ranks[0]["elastic"]
    assert ranks[0]["logged"] == [f"commpress FSDP codec: resuming state saved on {saved} "
                                  f"ranks on {resumed}: error-feedback memory and rounding "
                                  "streams start fresh (they were laid out for the world that "
                                  "saved them)"]
    assert all(r["logged"] == [] for r in ranks[1:])


def test_a_nan_on_one_rank_stays_non_finite_on_every_rank_as_in_stock_fsdp():
    """Rank 1's loss NaN once: every rank's reduced gradient shards are non-finite, as in
    stock FSDP2, for every kind of codec (none, error feedback across nodes, 4-bit
    Hadamard, ZeRO++'s); no codec turns it finite (2 ranks, each a node)."""
    policies = [None, "none", "int2ef", "sdp4bit", "zeropp"]
    ranks = spawn(fsdp_workers.fsdp_nan_on_one_rank, 2, (policies,), ranks_per_node=1)
    for r in ranks:
        for policy in map(str, policies):
            assert r[policy] == r["None"] == {"grads finite": [False, False],
                                              "weights finite": False}, policy


def test_a_nan_on_one_rank_of_hsdp_stays_non_finite_on_every_replica_as_in_stock():
    """HSDP (2 replicas × 2 shards): rank 1's NaN crosses to the other replica through the
    replicate all-reduce's codec (2-bit with error feedback, 4-bit Hadamard) as through
    stock HSDP's exact one; no replica is left finite."""
    from tests.engines.hsdp_workers import hsdp_model

    policies = [None, "int2ef", "sdp4bit"]
    ranks = spawn(fsdp_workers.fsdp_nan_on_one_rank, 4, (policies, hsdp_model),
                  ranks_per_node=2)
    for r in ranks:
        for policy in map(str, policies):
            assert r[policy] == r["None"] == {"grads finite": [False, False],
                                              "weights finite": False}, policy


@pytest.mark.slow
def test_ranks_that_compress_differently_or_not_at_all_are_named_at_compress():
    """Ranks on other policies raise the mismatch at ``compress`` on every rank. A rank
    that does not compress goes on to FSDP's own all-gather, which commpress's header
    exchange used to meet (a Gloo abort, "Received data size doesn't match"): the
    compressing rank now names it within the timeout, and the other fails as it leaves."""
    policy = spawn(fsdp_workers.fsdp_disagreeing_ranks, 2, ("policy",), ranks_per_node=1,
                   pg_timeout_s=10)
    for r in policy:
        assert "CollectiveMismatchError: commpress.fsdp.compress" in r["error"]
        assert "policy differs" in r["error"]
    # HSDP: each replica agrees inside, the replicas differ: every rank is told at compress
    from tests.engines.hsdp_workers import hsdp_model

    replicas = spawn(fsdp_workers.fsdp_disagreeing_ranks, 4, ("replicas", hsdp_model),
                     ranks_per_node=2, pg_timeout_s=10)
    for r in replicas:
        assert "CollectiveMismatchError: commpress.fsdp.compress" in r["error"], r
        assert "policy differs" in r["error"]
    one = spawn(fsdp_workers.fsdp_disagreeing_ranks, 2, ("one",), ranks_per_node=1,
                pg_timeout_s=10, timeout=120)
    assert "CollectiveTimeoutError: commpress.fsdp.compress" in one[0]["error"]
    assert "ranks [1] never reached it" in one[0]["error"]
    assert one[0]["seconds"] < 10 + 5
    assert one[1]["error"] is not None and one[1]["seconds"] < 10 + 15


@pytest.mark.slow
def test_a_rank_killed_mid_step_is_named_by_the_survivor():
    from tests.reliability.killing import assert_survivors_name_the_dead_rank

    ranks = spawn(fsdp_workers.fsdp_killed_mid_step, 2, (1,), ranks_per_node=1,
                  pg_timeout_s=15, timeout=300, allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=15)


def test_a_measured_fallback_decides_every_module_alike():
    """FSDP2 with zeropp and fallback="measured", one rank per node (the cross-node codecs
    run): after 10 steps every module has decided its reduce-scatter and all-gather, the
    same on both ranks, and the tally counts them."""
    ranks = spawn(fsdp_workers.fsdp_fallback, 2, (10,), ranks_per_node=1)
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert all(d in ("compressed", "exact") for m in ranks[0]["decisions"].values()
               for d in m.values())
    tally = ranks[0]["tally"]
    assert set(tally) == {"dp.grad", "dp.param"}
    assert all(row["measuring"] == 0 for row in tally.values())
    assert tally["dp.grad"]["compressed"] + tally["dp.grad"]["exact"] == len(
        ranks[0]["decisions"])
    assert ranks[0]["losses"] == ranks[1]["losses"]
