"""Each rank's codec state in a file of its own, beside an engine's checkpoint.

An engine checkpoints the weights its own way; commpress's state — error-feedback
memory, rounding counters, qWD references — is each rank's own, so each rank writes a
file. A file is written whole or not at all (a temporary file, synced, then renamed:
a rank killed mid-save leaves the previous file), and begins with a header line
naming its format, the SHA-256 and length of what follows, and the rank and world size
that wrote it. On load a missing, truncated or flipped file, or one another rank wrote,
is refused; and since ranks that resumed different states would train apart, a rank
that cannot load makes every rank of the group raise together, naming its file.

Layout: ``commpress.rank-state/1 {"sha256": ..., "bytes": N, "rank": r, "world_size": w}\\n``
then the ``N`` bytes of ``torch.save(state)``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives.agreement import all_gather_objects
from commpress.dp.grad_path import say_once
from commpress.files import open_regular, replacing
from commpress.validate import InputError, raise_if_any

log = logging.getLogger(__name__)

MAGIC = b"commpress.rank-state/1 "
MAX_HEADER_BYTES = 4096


def save(state: dict[str, Any], path: str, group: dist.ProcessGroup | None = None,
         what: str = "commpress") -> None:
    """Write this rank's ``state`` to ``path`` (every rank of ``group``, default the world,
    calls it together, each with its own path); a write that fails on any rank (a full
    disk) raises :class:`InputError` on every rank, naming the file. ``what`` names the
    state in messages (``"commpress.deepspeed"``).

    ``commpress.save_rank_state``: beside a checkpoint that rank 0 alone writes (a
    nanoGPT-style loop), each rank's codec state::

        commpress.save_rank_state(hook_state.state_dict(), f"{out}/commpress-rank{rank}.pt")
        hook_state.load_state_dict(commpress.load_rank_state(f"{out}/commpress-rank{rank}.pt"))
    """
    rank, world = _rank_world(group)
    problem = None
    try:  # whatever fails here, every rank must still reach the gather below
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        header = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload),
                  "rank": rank, "world_size": world}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with replacing(path, "wb") as f:
            f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(payload)
    except OSError as e:
        problem = f"{what}: cannot write {path!r}: {e.strerror or e}"
    except Exception as e:  # noqa: BLE001 - reported on every rank
        problem = f"{what}: cannot save {path!r}: {type(e).__name__}: {e}"
    raise_if_any(all_gather_objects(problem, group, f"{what} save"), rank, "cannot save")


def load(path: str, group: dist.ProcessGroup | None = None, what: str = "commpress",
         missing: str = "resume from a checkpoint saved with commpress",
         other_world: str = "") -> dict[str, Any]:
    """This rank's state from ``path``, checked against its header; if any rank of
    ``group`` cannot load its file, every rank raises :class:`InputError` together.
    ``missing``: the advice given when the file does not exist; ``other_world``: when
    another rank or world wrote it."""
    return _load(path, group, what, missing, other_world, own=True)[0]


def file_of(checkpoint: str | os.PathLike, rank: int | None = None,
            beside: bool = False) -> str:
    """Rank ``rank``'s (default this process's) file of an engine's checkpoint:
    ``<checkpoint>/commpress-rank<r>.pt`` in a checkpoint directory, or with ``beside``
    ``<checkpoint>.commpress-rank<r>.pt`` next to a checkpoint file. Ranks are global:
    every rank saves, even where ranks of a model-parallel group hold the same state."""
    rank = _rank_world(None)[0] if rank is None else rank
    checkpoint = os.fspath(checkpoint)
    if beside:
        return f"{checkpoint}.commpress-rank{rank}.pt"
    return os.path.join(checkpoint, f"commpress-rank{rank}.pt")


def save_in(state: dict[str, Any], checkpoint: str | os.PathLike, what: str,
            beside: bool = False) -> None:
    """What an engine adapter does when its engine saves ``checkpoint``: :func:`save`
    this rank's ``state`` to its :func:`file_of` (every rank of the world together)."""
    save(state, file_of(checkpoint, beside=beside), None, what)


