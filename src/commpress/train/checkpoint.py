"""Checkpoints of the reference trainer: one file per rank, a manifest, verified on load.

Layout::

    DIR/ckpt/step_000100/rank00000.pt …   one file per rank
    DIR/ckpt/step_000100/manifest.json    the run's identity and every file's SHA-256
    DIR/ckpt/latest                       the newest complete step (for people and tools)

Each rank file is written to a temporary name while its SHA-256 is computed, fsynced,
then renamed; rank 0 writes the manifest (itself checksummed) once every rank has
written, and only then ``latest``: ``latest`` is the commit point of a save. A save that
fails on any rank (a full disk) fails on every rank together, its temporary and
partial files removed, and names the checkpoint kept. On load every file is checked
against the manifest — one flipped byte anywhere is refused — and the manifest's
structure, then its identity (model, layout, policy, dtype, ranks per node, data
fingerprint, …) against the run. Only regular files are read, each no longer than its
manifest (or, for the manifest, :data:`MAX_MANIFEST_BYTES`) says.

Resuming from a run directory takes the newest step at or below ``latest`` whose
manifest verifies, so an interrupted save falls back to the checkpoint before, and the
steps of an abandoned branch (a run resumed from an older step that then saved, moving
``latest`` back) are never resumed. The first save of such a run moves the steps it
supersedes aside, to ``ckpt/retired/``, and says so. Without a usable ``latest`` (empty,
garbage) the newest verified step is taken. Files load with ``weights_only=True``: no
pickled code runs. Temporary files that a killed run left behind are removed before the
next save.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
from contextlib import suppress
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives.agreement import all_gather_objects
from commpress.files import atomic_save, atomic_text, open_regular, read_regular
from commpress.validate import InputError, raise_if_any

log = logging.getLogger(__name__)

FORMAT = "commpress.train/2"
MANIFEST = "manifest.json"
LATEST = "latest"
RETIRED = "retired"
# a manifest lists ~150 bytes per rank file: a million ranks fit in 256 MiB
MAX_MANIFEST_BYTES = 256 << 20
_STEP_DIR = re.compile(r"step_(\d{6,})$")
_RANK_NAME = re.compile(r"rank\d{5,}\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(InputError):
    """A checkpoint is missing, corrupt, belongs to another run, or cannot be written."""


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "ckpt", f"step_{step:06d}")


def rank_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def rank_file(run_dir: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(run_dir, step), rank_name(rank))


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete ``*.tmp.*`` files under ``run_dir/ckpt`` left by killed runs (only one run
    holds a run directory at a time, so no live writer owns them)."""
    removed = []
    for path in glob.glob(os.path.join(run_dir, "ckpt", "**", "*.tmp.*"), recursive=True):
        if not path.endswith(f".tmp.{os.getpid()}"):
            with suppress(OSError):
                os.remove(path)
                removed.append(path)
    return removed


def _manifest_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(run_dir: str, step: int, identity: dict[str, Any],
                   files: dict[str, dict[str, Any]]) -> None:
    """Record the step's files and the run's identity, then move ``latest`` (rank 0,
    after every rank has written its file)."""
    body = {"format": FORMAT, "step": step, "identity": identity, "files": files}
    manifest = dict(body, sha256=_manifest_digest(body))
    atomic_text(os.path.join(step_dir(run_dir, step), MANIFEST),
                 json.dumps(manifest, indent=1, sort_keys=True))
    atomic_text(os.path.join(run_dir, "ckpt", LATEST), f"{step}\n")


