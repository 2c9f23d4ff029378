"""Compressed all-gather: each rank encodes its shard once; every rank — the owner
too — decodes all shards from the same bytes, so all ranks hold identical results.

Bytes this rank sends: ``wire_bytes(shard)`` (to each peer; a ring or tree moves it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.collectives import chunks
from commpress.collectives.agreement import check_agreement
from commpress.collectives.comm import (
    Gather,
    all_gather_single,
    check_sizes,
    describe,
    resolve_group,
)
from commpress.collectives.handle import Handle, completed
from commpress.collectives.reduce_scatter import check_float, is_exact, resolve_codec
from commpress.collectives.stats import record, timed


def start_all_gather(shard: torch.Tensor, codec, group: dist.ProcessGroup, label: str, *,
                     stream: int, key: str | None = None, count_call: bool = True) -> Gather:
    """Encode a padded flat ``shard`` and start gathering every rank's bytes.

    ``label`` keys the stats, ``key`` the error-feedback memory (default: ``label``).
    """
    n = dist.get_world_size(group)
    with timed(label, "encode_s", shard.device):
        row = chunks.encode_rows(codec, shard.view(1, -1), stream=stream, key=key or label)
    row = row.view(-1) if isinstance(row, torch.Tensor) else row[0]
    record(label, calls=int(count_call), elements=(n - 1) * shard.numel(),
           wire_bytes=(n - 1) * row.numel(),
           raw_bytes=(n - 1) * shard.numel() * shard.element_size())
    with timed(label, "comm_s", shard.device):
        return Gather(row, fixed_size=chunks.splittable(codec), group=group)


def finish_all_gather(g: Gather, codec, label: str, wire_dtype: torch.dtype, m_pad: int,
                      device: torch.device) -> torch.Tensor:
    """Wait and decode all ranks' shards → ``(world, m_pad)`` fp32."""
    with timed(label, "comm_s", device):
        rows = g.wait()
    with timed(label, "decode_s", device):
        return chunks.decode_rows(codec, rows, m_pad, wire_dtype)


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
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_float("input", input)
    label = label or "all_gather"
    n = dist.get_world_size(group)
    check_sizes("all_gather", output, input, n, "output", "input")
    check_agreement(group, "all_gather", input.device, label=label, codec=codec.spec(),
                    **describe(input))
    if n == 1:  # nothing crosses the wire, so nothing is compressed
        output.view(-1).copy_(input.reshape(-1))
        return completed(output) if async_op else output
    if is_exact(codec):
        work = all_gather_single(output.view(-1), input.reshape(-1).contiguous(), group,
                                 async_op=True)
        size = (n - 1) * input.numel() * input.element_size()
        record(label, calls=1, elements=(n - 1) * input.numel(), wire_bytes=size, raw_bytes=size)
        handle = Handle(lambda: (work.wait(), output)[1])
        return handle if async_op else handle.wait()

    m = input.numel()
    m_pad = chunks.padded_chunk(codec, m)
    shard = chunks.pad_chunks(input.reshape(-1), 1, m, m_pad).view(-1)
    g = start_all_gather(shard, codec, group, label, stream=dist.get_rank(group))

    def finish() -> torch.Tensor:
        values = finish_all_gather(g, codec, label, input.dtype, m_pad, input.device)
        output.view(n, m).copy_(values[:, :m])
        return output

    handle = Handle(finish)
    return handle if async_op else handle.wait()
