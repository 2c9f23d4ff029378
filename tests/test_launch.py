"""The launcher owns its ranks: killed or signalled, it leaves no rank behind; a live
run's directory is refused to a second run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from commpress.cli import main
from commpress.launch import spawn

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


def _descendants(pid):
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _ranks(pid):
    # the ranks fork from the launcher's fork server: its children, grandchildren of the
    # launcher (the resource tracker is a child that starts none)
    servers = [c for c in _children(pid) if b"forkserver" in _cmdline(c)]
    return [r for s in servers for r in _children(s)]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _start(out):
    proc = subprocess.Popen([sys.executable, "-m", "commpress.cli", *TRAIN, "--out", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the ranks have started and written their steps
        ranks = _ranks(proc.pid)
        if len(ranks) == 2 and os.path.exists(os.path.join(out, "config.json")):
            return proc, _descendants(proc.pid)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the training did not start")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM,
                                                                marks=pytest.mark.slow)])
def test_killing_the_launcher_stops_every_rank_within_10_s(tmp_path, sig):
    """... and every other process it started (the fork server, the resource tracker)."""
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


def _where_am_i(rank, world):
    print(f"rank {rank} speaks", flush=True)
    return os.getcwd(), os.environ.get("COMMPRESS_LATE"), os.environ["RANK"]


def test_a_rank_runs_where_the_launcher_stands_at_the_launch(tmp_path, monkeypatch, capfd):
    """The ranks fork from a server started at the first launch; each later launch still
    hands its ranks the launcher's directory, environment and stdout as they are then."""
    spawn(_where_am_i, 2)  # the fork server starts here, if no earlier test started it
    capfd.readouterr()
    monkeypatch.setenv("COMMPRESS_LATE", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    values = spawn(_where_am_i, 2)
    assert values == [(str(tmp_path), "set after the first launch", str(r)) for r in (0, 1)]
    out = capfd.readouterr().out
    assert "rank 0 speaks" in out and "rank 1 speaks" in out


SCRIPT = """
from commpress.launch import spawn


def square(rank, world):
    return rank * rank


if __name__ == "__main__":
    print(spawn(square, 3))
"""


def _run_script(tmp_path, text: str, **options) -> subprocess.CompletedProcess:
    """``text`` run as a script of its own (its functions live in its ``__main__``)."""
    script = tmp_path / "script.py"
    script.write_text(text)
    options = {"capture_output": True, **options}
    done = subprocess.run([sys.executable, str(script)], text=True, timeout=120, **options)
    assert done.returncode == 0, done.stderr
    return done


def test_a_function_of_the_launching_script_itself_runs_on_every_rank(tmp_path):
    assert _run_script(tmp_path, SCRIPT).stdout.strip() == "[0, 1, 4]"


CLOSED_STDOUT = """
import operator, sys
from commpress.launch import spawn

if __name__ == "__main__":
    sys.stderr.write(repr(spawn(operator.add, 2)))
"""


def test_a_launcher_whose_stdout_is_closed_still_starts_its_ranks(tmp_path):
    # a daemon or a cron job may run with fd 1 closed: there is no stream to hand over
    done = _run_script(tmp_path, CLOSED_STDOUT, capture_output=False,
                       stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    assert done.stderr.strip().endswith("[2, 3]")  # rank + world


PARTIAL = """
import functools
from commpress.launch import spawn


def scaled(rank, world, factor):
    return rank * factor


if __name__ == "__main__":
    print(spawn(functools.partial(scaled, factor=10), 2))
"""


def test_a_partial_of_the_launching_scripts_function_runs_on_every_rank(tmp_path):
    assert _run_script(tmp_path, PARTIAL).stdout.strip() == "[0, 10]"


def exits_without_a_result(rank, world):
    if rank == 1:
        os._exit(0)
    return rank


def returns_what_cannot_travel(rank, world):
    import threading

    return threading.Lock() if rank == 1 else rank


def test_a_rank_that_exits_without_a_result_is_named_at_once():
    start = time.monotonic()
    with pytest.raises(Exception, match=r"rank 1 exited \(code 0\) without a result"):
        spawn(exits_without_a_result, 2, timeout=60)
    assert time.monotonic() - start < 20  # not the whole timeout


def test_a_result_that_cannot_be_pickled_is_the_ranks_error():
    start = time.monotonic()
    with pytest.raises(Exception, match=r"rank 1 failed: TypeError: cannot pickle"):
        spawn(returns_what_cannot_travel, 2, timeout=60)
    assert time.monotonic() - start < 20


def test_launching_from_a_removed_directory_says_so(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(Exception, match="working directory no longer exists"):
        spawn(exits_without_a_result, 2, timeout=60)
