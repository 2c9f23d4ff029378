"""Checkpoints: a manifest of checksums and the run's identity; any corruption refused."""

import json
import os

import pytest
import torch

from commpress.cli import main
from commpress.launch import LaunchError
from commpress.train import checkpoint
from commpress.train.config import TrainConfig
from commpress.train.loop import train

TINY = dict(model="gpt-tiny", steps=2, batch_size=8, seq_len=32, eval_every=0, eval_batches=1,
            progress=False, max_data_bytes=200_000, bucket_numel=20_000, checkpoint_every=1,
            policy="sdp4bit", dp=2)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run"))
    train(TrainConfig(out=out, **TINY))
    return out


def _flip(path, position):
    data = bytearray(open(path, "rb").read())
    data[position % len(data)] ^= 0x10
    open(path, "wb").write(bytes(data))


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _verify(run_dir, rank=0):
    directory, _ = checkpoint.find(run_dir)
    manifest = checkpoint.read_manifest(directory)
    return checkpoint.load(checkpoint.verify_file(directory, manifest, rank))


def test_a_saved_run_has_a_manifest_per_step(saved_run):
    for step in (1, 2):
        manifest = checkpoint.read_manifest(checkpoint.step_dir(saved_run, step))
        assert set(manifest["files"]) == {"rank00000.pt", "rank00001.pt"}
        assert manifest["identity"]["policy"]["name"] == "sdp4bit"
        assert len(manifest["identity"]["data"]) == 64  # the corpus' SHA-256
    assert _verify(saved_run)["step"] == 2


def test_checkpoint_every_0_writes_none(tmp_path):
    train(TrainConfig(out=str(tmp_path), **dict(TINY, checkpoint_every=0, steps=1)))
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.999])
def test_a_flipped_byte_in_a_rank_file_is_refused(saved_run, tmp_path, fraction):
    run = _copy_run(saved_run, tmp_path / "run")
    path = checkpoint.rank_file(run, 2, 0)
    _flip(path, int(fraction * os.path.getsize(path)))
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256 does not match"):
        _verify(run)


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.8, 0.99])
def test_a_flipped_byte_in_a_manifest_is_refused(saved_run, tmp_path, fraction):
    run = _copy_run(saved_run, tmp_path / "run")
    step2 = checkpoint.step_dir(run, 2)
    path = os.path.join(step2, checkpoint.MANIFEST)
    _flip(path, int(fraction * os.path.getsize(path)))
    with pytest.raises(checkpoint.CheckpointError, match="manifest"):
        checkpoint.read_manifest(step2)
    # resuming from the run directory passes over it, to the step before, and says why
    directory, passed_over = checkpoint.find(run)
    assert directory == checkpoint.step_dir(run, 1) and "manifest" in passed_over[0]


def test_an_empty_or_corrupt_latest_falls_back_to_the_newest_complete_step(saved_run,
                                                                           tmp_path):
    run = _copy_run(saved_run, tmp_path / "run")
    latest = os.path.join(run, "ckpt", "latest")
    for text in ("", "garbage", "99\n"):
        open(latest, "w").write(text)
        assert checkpoint.find(run)[0] == checkpoint.step_dir(run, 2)
    # an interrupted save (no manifest) is passed over too
    os.remove(os.path.join(checkpoint.step_dir(run, 2), checkpoint.MANIFEST))
    assert checkpoint.find(run)[0] == checkpoint.step_dir(run, 1)


def test_no_complete_checkpoint_is_a_clear_error(tmp_path):
    os.makedirs(tmp_path / "ckpt" / "step_000003")
    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        checkpoint.find(str(tmp_path))


def test_truncated_or_foreign_files_are_refused(saved_run, tmp_path):
    data = open(checkpoint.rank_file(saved_run, 2, 0), "rb").read()
    bad = tmp_path / "rank00000.pt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is corrupted or truncated"):
        checkpoint.load(str(bad))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"format": checkpoint.FORMAT, "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="is corrupted or truncated"):
        checkpoint.load(str(tmp_path / "evil.pt"))  # weights_only=True: no code runs


def test_stale_temporary_files_are_removed(saved_run, tmp_path):
    run = _copy_run(saved_run, tmp_path / "run")
    stale = checkpoint.rank_file(run, 2, 1) + ".tmp.999999"
    open(stale, "wb").write(b"half a checkpoint")
    assert checkpoint.remove_stale_temporaries(run) == [stale]
    assert not os.path.exists(stale)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(("change", "needle"), [
    (dict(dp=4), "was written by 2 ranks; this run has 4"),
    pytest.param(dict(policy="zeropp"), "has policy=", marks=SLOW),
    (dict(dtype="bf16"), "has dtype='fp32', this run dtype='bf16'"),
    pytest.param(dict(ranks_per_node=1), "has ranks_per_node=2, this run ranks_per_node=1",
                 marks=SLOW),
    pytest.param(dict(max_data_bytes=100_000), "has data=", marks=SLOW),
])
def test_a_checkpoint_of_another_run_is_refused(saved_run, tmp_path, change, needle):
    cfg = dict(TINY, steps=4, out=str(tmp_path), resume=saved_run)
    cfg.update(change)
    with pytest.raises(LaunchError) as info:
        train(TrainConfig(**cfg))
    assert needle in str(info.value) and info.value.bad_input


def test_resume_from_a_corrupt_file_exits_2_without_traceback(saved_run, tmp_path, capsys):
    run = _copy_run(saved_run, tmp_path / "run")
    _flip(checkpoint.rank_file(run, 2, 1), 1000)
    code = main(["train", "--policy", "sdp4bit", "--dp", "2", "--model", "gpt-tiny",
                 "--steps", "3", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0",
                 "--eval-batches", "1", "--max-data-bytes", "200000", "--bucket-numel", "20000",
                 "--no-progress", "--out", str(tmp_path / "out"), "--resume", run])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert "rank00001.pt" in err and "is corrupted" in err and "Traceback" not in err


def test_manifest_is_plain_json(saved_run):
    with open(os.path.join(checkpoint.step_dir(saved_run, 1), checkpoint.MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["step"] == 1 and manifest["format"] == checkpoint.FORMAT
