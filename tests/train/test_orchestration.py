"""How runs are started and ended: one process group per launch, bounded waits,
refusals before work, and an exit status that says whether anything was trained."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from commpress.cli import main
from commpress.launch import spawn
from commpress.train import checkpoint
from tests.train import orchestration_workers as workers

TINY = ["--model", "gpt-tiny", "--seq-len", "32", "--batch-size", "4", "--eval-every", "0",
        "--eval-batches", "1", "--max-data-bytes", "200000", "--no-progress"]
# each command with 2 ranks: train spawns them, simulate plays them
COMMANDS = {"train": ["train", "--nproc", "2"], "simulate": ["simulate", "--ranks", "2"]}


def torchrun(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``commpress ARGS`` under ``torchrun --standalone`` (a free rendezvous port)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(nproc), "-m", "commpress.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_sub_groups_wait_no_longer_than_the_launch_timeout():
    # torch gives a new group its backend's default timeout (30 min on Gloo); the mesh's
    # and the node levels' groups must fail as soon as the default group would
    waited = spawn(workers.wait_in_sub_groups, 4, (), timeout=60)[0]
    assert all(s < 3 * workers.TIMEOUT_S for s in waited.values()), waited


def test_compare_under_a_launcher_runs_every_policy_in_one_group(tmp_path):
    # a launched rank (RANK, WORLD_SIZE set, no group yet) used to create and destroy the
    # default group per policy: the second policy's rendezvous timed out
    ranks = spawn(workers.compare_as_a_launched_rank, 2, (str(tmp_path), ["none", "int2ef"]),
                  timeout=240)
    assert ranks == [["int2ef", "none"], []]  # rank 0 reports
    assert json.load(open(tmp_path / "compare.json"))["policies"].keys() == {"none", "int2ef"}
    assert (tmp_path / "compare.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_compare_under_torchrun(tmp_path, nproc):
    out = tmp_path / "cmp"
    done = torchrun(nproc, ["compare", "--policies", "none,sdp4bit,int2ef", *TINY, "--steps", "2",
                            "--timeout-s", "60", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.load(open(out / "compare.json"))["policies"].keys() == {
        "none", "sdp4bit", "int2ef"}


@pytest.fixture(scope="module", params=list(COMMANDS))
def one_step_run(request, tmp_path_factory):
    """(command, run directory) of a 1-step run of ``train`` or ``simulate`` with its
    checkpoint; tests take copies."""
    out = str(tmp_path_factory.mktemp(request.param) / "run")
    code = main([*COMMANDS[request.param], *TINY, "--policy", "none", "--steps", "1",
                 "--checkpoint-every", "1", "--out", out])
    assert code == 0
    return request.param, out


def _copy(run: str, tmp_path) -> str:
    return shutil.copytree(run, str(tmp_path / "run"))


def _error_lines(capsys) -> list[str]:
    """The errors printed (each one line, which the console may wrap)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [" ".join(e.split()) for e in err.split("error:")[1:]]


def test_resuming_at_or_past_steps_is_refused(one_step_run, tmp_path, capsys):
    command, run = one_step_run
    out = _copy(run, tmp_path)
    code = main([*COMMANDS[command], *TINY, "--policy", "none", "--steps", "1",
                 "--resume", out, "--out", out])
    lines = _error_lines(capsys)
    assert code == 2 and len(lines) == 1, lines
    assert "--steps 1 does not go past the checkpoint's step 1" in lines[0]


