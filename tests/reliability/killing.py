"""A rank killed by its process id in the middle of a training step, in any training loop.

The victim SIGKILLs itself at a point of its step the loop chooses (after its forward
pass: the others are then inside the step's collectives, waiting for it). What is
asserted of every engine: no survivor waits past the group's timeout, each raises, and
its message names the dead rank.
"""

import os
import re
import signal
import time
from collections.abc import Callable

from commpress.launch import LaunchError


class Killer:
    """Call :meth:`mid_step` in each step where the victim should die (the first call at
    ``at_step`` kills it)."""

    def __init__(self, rank: int, victim: int, at_step: int) -> None:
        self.rank, self.victim, self.at_step = rank, victim, at_step
        self.killed_at: float | None = None

    def mid_step(self, step: int) -> None:
        if step == self.at_step and self.killed_at is None:
            if self.rank == self.victim:
                os.kill(os.getpid(), signal.SIGKILL)
            self.killed_at = time.monotonic()

    def survive(self, loop: Callable[[], object]) -> dict:
        """Run ``loop`` (which trains until it fails) → how this survivor ended."""
        try:
            loop()
        except Exception as e:  # noqa: BLE001 - the survivor's outcome is the result
            since = None if self.killed_at is None else time.monotonic() - self.killed_at
            return {"error": f"{type(e).__name__}: {e}", "seconds": since}
        return {"error": None, "seconds": None}


def assert_survivors_name_the_dead_rank(results: list, victim: int, timeout_s: float,
                                        naming: set[int] | None = None) -> None:
    """The victim died by SIGKILL; every other rank raised within ``timeout_s`` + 10 s of
    the kill, the ranks of ``naming`` (default: all) with a message naming the victim —
    the others (with sub-groups: ranks that wait for a survivor that failed first) name
    the rank they waited for."""
    assert isinstance(results[victim], LaunchError), results[victim]
    assert "exited with code -9" in str(results[victim])
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert result["error"] is not None, (rank, result)
        # "ranks [...] never reached it" (an agreement) or "never finished it" (a transfer;
        # a survivor stuck elsewhere past the grace period is listed beside the dead rank)
        missing = re.search(r"ranks \[([\d, ]*)\] never", result["error"])
        assert missing is not None, (rank, result["error"])
        if naming is None or rank in naming:
            assert victim in [int(r) for r in missing.group(1).split(",")], (rank, result)
        assert result["seconds"] is not None and result["seconds"] <= timeout_s + 10, (
            rank, result)
