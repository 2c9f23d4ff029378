"""Compressed reduce-scatter, all-to-all based: one quantization per element.

Each rank encodes its input once, chunk ``i`` for rank ``i``; one all-to-all moves the
codes; each rank decodes the ``world`` chunks it received and sums them in fp32, in
rank order. Every element is quantized exactly once, so the error does not grow
with the number of ranks — unlike a compressed ring, which decodes and re-encodes
at each of its ``world − 1`` hops (the alternative we rejected).

Bytes this rank sends: ``(world − 1) · wire_bytes(chunk)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import AnyCodec, begin, end, is_exact, owned_input
from commpress.collectives.comm import (
    Exchange,
    check_sizes,
    reduce_scatter_single,
    writable_flat,
    write_back,
)
from commpress.collectives.handle import Handle, completed


def start_reduce_scatter(x: torch.Tensor, codec: AnyCodec, group: dist.ProcessGroup,
                         stats: Stats, label: str, *, rng_stream: int) -> Exchange:
    """Encode ``x`` (``(world, m_pad)``: row ``i`` for rank ``i``) and start the all-to-all."""
    n, m_pad = x.shape
    rank = dist.get_rank(group)
    with stats.timed(label, "encode_s", x.device):
        rows = chunks.encode_rows(codec, x, rng_stream=rng_stream, key=label)
    sent, count = chunks.row_bytes(rows, skip=rank)
    stats.record(label, calls=1, elements=count * m_pad, wire_bytes=sent,
                 raw_bytes=count * m_pad * x.element_size())
    with stats.timed(label, "comm_s", x.device):
        return Exchange(rows, group)


def finish_reduce_scatter(ex: Exchange, codec: AnyCodec, stats: Stats, label: str,
                          wire_dtype: torch.dtype, m_pad: int,
                          device: torch.device) -> torch.Tensor:
    """Wait for the all-to-all, decode every source's chunk and sum in fp32 → ``(m_pad,)``."""
    with stats.timed(label, "comm_s", device):
        received = ex.wait()
    with stats.timed(label, "decode_s", device):
        return chunks.decode_sum_rows(codec, received, m_pad, wire_dtype)


def run_reduce_scatter(output: torch.Tensor, input: torch.Tensor, codec: AnyCodec,
                       group: dist.ProcessGroup, stats: Stats, label: str, op: str) -> Handle:
    """The reduce-scatter itself, once ranks agree (sub-groups of a two-level call too)."""
    n = dist.get_world_size(group)
    out, copied = writable_flat(output)
    if n == 1:
        out.copy_(input.reshape(-1))
        return completed(write_back(output, out, copied))
    m = out.numel()
    if is_exact(codec):
        size = (n - 1) * m * output.element_size()
        stats.record(label, calls=1, elements=(n - 1) * m, wire_bytes=size, raw_bytes=size)
        work = reduce_scatter_single(out, input.reshape(-1), op, group, async_op=True)
        return Handle(lambda: (work.wait(), write_back(output, out, copied))[1])

    # Step 1-2: encode once, chunk i for rank i; all-to-all
    m_pad = chunks.padded_chunk(codec, m)
    x = chunks.pad_chunks(input.reshape(-1), n, m, m_pad)
    ex = start_reduce_scatter(x, codec, group, stats, label, rng_stream=dist.get_rank(group))

    def finish() -> torch.Tensor:
        # Step 3: decode the chunks received and sum them in fp32, in rank order
        total = finish_reduce_scatter(ex, codec, stats, label, input.dtype, m_pad, input.device)
        if op == "avg":
            total /= n
        out.copy_(total[:m])
        return write_back(output, out, copied)

    return Handle(finish)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    codec="none",
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Reduce-scatter ``input`` (``world × output.numel()`` elements) into ``output``.

    Rank ``r`` receives the sum (``op="sum"``) or mean (``op="avg"``) over ranks of
    chunk ``r`` of their inputs. Each element is quantized once; decoding and the sum
    are in fp32. With ``codec="none"`` this is torch's own reduce-scatter.

    Args:
        output: this rank's chunk, any shape with ``input.numel() / world`` elements.
        input: the full tensor to reduce, same dtype as ``output``.
        codec: a codec, spec string or dict (see :func:`commpress.codec`).
        group: process group (default: the world).
        op: ``"avg"`` or ``"sum"``.
        label: key for :func:`commpress.stats` (default ``"reduce_scatter"``).
        async_op: return a :class:`Handle` whose ``wait()`` finishes decoding.

    Example::

        commpress.reduce_scatter(shard, grads, "int4:hadamard=128", label="dp.grad")
    """
    call = begin("reduce_scatter", group, label, {"codec": codec}, op=op,
                 tensors={"input": input, "output": output},
                 check=lambda n: check_sizes("reduce_scatter", input, output, n, "input",
                                             "output"))
    input = owned_input(input, call.codec, async_op)
    return end(run_reduce_scatter(output, input, call.codec, call.group, call.stats,
                                  call.label, op), async_op)