def read_manifest(directory: str) -> dict[str, Any]:
    """A step directory's manifest, checked against its own checksum (a regular file of
    at most :data:`MAX_MANIFEST_BYTES`)."""
    path = os.path.join(directory, MANIFEST)
    try:
        manifest = json.loads(read_regular(path, MAX_MANIFEST_BYTES, "checkpoint manifest",
                                           CheckpointError))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory!r} is incomplete: no {MANIFEST} (the "
                              "save was interrupted)") from None
    except CheckpointError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a commpress checkpoint manifest (expected "
                              f"format {FORMAT!r})")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != _manifest_digest(body):
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted (its checksum does "
                              "not match its contents)")
    _check_structure(path, manifest)
    match = _STEP_DIR.search(os.path.normpath(directory))
    if match and int(match.group(1)) != manifest["step"]:
        raise CheckpointError(f"checkpoint manifest {path!r}: field 'step' is "
                              f"{manifest['step']}, but it lies in {os.path.basename(directory)}"
                              "; allowed: the step of its directory")
    return manifest


_MISSING = object()


def _check_structure(path: str, manifest: dict[str, Any]) -> None:
    """Refuse a manifest (its checksum valid) whose fields are not what a save writes,
    naming the first such field."""
    def refuse(field: str, value: Any, allowed: str) -> CheckpointError:
        shown = "missing" if value is _MISSING else f"{value!r:.80}"
        return CheckpointError(f"checkpoint manifest {path!r}: field {field!r} is {shown}; "
                               f"allowed: {allowed}")

    def is_count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    step = manifest.get("step", _MISSING)
    if not is_count(step):
        raise refuse("step", step, "a step number >= 0")
    identity = manifest.get("identity", _MISSING)
    if not isinstance(identity, dict):
        raise refuse("identity", identity, "an object (the run's model, layout, policy, …)")
    files = manifest.get("files", _MISSING)
    if not (isinstance(files, dict) and files and all(_RANK_NAME.fullmatch(n) for n in files)):
        raise refuse("files", files, "a non-empty object from rank file names (rank00000.pt, "
                     "…) to {sha256, bytes}")
    for name, entry in files.items():
        if not isinstance(entry, dict):
            raise refuse(f"files.{name}", entry, "an object {sha256, bytes}")
        size = entry.get("bytes", _MISSING)
        if not is_count(size):
            raise refuse(f"files.{name}.bytes", size, "a byte count >= 0")
        sha = entry.get("sha256", _MISSING)
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise refuse(f"files.{name}.sha256", sha, "64 lowercase hexadecimal digits")


def _is_step_dir(path: str) -> bool:
    return (os.path.exists(os.path.join(path, MANIFEST))
            or bool(_STEP_DIR.search(os.path.normpath(path))))


def _steps(run_dir: str) -> list[tuple[int, str]]:
    """``(step, directory)`` of every step directory under ``run_dir/ckpt``, newest first."""
    return sorted(((int(m.group(1)), d) for d in glob.glob(os.path.join(run_dir, "ckpt",
                                                                        "step_*"))
                   if (m := _STEP_DIR.search(d))), reverse=True)


def _latest(run_dir: str) -> tuple[int | None, str | None]:
    """The step ``run_dir/ckpt/latest`` names; or None and why it cannot be used (None,
    None: there is none)."""
    path = os.path.join(run_dir, "ckpt", LATEST)
    try:
        text = read_regular(path, 64, "checkpoint pointer", CheckpointError).decode()
    except FileNotFoundError:
        return None, None
    except (CheckpointError, OSError, UnicodeDecodeError) as e:
        return None, f"{path!r} cannot be read ({e}); the newest complete step is used"
    if not re.fullmatch(r"[0-9]+", text.strip()):
        return None, (f"{path!r} holds {text.strip()[:20]!r}, not a step number; the newest "
                      "complete step is used")
    return int(text), None


