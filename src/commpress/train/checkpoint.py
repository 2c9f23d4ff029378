"""Checkpoints of the reference trainer: one file per rank, written atomically.

Layout: ``DIR/ckpt/step_000100/rank00003.pt`` and ``DIR/ckpt/latest`` (a text file
naming the newest complete step). Each file is written to a temporary name, fsynced,
then renamed, so a crash never leaves a half-written checkpoint under the real name;
``latest`` moves only after every rank has written (the caller barriers first).
Files are loaded with ``weights_only=True``: no pickled code runs on load.
"""

from __future__ import annotations

import os
from typing import Any

import torch

FORMAT = "commpress.train/1"


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "ckpt", f"step_{step:06d}")


def rank_file(run_dir: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(run_dir, step), f"rank{rank:05d}.pt")


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_latest(run_dir: str, step: int) -> None:
    path = os.path.join(run_dir, "ckpt", "latest")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
    os.replace(tmp, path)


def resolve(path: str, rank: int) -> str:
    """The rank's checkpoint file from a run directory, a step directory or a rank file."""
    if not os.path.exists(path):
        raise ValueError(f"--resume {path!r} does not exist; allowed: a run directory, a "
                         "checkpoint step directory or a rank file")
    if os.path.isfile(path):
        if rank != 0 and "rank" in os.path.basename(path):
            return os.path.join(os.path.dirname(path), f"rank{rank:05d}.pt")
        return path
    latest = os.path.join(path, "ckpt", "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read().strip())
        return rank_file(path, step, rank)
    candidate = os.path.join(path, f"rank{rank:05d}.pt")
    if os.path.exists(candidate):
        return candidate
    raise ValueError(f"--resume {path!r} holds no checkpoint (no ckpt/latest, no rank files)")


def load(path: str) -> dict[str, Any]:
    """Load and check a rank file; a truncated or foreign file is a clear error."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path!r} is missing (was the run saved with this "
                         "many ranks?)") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise ValueError(f"checkpoint file {path!r} is corrupted or truncated: "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a commpress training checkpoint "
                         f"(expected format {FORMAT!r})")
    return state
