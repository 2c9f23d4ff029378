"""How a run that ran to its end can still have failed."""

from __future__ import annotations

from typing import Any


class RunFailedError(RuntimeError):
    """The run ended but trained nothing (every step skipped); ``summary`` is what it
    wrote (metrics and summary are on disk for the diagnosis). The CLI prints the
    message as one line and exits 1."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.summary = summary
