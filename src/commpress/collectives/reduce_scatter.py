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

from commpress.codecs import codec as build_codec
from commpress.collectives import chunks
from commpress.collectives.agreement import check_agreement
from commpress.collectives.comm import (
    Exchange,
    check_op,
    check_sizes,
    describe,
    reduce_scatter_single,
    resolve_group,
)
from commpress.collectives.handle import Handle, completed
from commpress.collectives.stats import record, timed


def resolve_codec(codec):
    """A codec object from a spec, dict or codec (ErrorFeedback passes through)."""
    if hasattr(codec, "encode") and hasattr(codec, "decode"):
        return codec
    return build_codec(codec)


def is_exact(codec) -> bool:
    """Whether a collective can use torch's own uncompressed collective for this codec."""
    return getattr(codec, "name", None) == "none" and not hasattr(codec, "residuals")


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")


def start_reduce_scatter(
    x: torch.Tensor, codec, group: dist.ProcessGroup, label: str, *, stream: int
) -> tuple[Exchange, int]:
    """Encode ``x`` (``(world, m_pad)``) and start the all-to-all. Returns (exchange, m_pad)."""
    n, m_pad = x.shape
    rank = dist.get_rank(group)
    with timed(label, "encode_s", x.device):
        rows = chunks.encode_rows(codec, x, stream=stream, key=label)
    sent, count = chunks.row_bytes(rows, skip=rank)
    record(label, calls=1, elements=count * m_pad, wire_bytes=sent,
           raw_bytes=count * m_pad * x.element_size())
    with timed(label, "comm_s", x.device):
        ex = Exchange(rows, group)
    return ex, m_pad


def finish_reduce_scatter(ex: Exchange, codec, label: str, wire_dtype: torch.dtype,
                          m_pad: int, device: torch.device) -> torch.Tensor:
    """Wait for the all-to-all, decode every source's chunk and sum in fp32 → ``(m_pad,)``."""
    with timed(label, "comm_s", device):
        received = ex.wait()
    with timed(label, "decode_s", device):
        values = chunks.decode_rows(codec, received, m_pad, wire_dtype)
        return values.sum(dim=0)


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
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_op(op)
    check_float("input", input)
    label = label or "reduce_scatter"
    n = dist.get_world_size(group)
    check_sizes("reduce_scatter", input, output, n, "input", "output")
    check_agreement(group, "reduce_scatter", input.device, label=label, codec=codec.spec(),
                    op=op, **describe(input))
    if n == 1:
        output.copy_(input.view_as(output))
        return completed(output) if async_op else output
    if is_exact(codec):
        work = reduce_scatter_single(output.view(-1), input.reshape(-1), op, group, async_op=True)
        record(label, calls=1, elements=(n - 1) * output.numel(),
               wire_bytes=(n - 1) * output.numel() * output.element_size(),
               raw_bytes=(n - 1) * output.numel() * output.element_size())
        handle = Handle(lambda: (work.wait(), output)[1])
        return handle if async_op else handle.wait()

    m = output.numel()
    x = chunks.pad_chunks(input.reshape(-1), n, m, chunks.padded_chunk(codec, m))
    ex, m_pad = start_reduce_scatter(x, codec, group, label, stream=dist.get_rank(group))

    def finish() -> torch.Tensor:
        total = finish_reduce_scatter(ex, codec, label, input.dtype, m_pad, input.device)
        if op == "avg":
            total /= n
        output.view(-1).copy_(total[:m])
        return output

    handle = Handle(finish)
    return handle if async_op else handle.wait()
