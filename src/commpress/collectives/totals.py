"""The public counters: bytes, calls and times by label, summed over every group."""

from __future__ import annotations

import torch.distributed as dist

from commpress.collectives.byte_stats import Stats, process_stats
from commpress.collectives.group_context import context, live_contexts


def stats(group: dist.ProcessGroup | None = None) -> dict[str, dict[str, float]]:
    """The counters: ``{label: {calls, elements, raw_bytes, wire_bytes, encode_s,
    decode_s, comm_s}}`` summed over every group, or of ``group`` alone."""
    if group is not None:
        return context(group).stats.snapshot()
    total = Stats()
    total.add(process_stats().snapshot())
    for ctx in live_contexts():
        total.add(ctx.stats.snapshot())
    return total.snapshot()


def reset_stats() -> None:
    """Clear every counter."""
    process_stats().reset()
    for ctx in live_contexts():
        ctx.stats.reset()
