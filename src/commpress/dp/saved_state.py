"""A holder's saved codec state: one envelope, one check on resume, agreed by every rank.

Every live holder of data-parallel codec state — the DDP hook, DiLoCo, the sharded
optimizer and the DeepSpeed, FSDP2 and Megatron adapters — saves
``{"format", "policy", "rank", "world_size", ...its own fields}`` (:func:`envelope`)
and resumes through :func:`check_resume`: the format, the policy and the holder's own
fields must match this run's, and so must the rank and the world size unless the
resume is elastic. Error-feedback memory and rounding streams are each rank's own, laid
out for the world that saved them: an elastic resume from another rank or world starts
them fresh, said once. A holder with a group resumes through :func:`on_every_rank`: a
state one rank refuses is refused on every rank (a loop that saved rank 0's state alone
and loads it everywhere), rather than the others training on into a collective the
refusing rank never reaches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from commpress.collectives.agreement import all_gather_objects
from commpress.collectives.comm import rank_in
from commpress.dp.grad_path import say_once
from commpress.policy import Policy
from commpress.validate import InputError, check_saved_state, raise_if_any

T = TypeVar("T")

log = logging.getLogger(__name__)


def envelope(fmt: str, policy: Policy, rank: int, world_size: int,
             **fields: Any) -> dict[str, Any]:
    """A saved state of format ``fmt``: the policy, whose rank of how many ranks saved it,
    and the holder's ``fields``."""
    return {"format": fmt, "policy": policy.to_dict(), "rank": rank, "world_size": world_size,
            **fields}


def check_resume(state: object, fmt: str, what: str, policy: Policy, rank: int,
                 world_size: int, elastic: bool, advice: str,
                 fields: dict[str, Any] | None = None,
                 views: dict[str, Callable] | None = None,
                 formats: dict[str, str] | None = None) -> bool:
    """Refuse ``state`` unless it is an :func:`envelope` of format ``fmt`` with this
    run's policy and ``fields`` (read through ``views[key]`` where given) and, unless
    ``elastic``, this rank and world size; the message names the first field that
    differs, both values and ``advice`` (``formats``: what other known formats are).
    Returns whether the per-rank memory applies: False for an elastic resume from another
    rank or world (said once, on rank 0)."""
    mine = {"world_size": world_size, "rank": rank}  # another world is named first
    check_saved_state(state, fmt, what, {"policy": policy.to_dict(),
                                         **({} if elastic else mine), **(fields or {})},
                      advice, views, formats)
    saved = {k: state.get(k) for k in mine}
    if saved == mine:
        return True
    if saved["world_size"] != world_size:  # every rank alike: said once, on rank 0
        whose, teller = f"saved on {saved['world_size']} ranks on {world_size}", rank
        by = "world"
    else:  # this rank took another's state: said by this rank
        whose, teller, by = f"of rank {saved['rank']} on rank {rank} (elastic)", 0, "rank"
    say_once(log, ("resized", what, saved["world_size"], world_size, saved["rank"], rank),
             teller, "%s: resuming state %s: error-feedback memory and rounding streams "
             "start fresh (they were laid out for the %s that saved them)", what, whose, by)
    return False


def on_every_rank(group: dist.ProcessGroup | None, what: str, check: Callable[[], T]) -> T:
    """``check()`` (a resume's checks, before anything is restored) on every rank of
    ``group``, its verdict agreed: if any rank refuses, every rank raises the first
    refusing rank's reason, naming the others. Every rank of the group must call it, as it
    calls the holder's ``load_state_dict``. Without a group (one process), ``check()``."""
    problem, value = None, None
    try:  # whatever is wrong with the state, every rank must still reach the gather
        value = check()
    except InputError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - a malformed state: refused on every rank
        problem = f"{what}: the saved state is malformed ({type(e).__name__}: {e})"
    if group is not None and dist.is_initialized() and group.size() > 1:
        raise_if_any(all_gather_objects(problem, group, f"{what} resume"), rank_in(group),
                     "refused it")
    elif problem is not None:
        raise InputError(problem)
    return value  # type: ignore[return-value]
