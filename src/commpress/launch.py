"""Run a function on N local ranks (Gloo on CPU) and collect what each returns.

The CLI uses it to train on CPU without ``torchrun``; tests use it for real
multi-process runs. Each rank is a new process with the usual ``torchrun`` environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*), the launcher's working
directory and environment as they are at the launch. On Linux the ranks fork from one
server process that has imported torch and commpress once (``forkserver``): a rank
starts in about 0.1 s instead of the 2 s a fresh interpreter spends importing torch. A
function defined in the launching script itself (``__main__``) gets fresh interpreters
(``spawn``), which re-run that script to find it.
A rank that raises, dies or outlives ``timeout`` ends the whole launch with an error
that carries the rank's traceback — never a hang.

The launcher owns its ranks: each asks the kernel to kill it when the launcher dies
(``PR_SET_PDEATHSIG`` on Linux; elsewhere a thread watches the parent), so ``kill -9``
or SIGTERM of the launcher never leaves ranks training on and writing into the run
directory.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from commpress.validate import InputError


class LaunchError(RuntimeError):
    """A rank failed, died, or the launch timed out. ``bad_input`` is True when the rank
    refused its input (an :class:`InputError`: a bad option, file or checkpoint), not
    crashed."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


PR_SET_PDEATHSIG = 1
# threads each spawned rank computes on: the ranks share the machine's cores
RANK_THREADS = 1


@contextmanager
def rank_threads() -> Iterator[None]:
    """Compute on :data:`RANK_THREADS` threads, as every spawned rank does, then restore
    the caller's count. CPU kernels split their reductions by thread (a layer norm's
    weight gradient sums its rows in per-thread parts), so a gradient's bits depend on
    the thread count: ``commpress simulate`` plays its ranks with theirs."""
    import torch

    kept = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(kept)


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (kept across ``exec``, so a
    ``subprocess`` can call it as ``preexec_fn``); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _launcher_alive(launcher_pid: int, parent_pid: int) -> bool:
    # a forked rank's parent is the fork server, not the launcher; a rank whose parent
    # changed was re-parented: the process that started it died
    if os.getppid() != parent_pid:
        return False
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds the pid: not gone
        return True
    return True


def die_with_parent(launcher_pid: int) -> None:
    """End this process when ``launcher_pid`` dies, however it dies. The kernel kills it
    when its parent dies (the launcher, or the fork server, which exits with the
    launcher); a thread checks both every second where that signal does not exist."""
    set_parent_death_signal()
    parent_pid = os.getppid()  # the launcher, or its fork server
    if parent_pid == 1 or not _launcher_alive(launcher_pid, parent_pid):
        os._exit(1)  # the launcher died before we asked

    def watch() -> None:  # for platforms without PDEATHSIG, and as a second guard
        while True:
            time.sleep(1.0)
            if not _launcher_alive(launcher_pid, parent_pid):
                os._exit(1)

    threading.Thread(target=watch, name="commpress-parent-watch", daemon=True).start()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a forked rank imports once in the server it forks from
PRELOAD = ["torch", "torch.distributed", "commpress", "commpress.launch"]


def _context(fn: Callable[..., Any]):
    # a partial's function decides where it can be found
    module = getattr(getattr(fn, "func", fn), "__module__", None)
    if not sys.platform.startswith("linux") or module == "__main__":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read once, when the server starts
    return ctx


def _attribute(root: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        root = getattr(root, part, None)
    return root


def _by_name(fn: Callable[..., Any]) -> Callable[..., Any] | tuple[str, str]:
    """A module-level function travels by name and is imported by the rank once the
    launcher's directory, path and environment are in place (the fork server holds those
    of its own start); anything else travels pickled."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    qualname = getattr(fn, "__qualname__", "")
    if module is not None and "<" not in qualname and _attribute(module, qualname) is fn:
        return (module.__name__, qualname)
    return fn


def _resolve(target: Callable[..., Any] | tuple[str, str]) -> Callable[..., Any]:
    if not isinstance(target, tuple):
        return target
    import importlib

    return _attribute(importlib.import_module(target[0]), target[1])


class _Stream:
    """The launcher's stdout or stderr as it is at the launch, handed to the rank (a forked
    rank holds the fork server's, which are the launcher's of an earlier moment)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_received, (reduction.DupFd(self.fd),))


def _received(duplicate) -> int:
    return duplicate.detach()


