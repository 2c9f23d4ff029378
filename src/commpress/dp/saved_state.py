"""A holder's saved codec state: one envelope, one check on resume.

Every live holder of data-parallel codec state — the DDP hook, DiLoCo, the sharded
optimizer and the DeepSpeed, FSDP2 and Megatron adapters — saves
``{"format", "policy", "rank", "world_size", ...its own fields}`` (:func:`envelope`)
and resumes through :func:`check_resume`: the format, the policy and the holder's own
fields must match this run's, and so must the rank and the world size unless the
resume is elastic. Error-feedback memory and rounding streams are each rank's own, laid
out for the world that saved them: an elastic resume from another rank or world starts
them fresh, said once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from commpress.dp.grad_path import say_once
from commpress.policy import Policy
from commpress.validate import check_saved_state

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
                 views: dict[str, Callable] | None = None) -> bool:
    """Refuse ``state`` unless it is an :func:`envelope` of format ``fmt`` with this
    run's policy and ``fields`` (read through ``views[key]`` where given) and, unless
    ``elastic``, this rank and world size; the message names the first field that
    differs, both values and ``advice``. Returns whether the per-rank memory applies:
    False for an elastic resume from another rank or world (said once, on rank 0)."""
    mine = {"world_size": world_size, "rank": rank}  # another world is named first
    check_saved_state(state, fmt, what, {"policy": policy.to_dict(),
                                         **({} if elastic else mine), **(fields or {})},
                      advice, views)
    saved = {k: state.get(k) for k in mine}
    if saved == mine:
        return True
    say_once(log, ("resized", what, saved["world_size"], world_size), rank,
             "%s: resuming state saved on %s ranks on %s: error-feedback memory and "
             "rounding streams start fresh (they were laid out for the world that saved "
             "them)", what, saved["world_size"], world_size)
    return False
