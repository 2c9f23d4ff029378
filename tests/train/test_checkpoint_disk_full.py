"""A checkpoint save on a full disk: every rank fails together, in one line that names
the file and the checkpoint kept, and no temporary or partial file stays behind.

The disk is real: a tmpfs of a few hundred KiB (mounting needs root; skipped otherwise).
"""

import glob
import os
import re
import subprocess

import pytest
import torch
import torch.distributed as dist

from commpress.cli import main
from commpress.launch import spawn
from commpress.train import checkpoint

STATE_NUMEL = 80_000  # 320 KiB per rank file: two ranks' step fits in 1 MiB, two steps do not


def save_steps(rank: int, world: int, run_dir: str, steps: list[int]) -> list[str]:
    """Save each of ``steps`` (a state of ``STATE_NUMEL`` floats per rank); what each
    save did: "saved" or its error."""
    outcomes = []
    for step in steps:
        state = {"format": checkpoint.FORMAT, "step": step,
                 "w": torch.full((STATE_NUMEL,), float(rank))}
        try:
            checkpoint.save_step(run_dir, step, rank, state, {"world": world}, dist.group.WORLD)
            outcomes.append("saved")
        except checkpoint.CheckpointError as e:
            outcomes.append(str(e))
    return outcomes


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        # a real full disk needs a mount (CI and the dev machines run as root); failing
        # here keeps a missing mount from passing as a green run
        pytest.fail(f"cannot mount a small tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _assert_step_1_kept_and_nothing_else(run):
    assert not glob.glob(os.path.join(run, "**", "*.tmp.*"), recursive=True)
    assert not os.path.exists(checkpoint.step_dir(run, 2))
    with open(os.path.join(run, "ckpt", "latest")) as f:
        assert f.read() == "1\n"
    directory, passed_over = checkpoint.find(run)
    assert directory == checkpoint.step_dir(run, 1) and passed_over == []
    manifest = checkpoint.read_manifest(directory)
    for rank in (0, 1):
        state = checkpoint.load(checkpoint.verify_file(directory, manifest, rank))
        assert torch.equal(state["w"], torch.full((STATE_NUMEL,), float(rank)))


def test_a_rank_file_on_a_full_disk_fails_every_rank_together(small_disk):
    run = str(small_disk / "run")
    outcomes = spawn(save_steps, 2, (run, [1, 2]), pg_timeout_s=20, timeout=120)
    kept = f"the last complete checkpoint, {checkpoint.step_dir(run, 1)!r}, is kept"
    # which rank's file hits the full disk first is up to timing: one or both
    reporter = int(re.search(r"/rank(\d+)\.pt'", outcomes[0][1]).group(1))
    for rank, (first, second) in enumerate(outcomes):
        assert first == "saved"
        assert second.startswith("cannot save checkpoint step 2: No space left on device "
                                 f"writing '{checkpoint.rank_file(run, 2, reporter)}'"), second
        assert kept in second and "\n" not in second, second
        assert (f"[reported by rank {reporter}]" in second) == (rank != reporter), second
    # every rank raises the same message, but for whom reported it
    same = {re.sub(r" \[reported by rank \d+\]", "", second) for _, second in outcomes}
    assert len(same) == 1, same
    _assert_step_1_kept_and_nothing_else(run)


@pytest.mark.slow
def test_a_manifest_on_a_full_disk_fails_every_rank_together(small_disk):
    run = str(small_disk / "run")
    assert spawn(save_steps, 2, (run, [1]), timeout=120) == [["saved"], ["saved"]]
    # room for step 2's directory and rank files, but no inode for its manifest
    stat = os.statvfs(small_disk)
    used = stat.f_files - stat.f_ffree
    subprocess.run(["mount", "-o", f"remount,size=4m,nr_inodes={used + 3}", str(small_disk)],
                   check=True)
    outcomes = spawn(save_steps, 2, (run, [2]), pg_timeout_s=20, timeout=120)
    manifest = os.path.join(checkpoint.step_dir(run, 2), checkpoint.MANIFEST)
    for (message,) in outcomes:
        assert message.startswith("cannot save checkpoint step 2: No space left on device "
                                  f"writing {manifest!r}"), message
    _assert_step_1_kept_and_nothing_else(run)


@pytest.mark.slow
def test_train_on_a_full_disk_exits_2_in_one_line(small_disk, capsys):
    subprocess.run(["mount", "-o", "remount,size=6m", str(small_disk)], check=True)
    out = str(small_disk / "run")
    code = main(["train", "--model", "gpt-tiny", "--dp", "2", "--steps", "3", "--batch-size",
                 "4", "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1",
                 "--max-data-bytes", "20000", "--checkpoint-every", "1", "--no-progress",
                 "--timeout-s", "20", "--out", out])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert "No space left on device" in err and "is kept" in err, err
    assert not glob.glob(os.path.join(out, "**", "*.tmp.*"), recursive=True)