def resume_from(checkpoint: str | os.PathLike, what: str, missing: str, elastic: bool,
                elastic_option: str, beside: bool = False) -> dict[str, Any] | None:
    """What an engine adapter does when its engine loads ``checkpoint``: this rank's
    state from its :func:`file_of`, or with ``elastic`` :func:`load_elastic`'s (rank 0's
    file stands for every rank's when another world saved it; None when the checkpoint
    holds none: a run saved without commpress, which it is now added to). ``elastic_option``
    says how the user asks for an elastic resume (named when a file of another world, or
    none, is refused)."""
    mine, first = file_of(checkpoint, beside=beside), file_of(checkpoint, 0, beside)
    if elastic:
        return load_elastic(mine, first, None, what, missing)
    # a checkpoint of a run without commpress is resumed as an elastic one: fresh codecs
    missing = (f"{missing}; to add commpress to a run whose checkpoints were saved without "
               f"it: {elastic_option} (the codecs start fresh)")
    return load(mine, None, what, missing,
                other_world=f"on another number of ranks: {elastic_option}")


def load_elastic(path: str, first: str, group: dist.ProcessGroup | None = None,
                 what: str = "commpress", missing: str = "resume from a checkpoint saved "
                 "with commpress") -> dict[str, Any] | None:
    """An elastic resume's state: ``first`` (rank 0's file, read by every rank, verified)
    when another world wrote it — it then stands for every rank's, whose memory would not
    apply anyway, and a new rank has no file of its own —, else this rank's own from
    ``path``. None, said once, when no rank has ``first``: a checkpoint without commpress's
    state (a universal or resharded copy of one); the codecs then start fresh."""
    rank, world = _rank_world(group)
    if not any(all_gather_objects(os.path.exists(first), group, f"{what} elastic load")):
        say_once(log, ("no state", what, first), rank, "%s: no commpress state beside the "
                 "checkpoint (%s is missing): error-feedback memory and rounding streams "
                 "start fresh", what, first)
        return None
    state, saved = _load(first, group, what, missing, "", own=False)
    if saved[1] != world:
        return state
    return load(path, group, what, missing)


def _load(path: str, group: dist.ProcessGroup | None, what: str, missing: str,
          other_world: str, own: bool) -> tuple[dict[str, Any], tuple[Any, Any]]:
    """The state in ``path`` and the (rank, world size) that wrote it; ``own``: refuse
    another rank's or world's. Every rank of ``group`` raises together if any cannot."""
    rank, world = _rank_world(group)
    loaded, problem = (None, None), None
    try:  # whatever fails here, every rank must still reach the gather below
        loaded = _read(path, (rank, world) if own else None, what, missing, other_world)
    except InputError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - a file that cannot be read, reported everywhere
        problem = f"{what}: cannot read {path!r}: {type(e).__name__}: {e}"
    raise_if_any(all_gather_objects(problem, group, f"{what} load"), rank, "cannot resume")
    return loaded


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank and the world size (one process without torch.distributed: 0 of 1)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _read(path: str, identity: tuple[int, int] | None, what: str, missing: str,
          other_world: str) -> tuple[dict[str, Any], tuple[Any, Any]]:
    try:
        f, size = open_regular(path, f"{what} state file")
    except FileNotFoundError:
        raise InputError(f"{what}: state file {path!r} is missing: the checkpoint was saved "
                         f"without commpress's state (or by fewer ranks); {missing}") from None
    with f:
        line = f.readline(MAX_HEADER_BYTES)
        if not line.startswith(MAGIC) or not line.endswith(b"\n"):
            raise InputError(f"{what}: {path!r} is not a commpress rank-state file (expected "
                             f"it to begin with {MAGIC.decode().strip()!r})")
        try:
            header = json.loads(line[len(MAGIC):])
            expected = int(header["bytes"])
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{what}: {path!r} has a corrupt header") from None
        if size - len(line) != expected:
            raise InputError(f"{what}: {path!r} is truncated or corrupted: it holds "
                             f"{size - len(line)} bytes of state, its header says {expected}")
        payload = f.read(expected)
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise InputError(f"{what}: {path!r} is corrupted: its SHA-256 does not match its "
                         "header")
    saved = (header.get("rank"), header.get("world_size"))
    if identity is not None and saved != identity:
        raise InputError(f"{what}: {path!r} was written by rank {saved[0]} of {saved[1]}; "
                         f"this is rank {identity[0]} of {identity[1]}: each rank resumes "
                         "from its own file, with the same number of ranks"
                         + (f"; {other_world}" if other_world else ""))
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True), saved
