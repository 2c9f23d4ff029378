"""commpress inside Hugging Face's Trainer (``commpress.transformers.compress``): a tiny
GPT2LMHeadModel from a config, two Gloo ranks on CPU, the Trainer's own DDP, against the
Trainer without commpress."""

import pytest

import commpress
from commpress.launch import spawn
from commpress.validate import InputError
from tests.engines import transformers_workers as workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def two_ranks(directory):
    return spawn(workers.everything, 2, (directory,), timeout=900)


def test_codec_none_is_the_trainers_own_ddp_bit_for_bit(two_ranks):
    for rank in two_ranks:
        assert rank["none"]["losses"] == rank["stock"]["losses"]
        assert rank["none"]["hash"] == rank["stock"]["hash"]
        assert rank["none"]["stats"]["dp.grad"]["calls"] > 0  # the hook ran


@pytest.mark.parametrize("run", ["int2ef", "accumulate unused", "lowrank"])
def test_compressed_runs_keep_replicas_identical_and_train(two_ranks, run):
    first, second = (rank[run] for rank in two_ranks)
    assert first["hash"] == second["hash"]
    assert first["step"] == workers.STEPS
    stock = two_ranks[0]["stock"]["losses"]
    assert first["losses"][-1] < first["losses"][0]
    assert abs(first["losses"][-1] - stock[-1]) / stock[-1] < 0.05
    assert first["hash"] != two_ranks[0]["stock"]["hash"]


def test_int2ef_sends_a_fraction_of_the_bytes(two_ranks):
    stats = two_ranks[0]["int2ef"]["stats"]["dp.grad.inter"]  # each rank a node
    assert stats["wire_bytes"] < stats["raw_bytes"] / 16  # 1.725 bits of 32


def test_accumulation_reduces_once_per_optimizer_step(two_ranks):
    # gradient_accumulation_steps=2: DDP's no_sync micro-steps call no hook
    calls = two_ranks[0]["accumulate unused"]["stats"]["dp.grad.inter"]["calls"]
    assert calls == two_ranks[0]["int2ef"]["stats"]["dp.grad.inter"]["calls"] == workers.STEPS


def test_checkpoints_carry_each_ranks_state_and_resume_bit_for_bit(two_ranks):
    assert {"commpress-rank0.pt", "commpress-rank1.pt"} <= set(two_ranks[0]["files in checkpoint"])
    for rank in two_ranks:
        assert rank["int2ef saved"]["hash"] == rank["int2ef"]["hash"]  # saving changes nothing
        assert rank["int2ef resumed"]["hash"] == rank["int2ef saved"]["hash"]
        # the log of the first half comes from the checkpoint, the rest from the resumed run
        assert rank["int2ef resumed"]["losses"] == rank["int2ef saved"]["losses"]


def test_a_checkpoint_without_the_state_is_refused_naming_how_to_add_compression(tmp_path):
    results = spawn(workers.resume_without_state, 2, (str(tmp_path),), timeout=600)
    for r in results:  # refused on every rank, with the way to add commpress to the run
        assert "commpress-rank" in r["refused"], r
        assert ("to add commpress to a run whose checkpoints were saved without it: "
                "commpress.transformers.compress(trainer, ..., elastic=True)") in r["refused"]
    assert results[0]["step"] == results[1]["step"] == 3  # resumed that way, trained on
    assert results[0]["hash"] == results[1]["hash"]


def test_remove_undoes_compress_before_and_after_training(two_ranks):
    before = two_ranks[0]["remove before"]
    assert before["train restored"] and before["callback gone"], before
    assert "state_dict() before training began is not allowed" in before["state before training"]
    assert two_ranks[0]["int2ef"]["remove after"] == "removed"
    assert two_ranks[0]["stock"]["remove after"] is None


def test_what_is_not_a_trainer_is_refused():
    with pytest.raises(InputError, match="trainer must be a transformers.Trainer"):
        commpress.transformers.compress(object(), "int2ef")


def test_a_checkpoint_of_two_ranks_resumes_on_four_only_when_elastic(two_ranks, directory,
                                                                     tmp_path):
    """Refused as it is, naming ``elastic=True``; with it, the run continues exactly as
    from the same checkpoint without commpress's files (fresh codecs), replicas identical,
    said once on rank 0."""
    import os

    checkpoint = os.path.join(directory, "saved", f"checkpoint-{workers.STEPS // 2}")
    ranks = spawn(workers.elastic_resume, 4, (checkpoint, str(tmp_path)), timeout=600)
    for r in ranks:
        assert "was written by rank 0 of 2; this is rank 0 of 4" in r["strict"]
        assert "compress(trainer, ..., elastic=True)" in r["strict"]
        assert r["elastic"] == r["control"] == ranks[0]["elastic"]
        assert r["elastic"]["step"] == workers.STEPS
    said = ranks[0]["said"]
    assert said[0].startswith("DDP hook: resuming state saved on 2 ranks on 4")
    assert "no commpress state beside" in said[1] and len(said) == 2
    assert all(r["said"] == [] for r in ranks[1:])


def test_a_checkpoint_of_four_ranks_resumes_on_two_only_when_elastic(tmp_path):
    """The other direction: rank 0's codec file read by both ranks, the memory fresh."""
    import os

    saved = os.path.join(str(tmp_path), "saved")
    spawn(workers.save_int2ef, 4, (saved,), timeout=600)
    checkpoint = os.path.join(saved, f"checkpoint-{workers.STEPS // 2}")
    ranks = spawn(workers.elastic_resume, 2, (checkpoint, str(tmp_path)), timeout=600)
    for r in ranks:
        assert "was written by rank 0 of 4; this is rank 0 of 2" in r["strict"]
        assert r["elastic"] == r["control"] == ranks[0]["elastic"]
        assert r["elastic"]["step"] == workers.STEPS
    said = ranks[0]["said"]
    assert said[0].startswith("DDP hook: resuming state saved on 4 ranks on 2")
    assert all(r["said"] == [] for r in ranks[1:])


def test_a_rank_killed_mid_step_is_named_by_the_survivor(tmp_path):
    ranks = spawn(workers.killed_mid_step, 2, (1, str(tmp_path)), pg_timeout_s=15,
                  timeout=300, allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=15)
