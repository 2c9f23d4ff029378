"""The scripts in ``examples/`` that README quotes, run as a user runs them: torchrun, two
Gloo processes, real text; each resumed from its own checkpoint. Each run must exit 0: a
process that aborts as it exits, after its last step, fails the test."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(script, tmp_path, name, *flags, ranks=2):
    report = tmp_path / f"{name}.json"
    # as a user runs them: compiled kernels, not the interpreter the unit tests use
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={ranks}", os.path.join(ROOT, "examples", script), *flags,
         "--report", str(report)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replicas identical: True" in proc.stdout
    return json.loads(report.read_text())


@pytest.mark.slow
def test_the_nanogpt_loop_compresses_and_resumes_bit_for_bit(tmp_path):
    # int2ef with each rank a node, DDP buckets small enough for several per step
    flags = ("--policy", "int2ef", "--ranks-per-node", "1", "--bucket-cap-mb", "0.1",
             "--steps", "6", "--out", str(tmp_path / "out"))
    straight = _torchrun("nanogpt_ddp.py", tmp_path, "straight", *flags, "--save-at", "3")
    resumed = _torchrun("nanogpt_ddp.py", tmp_path, "resumed", *flags, "--resume")
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["hashes"] == straight["hashes"]
    sent = straight["stats"]
    assert sum(c["wire_bytes"] for c in sent.values()) < 0.1 * sum(
        c["raw_bytes"] for c in sent.values())
    assert sorted(os.listdir(tmp_path / "out")) == ["ckpt.pt", "commpress-rank0.pt",
                                                    "commpress-rank1.pt"]


@pytest.mark.slow
def test_the_zero_loop_matches_torchs_and_resumes_on_two_or_one_ranks(tmp_path):
    steps = ("--steps", "6")
    zero = _torchrun("zero_sharded.py", tmp_path, "zero", *steps, "--optimizer", "zero")
    none = _torchrun("zero_sharded.py", tmp_path, "none", *steps, "--policy", "none")
    assert none["losses"] == pytest.approx(zero["losses"], rel=1e-6)
    flags = (*steps, "--out", str(tmp_path / "out"))
    straight = _torchrun("zero_sharded.py", tmp_path, "straight", *flags, "--save-at", "3")
    resumed = _torchrun("zero_sharded.py", tmp_path, "resumed", *flags, "--resume")
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["hashes"] == straight["hashes"]
    one = _torchrun("zero_sharded.py", tmp_path, "one", *flags, "--resume", ranks=1)
    assert len(one["losses"]) == 3 and all(x < straight["losses"][0] for x in one["losses"])


@pytest.mark.slow
@pytest.mark.sweep  # CI runs the Trainer in tests/engines/test_transformers.py
def test_the_hf_trainer_script_keeps_codec_state_in_its_checkpoints(tmp_path):
    flags = ("--ranks-per-node", "1", "--steps", "6", "--save-steps", "3",
             "--out", str(tmp_path / "out"))
    straight = _torchrun("hf_trainer.py", tmp_path, "straight", *flags)
    assert {"commpress-rank0.pt", "commpress-rank1.pt"} <= set(
        os.listdir(tmp_path / "out" / "checkpoint-3"))
    shutil.rmtree(tmp_path / "out" / "checkpoint-6")  # resume from step 3
    resumed = _torchrun("hf_trainer.py", tmp_path, "resumed", *flags, "--resume")
    # the Trainer restores its log history: steps 1-3 from the checkpoint, 4-6 run again
    assert len(straight["losses"]) == 6 and resumed["losses"] == straight["losses"]
    assert resumed["hashes"] == straight["hashes"]
