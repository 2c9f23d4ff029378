"""The launcher owns its ranks: killed or signalled, it leaves no rank behind; a live
run's directory is refused to a second run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from commpress.cli import main

TRAIN = ["train", "--model", "gpt-tiny", "--steps", "100000", "--batch-size", "8",
         "--seq-len", "32", "--nproc", "2", "--eval-every", "0", "--eval-batches", "1",
         "--max-data-bytes", "200000", "--no-progress", "--policy", "none"]


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _start(out):
    proc = subprocess.Popen([sys.executable, "-m", "commpress.cli", *TRAIN, "--out", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the ranks have started and written their steps
        ranks = [c for c in _children(proc.pid) if b"spawn_main" in
                 open(f"/proc/{c}/cmdline", "rb").read()]
        if len(ranks) == 2 and os.path.exists(os.path.join(out, "config.json")):
            return proc, ranks
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the training did not start")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM,
                                                                marks=pytest.mark.slow)])
def test_killing_the_launcher_stops_every_rank_within_10_s(tmp_path, sig):
    proc, ranks = _start(str(tmp_path / "run"))
    os.kill(proc.pid, sig)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(r) for r in ranks)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_live_runs_directory_is_refused(tmp_path, capsys):
    out = str(tmp_path / "run")
    proc, _ = _start(out)
    try:
        code = main([*TRAIN, "--steps", "1", "--out", out])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2 and f"is in use by a live run (pid {proc.pid})" in err, err
    finally:
        proc.kill()
        proc.wait()
    # once it is gone, the directory is free again
    assert main([*TRAIN, "--steps", "1", "--out", out]) == 0
