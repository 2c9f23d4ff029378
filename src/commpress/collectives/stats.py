"""Byte and time accounting per label, for every compressed collective.

``elements`` and ``wire_bytes`` count what this rank sent to *other* ranks (what
crosses the network), so ``8 * wire_bytes / elements`` is bits per element on the
wire; ``raw_bytes`` is what those elements occupy uncompressed in their own dtype.
Times are wall-clock seconds on this rank: on CUDA they cover kernel launches unless
``COMMPRESS_SYNC_TIMING=1`` makes each phase synchronize first.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FIELDS = ("calls", "elements", "raw_bytes", "wire_bytes", "encode_s", "decode_s", "comm_s")

_STATS: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))


def record(label: str, **amounts: float) -> None:
    """Add ``amounts`` (keys from :data:`FIELDS`) to ``label``'s counters."""
    entry = _STATS[label]
    for key, value in amounts.items():
        entry[key] += value


def stats() -> dict[str, dict[str, float]]:
    """A copy of the counters: ``{label: {calls, elements, raw_bytes, wire_bytes,
    encode_s, decode_s, comm_s}}``."""
    return {label: dict(entry) for label, entry in _STATS.items()}


def reset_stats() -> None:
    """Clear every counter."""
    _STATS.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda" and os.environ.get("COMMPRESS_SYNC_TIMING") == "1":
        torch.cuda.synchronize(device)


@contextmanager
def timed(label: str, field: str, device: torch.device) -> Iterator[None]:
    """Add the wall time of the block to ``label``'s ``field``."""
    _sync(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync(device)
        record(label, **{field: time.perf_counter() - start})
