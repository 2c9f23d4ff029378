"""The commpress DDP hook inside Lightning (CommpressDDPStrategy) and accelerate (the
README recipe), on real Gloo ranks on CPU, against each engine's own DDP."""

import pytest

import commpress
from commpress.launch import spawn
from tests.engines import lightning_workers as workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank

pytestmark = pytest.mark.engine

STEPS = 3


def close(a, b, rel):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lightning"))


@pytest.fixture(scope="module")
def two_ranks(directory):
    return spawn(workers.everything, 2, (directory, STEPS), timeout=900)


@pytest.mark.parametrize("engine", ["lightning", "accelerate"])
def test_codec_none_is_the_engines_own_ddp_bit_for_bit(two_ranks, engine):
    for rank in two_ranks:
        runs = rank[engine]
        assert runs["none"]["hashes"] == runs["stock"]["hashes"]
        assert runs["none"]["losses"] == runs["stock"]["losses"]


@pytest.mark.parametrize("engine", ["lightning", "accelerate"])
def test_int4_gradients_track_the_engine_with_identical_replicas(two_ranks, engine):
    runs = two_ranks[0][engine]
    assert close(runs["int4"]["losses"], runs["stock"]["losses"], 0.02)
    assert runs["int4"]["hashes"][-1] != runs["stock"]["hashes"][-1]
    assert runs["int4"]["hashes"] == two_ranks[1][engine]["int4"]["hashes"]
    stats = runs["int4"]["stats"]["dp.grad"]
    n = 1 << 16
    assert 8 * stats["wire_bytes"] / stats["elements"] == (
        8 * commpress.codec("int4:hadamard=128").wire_bytes(n) / n)


def test_lightning_drops_its_own_hook_on_cpu_and_the_strategy_does_not(two_ranks):
    runs = two_ranks[0]["lightning"]
    # DDPStrategy(ddp_comm_hook=fp16_compress_hook) on CPU: the hook never ran
    assert runs["stock fp16 hook"]["hashes"] == runs["stock"]["hashes"]
    assert runs["int4"]["stats"]["dp.grad"]["calls"] == STEPS


def test_accelerate_prepare_returns_ddp_for_the_hook(two_ranks):
    assert two_ranks[0]["accelerate"]["int4"]["wrapped"] == "DistributedDataParallel"


def test_lightning_checkpoint_carries_the_hook_state(two_ranks):
    for rank in two_ranks:
        runs = rank["lightning"]
        # the strategy's handle verbs: its state is the checkpoint's, none before the fit
        assert runs["handle equals file"] is True
        assert "state_dict() before the fit is not allowed" in runs["state before fit"]
        # int2 with error feedback: resumed after STEPS equals the uninterrupted run
        assert runs["ef resumed"]["hashes"] == runs["ef uninterrupted"]["hashes"][STEPS:]
        assert runs["ef resumed"]["losses"] == runs["ef uninterrupted"]["losses"][STEPS:]


def test_a_checkpoint_of_two_ranks_resumes_on_four_only_when_elastic(two_ranks, directory,
                                                                     tmp_path):
    """Refused as it is, naming ``elastic=True``; with it, the fit continues exactly as
    from the same checkpoint without commpress's files (fresh codecs), replicas identical,
    said once on rank 0."""
    import os

    ckpt = os.path.join(directory, "half.ckpt")
    ranks = spawn(workers.lightning_elastic, 4, (ckpt, str(tmp_path), STEPS), timeout=600)
    for r in ranks:
        assert "was written by rank 0 of 2; this is rank 0 of 4" in r["strict"]
        assert "CommpressDDPStrategy(..., elastic=True)" in r["strict"]
        assert r["elastic"]["hashes"] == r["control"]["hashes"] == ranks[0]["elastic"]["hashes"]
        assert len(r["elastic"]["hashes"]) == STEPS
    said = ranks[0]["said"]
    assert said[0].startswith("DDP hook: resuming state saved on 2 ranks on 4")
    assert "no commpress state beside" in said[1] and len(said) == 2
    assert all(r["said"] == [] for r in ranks[1:])


def test_a_checkpoint_of_four_ranks_resumes_on_two_only_when_elastic(tmp_path):
    """The other direction: rank 0's file read by both ranks, the memory fresh."""
    import os

    ckpt = os.path.join(str(tmp_path), "four.ckpt")
    spawn(workers.lightning_save, 4, (ckpt, STEPS), timeout=600)
    ranks = spawn(workers.lightning_elastic, 2, (ckpt, str(tmp_path), STEPS), timeout=600)
    for r in ranks:
        assert "was written by rank 0 of 4; this is rank 0 of 2" in r["strict"]
        assert r["elastic"]["hashes"] == r["control"]["hashes"] == ranks[0]["elastic"]["hashes"]
        assert len(r["elastic"]["hashes"]) == STEPS
    said = ranks[0]["said"]
    assert said[0].startswith("DDP hook: resuming state saved on 4 ranks on 2")
    assert all(r["said"] == [] for r in ranks[1:])


def test_the_hooks_guard_promotes_inside_lightning_on_every_rank_alike(two_ranks):
    a, b = (r["lightning"]["guarded"] for r in two_ranks)
    assert a["events"] and a["events"] == b["events"]
    assert {e["step"] for e in a["events"]} == {1} and "int4" in a["events"][0]["to"]
    assert a["hashes"] == b["hashes"]


def test_each_fit_ends_its_hooks_thread(two_ranks):
    # five fits with CommpressDDPStrategy in one process: none leaves its thread behind
    assert [r["lightning"]["hook threads left"] for r in two_ranks] == [0, 0]


def test_a_rank_killed_mid_step_is_named_by_the_survivor():
    ranks = spawn(workers.lightning_killed_mid_step, 2, (1,), pg_timeout_s=15, timeout=300,
                  allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=15)


def test_a_rank_killed_mid_step_under_accelerate_is_named_by_the_survivor():
    ranks = spawn(workers.accelerate_killed_mid_step, 2, (1,), pg_timeout_s=15, timeout=300,
                  allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=15)


def test_lightning_ranks_on_different_policies_are_told_and_a_nan_stays_non_finite():
    ranks = spawn(workers.lightning_adversarial, 2, (), pg_timeout_s=30, timeout=300)
    for out in ranks:
        # every rank is told, naming both codecs, before a gradient is exchanged
        assert out["policies"] is not None and "int4" in out["policies"], out["policies"]
        assert "int2" in out["policies"], out["policies"]
        # one rank's NaN loss reaches every rank's weights: never turned finite, and
        # the replicas still agree (bit for bit, NaN included)
        assert not out["nan"]["finite"]
    assert ranks[0]["nan"]["hashes"] == ranks[1]["nan"]["hashes"]


def test_accelerate_checkpointing_of_the_hook_state_is_refused_on_every_rank(tmp_path):
    # accelerate saves a registered object from the main process only; every rank then
    # loads rank 0's error-feedback memory: refused by name, not applied to the wrong rank
    # — and on rank 0 too, which would otherwise train on alone into the next collective
    ranks = spawn(workers.accelerate_checkpointing, 2, (str(tmp_path),), pg_timeout_s=30,
                  timeout=300)
    for refused in ranks:
        assert "DDP hook checkpoint rank 0 does not match this run's 1" in refused, refused
    assert ranks[0].endswith("[reported by rank 1]")
