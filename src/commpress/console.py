"""One rich console for tables and progress; wide enough for tables when piped."""

from __future__ import annotations

import functools
import sys

from rich.console import Console


@functools.cache
def console(stderr: bool = False) -> Console:
    # no fixed file: rich then writes to whatever sys.stdout/stderr is at print time
    # (pytest and notebooks swap them)
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, width=width)
