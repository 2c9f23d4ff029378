"""Checkpoints: a manifest of checksums and the run's identity; any corruption refused."""

import hashlib
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
@pytest.mark.slow
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


def _rewrite_manifest(directory, change):
    """Apply ``change`` to a manifest's body and give it a valid checksum again (the
    SHA-256 of the body as sorted JSON): corrupt in structure, not in bytes."""
    path = os.path.join(directory, checkpoint.MANIFEST)
    with open(path) as f:
        body = json.load(f)
    body.pop("sha256")
    change(body)
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    with open(path, "w") as f:
        json.dump(body, f)


def _set(*keys, value):
    def change(body):
        target = body
        for key in keys[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return change


_DELETE = object()
RANK0 = "rank00000.pt"


@pytest.mark.parametrize(("change", "field"), [
    (_set("files", value=["rank00000.pt"]), "'files'"),
    (_set("files", value={}), "'files'"),
    (_set("files", value=_DELETE), "'files'"),
    (_set("files", "../../etc/passwd", value={"sha256": "0" * 64, "bytes": 1}), "'files'"),
    (_set("files", RANK0, value="abc"), f"'files.{RANK0}'"),
    (_set("files", RANK0, "bytes", value=_DELETE), f"'files.{RANK0}.bytes'"),
    (_set("files", RANK0, "bytes", value="100"), f"'files.{RANK0}.bytes'"),
    (_set("files", RANK0, "bytes", value=-1), f"'files.{RANK0}.bytes'"),
    (_set("files", RANK0, "sha256", value=5), f"'files.{RANK0}.sha256'"),
    (_set("files", RANK0, "sha256", value="xyz"), f"'files.{RANK0}.sha256'"),
    (_set("identity", value="dp2"), "'identity'"),
    (_set("identity", value=_DELETE), "'identity'"),
    (_set("step", value="2"), "'step'"),
    (_set("step", value=3), "'step'"),
])
def test_a_manifest_with_a_valid_checksum_and_a_wrong_structure_names_the_field(
        saved_run, tmp_path, change, field):
    run = _copy_run(saved_run, tmp_path / "run")
    step2 = checkpoint.step_dir(run, 2)
    _rewrite_manifest(step2, change)
    with pytest.raises(checkpoint.CheckpointError) as info:
        manifest = checkpoint.read_manifest(step2)
        checkpoint.check_identity(step2, manifest["identity"], manifest["identity"])
        checkpoint.verify_file(step2, manifest, 0)
    assert f"field {field}" in str(info.value), info.value


def test_resume_from_a_manifest_of_a_wrong_structure_exits_2_in_one_line(saved_run, tmp_path,
                                                                         capsys):
    run = _copy_run(saved_run, tmp_path / "run")
    step2 = checkpoint.step_dir(run, 2)
    _rewrite_manifest(step2, _set("files", value=[RANK0, "rank00001.pt"]))
    code = main(["train", "--policy", "sdp4bit", "--dp", "2", "--model", "gpt-tiny",
                 "--steps", "3", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0",
                 "--eval-batches", "1", "--max-data-bytes", "200000", "--bucket-numel", "20000",
                 "--no-progress", "--out", str(tmp_path / "out"), "--resume", step2])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "field 'files'" in err and "Traceback" not in err and err.count("error:") == 1, err


def test_latest_is_honoured_over_a_newer_step(saved_run, tmp_path):
    run = _copy_run(saved_run, tmp_path / "run")
    with open(os.path.join(run, "ckpt", "latest"), "w") as f:
        f.write("1\n")  # step 2 is complete, but the run's last committed save was step 1
    directory, passed_over = checkpoint.find(run)
    assert directory == checkpoint.step_dir(run, 1)
    assert any("step 2" in p and "newer than" in p for p in passed_over), passed_over


def _save(run_dir, step, value):
    state = {"format": checkpoint.FORMAT, "step": step, "w": torch.full((4,), float(value))}
    checkpoint.save_step(run_dir, step, 0, state, {"world": 1}, None)


def test_saving_an_older_step_retires_the_abandoned_branch(tmp_path, caplog):
    run = str(tmp_path / "run")
    for step in (1, 2, 3, 4):
        _save(run, step, value=step)
    # a run resumed from step 2 saves step 3: the old steps 3 and 4 are another branch
    with caplog.at_level("WARNING", logger="commpress.train.checkpoint"):
        _save(run, 3, value=-3)
    steps = sorted(os.listdir(os.path.join(run, "ckpt")))
    assert steps == ["latest", checkpoint.RETIRED, "step_000001", "step_000002",
                     "step_000003"], steps
    retired = os.path.join(run, "ckpt", checkpoint.RETIRED)
    assert sorted(os.listdir(retired)) == ["step_000003", "step_000004"]
    assert "step_000004" in caplog.text and checkpoint.RETIRED in caplog.text
    directory, passed_over = checkpoint.find(run)
    assert directory == checkpoint.step_dir(run, 3) and passed_over == []
    manifest = checkpoint.read_manifest(directory)
    assert checkpoint.load(checkpoint.verify_file(directory, manifest, 0))["w"][0] == -3
    # a second rollback to the same steps keeps both retired copies
    _save(run, 2, value=-2)
    assert sorted(os.listdir(retired)) == ["step_000002", "step_000003", "step_000003.1",
                                           "step_000004"]


@pytest.mark.slow
def test_resume_after_a_rollback_continues_the_new_branch(tmp_path, capfd):
    run = str(tmp_path / "run")
    train(TrainConfig(out=run, **dict(TINY, steps=3)))
    # resume from step 1 and stop at step 2: step 3 belongs to the abandoned branch
    train(TrainConfig(out=run, **dict(TINY, steps=2, resume=checkpoint.step_dir(run, 1))))
    assert "step_000003" in capfd.readouterr().err
    directory, _ = checkpoint.find(run)
    assert directory == checkpoint.step_dir(run, 2)
    manifest = checkpoint.read_manifest(directory)
    assert checkpoint.load(checkpoint.verify_file(directory, manifest, 0))["config"]["steps"] == 2


def test_resume_from_a_file_names_the_file(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.find(str(notes))
    assert f"--resume {str(notes)!r} is a file" in str(info.value)


def test_resume_from_a_file_of_a_step_directory_takes_that_step(saved_run):
    path = checkpoint.rank_file(saved_run, 1, 0)
    assert checkpoint.find(path)[0] == checkpoint.step_dir(saved_run, 1)