def _open_streams() -> list[_Stream | None]:
    def is_open(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return False
        return True

    return [_Stream(fd) if is_open(fd) else None for fd in (1, 2)]


def _worker(fn, rank, world, ranks_per_node, port, pg_timeout_s, args, results, env,
            parent_pid, backend, device, where):
    die_with_parent(parent_pid)
    cwd, path, environ, streams = where
    for fd, received in zip((1, 2), streams, strict=True):
        if received is not None and received != fd:
            os.dup2(received, fd)
            os.close(received)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_node),
        "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(RANK_THREADS)
    try:
        if backend == "nccl" or device == "cuda":
            # ranks round-robin over the visible GPUs (several share one over Gloo)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn = _resolve(fn)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        value = fn(rank, world, *args)
        # the queue pickles on a feeder thread, which only prints what it cannot send:
        # a value that cannot travel is this rank's error, told here
        pickle.dumps(value)
        results.put((rank, "ok", value))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with its traceback
        kind = "bad_input" if isinstance(e, InputError) else "error"
        results.put((rank, kind, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with suppress(Exception):  # already failing or exiting
                dist.destroy_process_group()
        # a forked rank ends in os._exit, which skips the exit handlers a spawned one runs
        # (commpress's wait for Gloo's workers among them): run them here, once
        atexit._run_exitfuncs()


# a rank that exited 0 has put its result before exiting; the queue's pipe delivers it
# within this long, or it never will (its function ended the process with os._exit)
RESULT_GRACE_S = 3.0


def _note_silent_exits(procs: list, values: dict, errors: dict,
                       exited: dict[int, float]) -> None:
    """Name the ranks whose process is gone without a result: one that exited non-zero
    died (killed, a segfault); one that exited 0 and whose result has not come within
    :data:`RESULT_GRACE_S` never sent one (``os._exit`` in the function)."""
    now = time.monotonic()
    for r, p in enumerate(procs):
        if r in values or r in errors or p.is_alive():
            continue
        if p.exitcode not in (0, None):
            errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
        elif now - exited.setdefault(r, now) > RESULT_GRACE_S:
            errors[r] = (f"rank {r} exited (code 0) without a result: its function ended "
                         "the process itself (os._exit) before returning")


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    ranks_per_node: int | None = None,
    timeout: float = 300.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    allow_errors: bool = False,
    backend: str = "gloo",
    device: str = "cpu",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``nprocs`` ranks; return the values by rank.

    ``fn`` must be importable (a module-level function). With ``allow_errors`` a failed
    rank's entry is the :class:`LaunchError` instead of raising (for fault tests).
    ``backend="nccl"`` (or ``device="cuda"`` with Gloo) gives rank ``r`` the GPU
    ``r mod (visible GPUs)`` as its current device; NCCL needs one GPU per rank. ``fn``
    gets the device type among its ``args`` where it needs one.
    """
    if nprocs < 1:
        raise InputError(f"nprocs={nprocs} is not allowed; allowed: >= 1")
    rpn = ranks_per_node or nprocs
    if nprocs % rpn:
        raise InputError(f"nprocs={nprocs} is not divisible by ranks_per_node={rpn}")
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        raise LaunchError("the launcher's working directory no longer exists (it was "
                          "removed after the launcher started): cd to an existing "
                          "directory and launch again", bad_input=True) from None
    ctx = _context(fn)
    results = ctx.Queue()
    port = free_port()
    if backend not in ("gloo", "nccl"):
        raise InputError(f"backend={backend!r} is not allowed; allowed: gloo, nccl")
    if device not in ("cpu", "cuda"):
        raise InputError(f"device={device!r} is not allowed; allowed: cpu, cuda")
    where = (cwd, list(sys.path), dict(os.environ), _open_streams())
    procs = [ctx.Process(target=_worker, args=(_by_name(fn), r, nprocs, rpn, port,
                                               pg_timeout_s, args, results, env or {},
                                               os.getpid(), backend, device, where),
                         daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    bad_input: set[int] = set()
    exited: dict[int, float] = {}  # rank → when it was first seen gone without a result
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(nprocs)) - set(values) - set(errors))
                raise LaunchError(f"ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                _note_silent_exits(procs, values, errors, exited)
            else:
                (values if status == "ok" else errors)[rank] = value
                if status == "bad_input":
                    bad_input.add(rank)
            if errors and not allow_errors:
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors and not allow_errors:
        rank = min(errors)
        raise LaunchError(f"rank {rank} failed: {errors[rank]}", bad_input=rank in bad_input)
    return [values.get(r, LaunchError(errors.get(r, "no result"))) for r in range(nprocs)]