def find(path: str) -> tuple[str, list[str]]:
    """The step directory to resume from — ``path`` itself (or the step directory of a
    file in one), or the newest step under a run directory at or below its ``latest``
    whose manifest verifies — and why newer steps were passed over."""
    if not os.path.exists(path):
        raise CheckpointError(f"--resume {path!r} does not exist; allowed: a run directory or "
                              "a checkpoint step directory")
    if not os.path.isdir(path):
        directory = os.path.dirname(os.path.abspath(path))
        if not (os.path.isfile(path) and _is_step_dir(directory)):
            kind = "a file" if os.path.isfile(path) else "neither a directory nor a file"
            raise CheckpointError(f"--resume {path!r} is {kind}, not a checkpoint; allowed: a "
                                  "run directory, a checkpoint step directory, or a file in "
                                  "one")
        path = directory
    if _is_step_dir(path):
        return path, []
    steps = _steps(path)
    latest, problem = _latest(path)
    problems = [problem] if problem else []
    if latest is not None:
        newer = sorted(step for step, _ in steps if step > latest)
        if newer:
            problems.append(f"step{'s' * (len(newer) > 1)} {', '.join(map(str, newer))} "
                            f"{'are' if len(newer) > 1 else 'is'} newer than {LATEST} (step "
                            f"{latest}): an abandoned branch or an unfinished save, not resumed")
        steps = [(step, d) for step, d in steps if step <= latest]
    for _, directory in steps:
        try:
            read_manifest(directory)
            return directory, problems
        except CheckpointError as e:
            problems.append(str(e))
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(f"--resume {path!r} holds no complete checkpoint{detail}")


def retire_superseded(run_dir: str, step: int) -> list[str]:
    """Move the step directories at or after ``step`` aside, to ``ckpt/retired/``: a run
    about to save ``step`` while they exist resumed from an older step, so they belong to
    an abandoned branch (or to a save that did not finish). Returns where they went."""
    moved = []
    for number, directory in _steps(run_dir):
        if number < step:
            break
        target = os.path.join(run_dir, "ckpt", RETIRED, os.path.basename(directory))
        free, n = target, 0
        while os.path.lexists(free):  # an earlier rollback retired this step already
            n += 1
            free = f"{target}.{n}"
        os.makedirs(os.path.dirname(free), exist_ok=True)
        os.rename(directory, free)
        moved.append(free)
    if moved:
        log.warning("saving step %d: the checkpoints at or after it are another branch's (this "
                    "run resumed from an older step); moved aside to %s: %s", step,
                    os.path.join(run_dir, "ckpt", RETIRED),
                    ", ".join(os.path.basename(m) for m in moved))
    return moved


