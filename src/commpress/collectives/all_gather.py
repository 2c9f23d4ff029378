"""Compressed all-gather: each rank encodes its shard once; every rank — the owner
too — decodes all shards from the same bytes, so all ranks hold identical results.

Bytes this rank sends: ``wire_bytes(shard)`` (to each peer; a ring or tree moves it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import AnyCodec, begin, end, is_exact, owned_input
from commpress.collectives.comm import (
    Gather,
    all_gather_single,
    check_sizes,
    writable_flat,
    write_back,
)
from commpress.collectives.handle import Handle, completed


def start_all_gather(shard: torch.Tensor, codec: AnyCodec, group: dist.ProcessGroup,
                     stats: Stats, label: str, *, rng_stream: int, key: str | None = None,
                     count_call: bool = True) -> Gather:
    """Encode a padded flat ``shard`` and start gathering every rank's bytes.

    ``label`` keys the stats, ``key`` the error-feedback memory (default: ``label``).
    """
    n = dist.get_world_size(group)
    with stats.timed(label, "encode_s", shard.device):
        row = chunks.encode_rows(codec, shard.view(1, -1), rng_stream=rng_stream,
                                 key=key or label)
    row = row.view(-1) if isinstance(row, torch.Tensor) else row[0]
    stats.record(label, calls=int(count_call), elements=(n - 1) * shard.numel(),
                 wire_bytes=(n - 1) * row.numel(),
                 raw_bytes=(n - 1) * shard.numel() * shard.element_size())
    with stats.timed(label, "comm_s", shard.device):
        return Gather(row, fixed_size=chunks.splittable(codec), group=group)


def finish_all_gather(g: Gather, codec: AnyCodec, stats: Stats, label: str,
                      wire_dtype: torch.dtype, m_pad: int, device: torch.device) -> torch.Tensor:
    """Wait and decode all ranks' shards → ``(world, m_pad)`` fp32."""
    with stats.timed(label, "comm_s", device):
        rows = g.wait()
    with stats.timed(label, "decode_s", device):
        return chunks.decode_rows(codec, rows, m_pad, wire_dtype)


def run_all_gather(output: torch.Tensor, input: torch.Tensor, codec: AnyCodec,
                   group: dist.ProcessGroup, stats: Stats, label: str) -> Handle:
    """The all-gather itself, once ranks agree (sub-groups of a two-level call too)."""
    n = dist.get_world_size(group)
    out, copied = writable_flat(output)
    m = input.numel()
    if n == 1:  # nothing crosses the wire, so nothing is compressed
        out.copy_(input.reshape(-1))
        return completed(write_back(output, out, copied))
    if is_exact(codec):
        size = (n - 1) * m * input.element_size()
        stats.record(label, calls=1, elements=(n - 1) * m, wire_bytes=size, raw_bytes=size)
        work = all_gather_single(out, input.reshape(-1).contiguous(), group, async_op=True)
        return Handle(lambda: (work.wait(), write_back(output, out, copied))[1])

    # Step 1: encode this rank's shard once; start gathering every rank's bytes
    m_pad = chunks.padded_chunk(codec, m)
    shard = chunks.pad_chunks(input.reshape(-1), 1, m, m_pad).view(-1)
    g = start_all_gather(shard, codec, group, stats, label, rng_stream=dist.get_rank(group))

    def finish() -> torch.Tensor:
        # Step 2: every rank decodes every shard from the same bytes
        values = finish_all_gather(g, codec, stats, label, input.dtype, m_pad, input.device)
        out.view(n, m).copy_(values[:, :m])
        return write_back(output, out, copied)

    return Handle(finish)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    codec="none",
    group: dist.ProcessGroup | None = None,
    label: str | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Gather every rank's ``input`` into ``output`` (``world × input.numel()`` elements,
    rank order). All ranks decode the same bytes: ``output`` is bitwise identical on
    every rank, including the caller's own slice (which is the decoded value, not the
    original). With ``codec="none"`` this is torch's own all-gather.

    Example::

        commpress.all_gather(full, shard, "int8", label="dp.param")
    """
    call = begin("all_gather", group, label, {"codec": codec},
                 tensors={"input": input, "output": output},
                 check=lambda n: check_sizes("all_gather", output, input, n, "output", "input"))
    input = owned_input(input, call.codec, async_op)
    return end(run_all_gather(output, input, call.codec, call.group, call.stats, call.label),
               async_op)
