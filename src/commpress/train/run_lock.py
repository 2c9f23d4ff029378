"""One live run per run directory.

Two runs writing checkpoints and metrics into the same ``--out`` would interleave their
files. A run holds an exclusive ``flock`` on ``DIR/.lock`` while it lives; the kernel
drops it when the process ends, however it ends (``kill -9`` included), so a lock is
never stale. The file names the holder's pid for the error message.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from commpress.validate import InputError


class RunDirectoryBusy(InputError):
    """Another live run holds this run directory."""


@contextmanager
def hold(run_dir: str) -> Iterator[None]:
    """Hold ``run_dir`` for the duration of the block, or raise :class:`RunDirectoryBusy`."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise RunDirectoryBusy(
                f"--out {run_dir!r} is in use by a live run (pid {holder}); allowed: a run "
                "directory no other run holds — choose another --out or stop that run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the lock