def check_identity(directory: str, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Refuse a checkpoint of another run, naming the first field that differs."""
    if saved.get("world") != mine.get("world"):
        raise CheckpointError(f"checkpoint {directory!r} was written by {saved.get('world')} "
                              f"ranks; this run has {mine.get('world')}: resume with the same "
                              "layout")
    for key in mine:
        if saved.get(key) != mine[key]:
            raise CheckpointError(f"checkpoint {directory!r} has {key}={saved.get(key)!r}, this "
                                  f"run {key}={mine[key]!r}; resume with the same value")


def verify_file(directory: str, manifest: dict[str, Any], rank: int) -> str:
    """This rank's file, checked against the manifest's size (before it is read) and
    SHA-256."""
    name = rank_name(rank)
    entry = manifest["files"].get(name)
    path = os.path.join(directory, name)
    if entry is None:
        raise CheckpointError(f"checkpoint {directory!r} has no file for rank {rank} (it was "
                              f"written by {len(manifest['files'])} ranks)")
    try:
        f, size = open_regular(path, "checkpoint file", CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path!r} is missing") from None
    with f:
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {path!r} holds {size} bytes; its manifest "
                                  f"says {entry['bytes']}: it is truncated or not this "
                                  "checkpoint's")
        sha, left = hashlib.sha256(), size
        while left and (block := f.read(min(left, 1 << 20))):
            sha.update(block)
            left -= len(block)
    if left or sha.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path!r} is corrupted: its SHA-256 does not "
                              "match the manifest")
    return path


def _gathered(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """``obj`` of every rank of ``group``, in rank order (``[obj]`` without a group)."""
    return [obj] if group is None else all_gather_objects(obj, group, "checkpoint")


def _save_failure(run_dir: str, step: int, error: OSError) -> str:
    """Why step ``step`` was not saved, and which checkpoint is kept."""
    try:
        kept = f"the last complete checkpoint, {find(run_dir)[0]!r}, is kept"
    except CheckpointError:
        kept = "no complete checkpoint is kept"
    return (f"cannot save checkpoint step {step}: {error.strerror or error} writing "
            f"{error.filename!r}; {kept}")


def save_step(run_dir: str, step: int, rank: int, state: dict[str, Any],
              identity: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Save checkpoint ``step``: every rank of ``group`` its file, rank 0 the manifest and
    ``latest`` (``group`` None: one process, rank 0).

    A write that fails on any rank (a full disk, a quota) raises :class:`CheckpointError`
    on every rank together, naming the file and the checkpoint kept; the step's files
    are removed.
    """
    directory = step_dir(run_dir, step)
    # Step 1: rank 0 moves aside what this step supersedes, before any rank writes into it
    problem = None
    if rank == 0:
        try:
            retire_superseded(run_dir, step)
        except OSError as e:
            problem = _save_failure(run_dir, step, e)
    raise_if_any(_gathered(problem, group), rank, "cannot save", CheckpointError)
    # Step 2: every rank writes its file
    written, problem = None, None
    try:
        written = atomic_save(state, rank_file(run_dir, step, rank))
    except OSError as e:
        problem = _save_failure(run_dir, step, e)
    results = _gathered((written, problem), group)
    if rank == 0 and any(p is not None for _, p in results):
        shutil.rmtree(directory, ignore_errors=True)  # every rank is done writing
    raise_if_any([p for _, p in results], rank, "cannot save", CheckpointError)
    # Step 3: rank 0 writes the manifest, then `latest` (the commit point)
    if rank == 0:
        try:
            write_manifest(run_dir, step, identity,
                           {rank_name(r): info for r, (info, _) in enumerate(results)})
        except OSError as e:
            shutil.rmtree(directory, ignore_errors=True)
            problem = _save_failure(run_dir, step, e)
    raise_if_any(_gathered(problem, group), rank, "cannot save", CheckpointError)


def load_agreed(path: str, identity: dict[str, Any], rank: int,
                group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Rank ``rank``'s verified state from ``path`` (a run or step directory); if any rank
    of ``group`` cannot resume, every rank raises :class:`CheckpointError` together (the
    first rank's reason, naming the others)."""
    state, problem = _read_verified(path, identity, rank, warn=rank == 0)
    raise_if_any(_gathered(problem, group), rank, "cannot resume", CheckpointError)
    return state


def _read_verified(path: str, identity: dict[str, Any], rank: int,
                   warn: bool) -> tuple[dict[str, Any] | None, str | None]:
    """Rank ``rank``'s state from ``path``, its file checked against the manifest and the
    manifest's identity against ``identity``; or None and why it cannot be used.
    ``warn``: log newer checkpoints that were passed over."""
    try:
        directory, passed_over = find(path)
        if passed_over and warn:
            log.warning("resuming from %s; passed over: %s", directory,
                        "; ".join(passed_over))
        manifest = read_manifest(directory)
        check_identity(directory, manifest["identity"], identity)
        return load(verify_file(directory, manifest, rank)), None
    except CheckpointError as e:
        return None, str(e)


def load(path: str) -> dict[str, Any]:
    """Load a (verified) rank file; a truncated or foreign file is a clear error."""
    try:
        f, _ = open_regular(path, "checkpoint file", CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path!r} is missing") from None
    with f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
            raise CheckpointError(f"checkpoint file {path!r} is corrupted or truncated: "
                                  f"{type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a commpress training checkpoint "
                              f"(expected format {FORMAT!r})")
    return state