def _fill_nan(obj) -> None:
    """Every floating-point tensor in ``obj`` (nested dicts and lists) becomes NaN."""
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        obj.fill_(float("nan"))
    elif isinstance(obj, dict):
        for v in obj.values():
            _fill_nan(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _fill_nan(v)


def poison_weights(run_dir: str, step: int) -> None:
    """Make the weights of checkpoint ``step`` NaN (the model's and the optimizer's fp32
    masters); its manifest is rewritten to match."""
    directory = checkpoint.step_dir(run_dir, step)
    manifest = checkpoint.read_manifest(directory)
    files = {}
    for name in manifest["files"]:
        path = os.path.join(directory, name)
        state = torch.load(path, weights_only=True)
        _fill_nan([state[k] for k in ("model", "optimizer", "stages", "optimizers")
                   if k in state])
        files[name] = checkpoint.atomic_save(state, path)
    checkpoint.write_manifest(run_dir, step, manifest["identity"], files)


def test_a_run_whose_every_step_is_skipped_fails(one_step_run, tmp_path, capsys):
    command, run = one_step_run
    out = _copy(run, tmp_path)
    poison_weights(out, 1)
    code = main([*COMMANDS[command], *TINY, "--policy", "none", "--steps", "3",
                 "--resume", out, "--out", out])
    lines = _error_lines(capsys)
    assert code == 1 and len(lines) == 1, lines
    assert "all 2 steps this run were skipped" in lines[0]
    # what it wrote stays for the diagnosis
    assert json.load(open(os.path.join(out, "summary.json")))["skipped_steps"] == 2


def test_simulate_refuses_to_run_as_a_launchers_rank(tmp_path, capsys, monkeypatch):
    # torchrun starts one copy per rank; each would play every rank into the same --out
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    for policies in ([], ["--policies", "none,int2ef"]):
        code = main([*COMMANDS["simulate"], *TINY, "--steps", "1", *policies,
                     "--out", str(tmp_path / "sim")])
        (line,) = _error_lines(capsys)
        assert code == 2 and "WORLD_SIZE=2" in line and "without a launcher" in line
    assert not (tmp_path / "sim").exists()


@pytest.mark.slow
def test_simulate_under_torchrun_is_refused_by_every_rank(tmp_path):
    done = torchrun(2, ["simulate", *TINY, "--ranks", "2", "--steps", "1",
                        "--out", str(tmp_path / "sim")])
    assert done.returncode != 0
    assert done.stderr.count("without a launcher") == 2, done.stderr[-3000:]
    assert not (tmp_path / "sim").exists()


SIM_POLICIES = [*COMMANDS["simulate"], *TINY, "--warmup", "10", "--checkpoint-every", "1"]


def _losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_a_policy_comparison_resumes_each_policy_from_its_own_run(tmp_path, capsys):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert main([*SIM_POLICIES, "--policies", "none,int2ef", "--steps", "3", "--out", full]) == 0
    assert main([*SIM_POLICIES, "--policies", "none,int2ef", "--steps", "2", "--out", part]) == 0
    # both policies continue from their own checkpoints, as if never stopped
    assert main([*SIM_POLICIES, "--policies", "none,int2ef", "--steps", "3", "--resume", part,
                 "--out", part]) == 0
    for slug in ("none", "int2ef"):
        assert _losses(os.path.join(part, slug)) == _losses(os.path.join(full, slug))
    # finished policies are taken over, a policy never started starts
    capsys.readouterr()
    assert main([*SIM_POLICIES, "--policies", "none,int2ef,naive", "--steps", "3",
                 "--resume", part, "--out", part]) == 0
    assert capsys.readouterr().err.count("(finished before)") == 2
    assert json.load(open(os.path.join(part, "compare.json")))["policies"].keys() == {
        "none", "int2ef", "naive"}
    # a directory that is no comparison's is refused, naming where it looked
    code = main([*SIM_POLICIES, "--policies", "none,int2ef", "--steps", "3",
                 "--resume", os.path.join(part, "none"), "--out", str(tmp_path / "other")])
    (line,) = _error_lines(capsys)
    assert code == 2 and "holds no checkpoint of these policies" in line


@pytest.mark.parametrize("args", [
    ["simulate", "--ranks", "100000", "--batch-size", "100000"],
    # every parameter its own bucket, each padded to a multiple of the 4096 ranks
    ["simulate", "--ranks", "4096", "--batch-size", "4096", "--bucket-numel", "1",
     "--policy", "sdp4bit"],
    # every rank draws the global batch: 10^9 sequences cannot be held
    ["train", "--nproc", "2", "--batch-size", "1000000000"],
])
def test_sizes_that_cannot_fit_are_refused_before_allocating(tmp_path, args):
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "commpress.cli", *args, "--steps", "1",
                           "--no-progress", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    err = " ".join(done.stderr.split())
    assert done.returncode == 2, err[-2000:]
    assert "needs at least" in err and "available" in err and "--batch-size" in err, err
    assert time.monotonic() - t0 < 60 and not (tmp_path / "run" / "config.json").exists()


def test_a_comparison_reports_every_policy_then_fails_for_one_that_trained_nothing(
        tmp_path, capsys):
    out = str(tmp_path / "cmp")
    assert main([*SIM_POLICIES, "--policies", "int2ef,none", "--steps", "1", "--out", out]) == 0
    poison_weights(os.path.join(out, "int2ef"), 1)
    capsys.readouterr()
    code = main([*SIM_POLICIES, "--policies", "int2ef,none", "--steps", "3", "--resume", out,
                 "--out", out])
    (line,) = _error_lines(capsys)
    assert code == 1 and "policy int2ef: all 2 steps this run were skipped" in line
    # the policy after it still trained, and the comparison was written
    assert len(_losses(os.path.join(out, "none"))) == 3
    assert json.load(open(os.path.join(out, "compare.json")))["policies"].keys() == {
        "none", "int2ef"}
