"""Files the user names that never end or never open (/dev/zero, a FIFO) are refused at
once, and files larger than allowed are refused before they are read.

A reader that regresses must fail these tests, not hang them: ``_bounded`` raises
after a few seconds (SIGALRM also interrupts an ``open`` blocked on a FIFO) and lets at
most 1 GiB more address space be taken (reading /dev/zero to EOF in one call then
raises MemoryError).
"""

import os
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from commpress.policy import Policy
from commpress.train import checkpoint
from commpress.train.data import load_tokens


@contextmanager
def _bounded(seconds=3.0, spare_bytes=1 << 30):
    """Raise TimeoutError after ``seconds`` (also in a blocked ``open``), MemoryError
    after ``spare_bytes`` more address space."""
    def expire(signum, frame):
        raise TimeoutError(f"still reading after {seconds} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + spare_bytes, hard))
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _link(path, target):
    os.symlink(target, path)
    return str(path)


def _fifo(path):
    os.mkfifo(path)
    return str(path)


@pytest.fixture(params=["dev_zero", "fifo"])
def endless(request, tmp_path):
    """A path that never ends (/dev/zero) or never opens (a FIFO with no writer)."""
    if request.param == "dev_zero":
        return "/dev/zero", "a character device"
    return _fifo(tmp_path / "fifo"), "a FIFO"


def _step_with_rank_file(tmp_path, nbytes=100):
    """A step directory whose manifest (valid checksum) lists one rank file."""
    directory = checkpoint.step_dir(str(tmp_path), 1)
    os.makedirs(directory)
    checkpoint.write_manifest(str(tmp_path), 1, {"world": 1},
                              {checkpoint.rank_name(0): {"sha256": "0" * 64, "bytes": nbytes}})
    return directory


def test_a_manifest_that_never_ends_is_refused_at_once(tmp_path, endless):
    target, kind = endless
    directory = checkpoint.step_dir(str(tmp_path), 1)
    os.makedirs(directory)
    _link(os.path.join(directory, checkpoint.MANIFEST), target)
    with _bounded(), pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.read_manifest(directory)
    assert f"is {kind}; allowed: a regular file" in str(info.value)
    assert checkpoint.MANIFEST in str(info.value)


def test_a_rank_file_that_never_ends_is_refused_at_once(tmp_path, endless):
    target, kind = endless
    directory = _step_with_rank_file(tmp_path)
    _link(os.path.join(directory, checkpoint.rank_name(0)), target)
    manifest = checkpoint.read_manifest(directory)
    with _bounded(), pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.verify_file(directory, manifest, 0)
    assert f"is {kind}; allowed: a regular file" in str(info.value)
    with _bounded(), pytest.raises(checkpoint.CheckpointError, match=kind):
        checkpoint.load(os.path.join(directory, checkpoint.rank_name(0)))


def test_a_rank_file_larger_than_its_manifest_says_is_refused_unread(tmp_path):
    directory = _step_with_rank_file(tmp_path, nbytes=100)
    path = os.path.join(directory, checkpoint.rank_name(0))
    with open(path, "wb") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB that would take seconds to hash
    manifest = checkpoint.read_manifest(directory)
    start = time.monotonic()
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.verify_file(directory, manifest, 0)
    assert time.monotonic() - start < 1.0
    assert f"holds {4 << 30} bytes; its manifest says 100" in str(info.value)


def test_a_manifest_larger_than_any_manifest_is_refused_unread(tmp_path):
    directory = checkpoint.step_dir(str(tmp_path), 1)
    os.makedirs(directory)
    with open(os.path.join(directory, checkpoint.MANIFEST), "wb") as f:
        f.truncate(4 << 30)
    with _bounded(), pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.read_manifest(directory)
    assert f"is larger than {checkpoint.MAX_MANIFEST_BYTES} bytes" in str(info.value)


@pytest.mark.parametrize("name", ["corpus.txt", "tokens.bin"])
def test_a_corpus_that_never_ends_is_refused_at_once(tmp_path, endless, name):
    target, kind = endless
    path = _link(tmp_path / name, target)
    for max_bytes in (1000, None):
        with _bounded(), pytest.raises(ValueError) as info:
            load_tokens(path, max_bytes=max_bytes)
        assert f"--data {path!r}" in str(info.value) and kind in str(info.value)


def test_a_policy_file_that_never_opens_is_refused_at_once(tmp_path):
    path = _fifo(tmp_path / "p.yaml")
    with _bounded(), pytest.raises(ValueError, match="is a FIFO; allowed: a regular file"):
        Policy.load(path)


def _run_cli(args, timeout_s):
    """``commpress ARGS`` in a child (4 GiB address space per process); its exit code and
    stderr, or None if it did not finish within ``timeout_s`` (then its group is killed)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.Popen([sys.executable, "-m", "commpress", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return None, "did not finish"
    return proc.returncode, " ".join(err.split())


TRAIN = ["train", "--model", "gpt-tiny", "--dp", "2", "--steps", "2", "--batch-size", "4",
         "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1", "--max-data-bytes",
         "20000", "--no-progress", "--timeout-s", "5"]


@pytest.mark.slow
def test_resume_from_a_manifest_linked_to_dev_zero_exits_2_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    os.makedirs(checkpoint.step_dir(str(run), 1))
    _link(os.path.join(checkpoint.step_dir(str(run), 1), checkpoint.MANIFEST), "/dev/zero")
    code, err = _run_cli([*TRAIN, "--out", str(tmp_path / "out"), "--resume", str(run)], 60)
    assert code == 2, err
    assert "a character device" in err and "Traceback" not in err, err
