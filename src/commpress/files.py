"""Opening files a user names: regular files only, their size known before a byte is read;
writing files whole or not at all (a temporary file, synced, then renamed); writing results
as JSON.

A path on the command line (a corpus, a policy, a checkpoint) may be a symlink to
``/dev/zero`` or to a FIFO. Reading ``/dev/zero`` to end-of-file never ends and takes
all memory (3.3 GB in 7.6 s); ``open`` on a FIFO blocks until some writer appears,
past any collective's timeout, since no collective is waiting yet. So every such file
is opened with ``O_NONBLOCK`` (a FIFO opens at once), checked with ``fstat`` on the
opened descriptor (the inode that will be read, not a path that could be swapped
after the check), and refused unless it is a regular file; its size then bounds the
read. The alternative, ``os.path.isfile`` before ``open``, still blocks on a FIFO
swapped in between and says nothing about size.

This module imports nothing from commpress: every layer may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO, Any, BinaryIO

import torch

from commpress.validate import InputError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, what: str,
                 error: type[InputError] = InputError) -> tuple[BinaryIO, int]:
    """Open ``path`` for binary reading if it is a regular file (symlinks followed);
    return the file and its size.

    Args:
        path: the file.
        what: how the message names it (``"checkpoint manifest"``, ``"--data"``).
        error: the exception raised for a file that is not regular.

    Raises ``FileNotFoundError`` (and other ``OSError``) as ``open`` does.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            target = os.path.realpath(path)
            via = f" (a link to {target!r})" if target != os.path.abspath(path) else ""
            raise error(f"{what} {path!r}{via} is {_kind(info.st_mode)}; allowed: a regular "
                        "file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, max_bytes: int, what: str,
                 error: type[InputError] = InputError) -> bytes:
    """The bytes of regular file ``path``, refused before reading if it holds more than
    ``max_bytes`` (and never more than ``max_bytes`` read, should it grow meanwhile)."""
    f, size = open_regular(path, what, error)
    with f:
        if size > max_bytes:
            raise error(too_large(path, what, size, max_bytes))
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(too_large(path, what, len(data), max_bytes))
    return data


def too_large(path: str, what: str, size: int, max_bytes: int) -> str:
    """The message for a file over its limit."""
    return (f"{what} {path!r} is larger than {max_bytes} bytes ({size} bytes); allowed: at "
            f"most {max_bytes} bytes")


def write_json(path: str, obj: Any, default: Any = None) -> None:
    """Write ``obj`` to ``path`` as JSON indented by one space (``default`` as
    :func:`json.dump`'s, for values JSON has no type for)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=default)


class _HashingWriter:
    """A file wrapper that hashes what is written (torch.save writes sequentially) and
    keeps the first ``OSError`` (torch.save reports a failed write, such as a full disk,
    as a RuntimeError of its own)."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def atomic_save(obj: Any, path: str) -> dict[str, Any]:
    """``torch.save`` to ``path`` through a temporary file and a rename; returns the
    file's ``{"sha256", "bytes"}``. A failed write raises its ``OSError`` (its
    ``filename`` ``path``), the temporary file removed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with replacing(path, "wb") as f:
        w = _HashingWriter(f)
        try:
            torch.save(obj, w)
        except RuntimeError:
            if w.error is None:
                raise
            raise w.error from None
    return {"sha256": w.sha.hexdigest(), "bytes": w.size}


def atomic_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    with replacing(path, "w") as f:
        f.write(text)


@contextmanager
def replacing(path: str, mode: str) -> Iterator[IO]:
    """A file opened at a temporary path, synced and renamed to ``path`` when the block
    ends; on any failure the temporary file is removed and the error re-raised."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            e.filename = path  # the error names the file meant, not the temporary one
        raise
