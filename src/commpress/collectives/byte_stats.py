"""Byte and time accounting per label, for every compressed collective.

``elements`` and ``wire_bytes`` count what this rank sent to *other* ranks (what
crosses the network), so ``8 * wire_bytes / elements`` is bits per element on the
wire; ``raw_bytes`` is what those elements occupy uncompressed in their own dtype.
Times are wall-clock seconds on this rank: on CUDA they cover kernel launches unless
``COMMPRESS_SYNC_TIMING=1`` makes each phase synchronize first.

Each process group's context holds its own :class:`Stats` (the DDP hook's thread and
the main thread may write at once: a lock guards them); :func:`commpress.stats`, beside
the contexts (:mod:`commpress.collectives.agreement`), sums every live group's counters
and those of groups already destroyed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FIELDS = ("calls", "elements", "raw_bytes", "wire_bytes", "encode_s", "decode_s", "comm_s")


class Stats:
    """Thread-safe counters by label."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[str, float]] = {}

    def record(self, label: str, **amounts: float) -> None:
        """Add ``amounts`` (keys from :data:`FIELDS`) to ``label``'s counters."""
        with self._lock:
            entry = self._counters.setdefault(label, dict.fromkeys(FIELDS, 0))
            for key, value in amounts.items():
                entry[key] += value

    @contextmanager
    def timed(self, label: str, field: str, device: torch.device) -> Iterator[None]:
        """Add the wall time of the block to ``label``'s ``field``."""
        _sync(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(device)
            self.record(label, **{field: time.perf_counter() - start})

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {label: dict(entry) for label, entry in self._counters.items()}

    def add(self, other: dict[str, dict[str, float]]) -> None:
        for label, entry in other.items():
            self.record(label, **entry)

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()


def count_sent(stats: Stats, label: str, elements: int, wire_bytes: int, itemsize: int,
               calls: int = 1) -> None:
    """Record one rank's part of a collective: ``elements`` values sent to other ranks,
    ``wire_bytes`` on the wire, ``elements × itemsize`` uncompressed (the formula every
    collective, real or played, and nothing else uses)."""
    stats.record(label, calls=calls, elements=elements, wire_bytes=wire_bytes,
                 raw_bytes=elements * itemsize)


# counters of destroyed groups, and of transfers no group context accounts for
_PROCESS = Stats()


def retire(group_stats: Stats) -> None:
    """Fold a destroyed group's counters into the process totals."""
    _PROCESS.add(group_stats.snapshot())


def record(label: str, **amounts: float) -> None:
    """Count transfers made outside commpress's collectives (e.g. torch's DDP hooks)."""
    _PROCESS.record(label, **amounts)


def process_stats() -> Stats:
    """The counters of destroyed groups and of transfers outside any group's context."""
    return _PROCESS


def _sync(device: torch.device) -> None:
    if device.type == "cuda" and os.environ.get("COMMPRESS_SYNC_TIMING") == "1":
        torch.cuda.synchronize(device)
