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

from commpress.codecs import Codec, ErrorFeedback
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import begin, end, is_exact, owned_input
from commpress.collectives.comm import check_sizes, rank_in
from commpress.collectives.handle import Handle
from commpress.collectives.transport import AllToAll, Peers, Reduce, Rows, Steps, run_into


def send_rows(rows: Rows, codec: Codec, peers: Peers, stats: Stats, label: str,
              padded: list[int], itemsize: int, eager: bool = False) -> Steps:
    """Count and send ``codec``'s byte rows (row ``i``, the codes of ``padded[i]``
    elements, to peer ``i``) → the rows received. Uneven rows of a fixed-rate codec
    arrive as one tensor with no exchange of sizes first: each peer's row for this rank
    encodes as many elements as this rank's own."""
    me = peers.rank
    sent, _ = chunks.row_bytes(rows, skip=me)
    count_sent(stats, label, sum(p for i, p in enumerate(padded) if i != me), sent, itemsize)
    received = (rows[me].numel() if isinstance(rows, list) and chunks.splittable(codec)
                else None)
    return (yield AllToAll(peers, stats, label, eager, rows, received))


def exchange_and_sum(x: torch.Tensor, padded: list[int], codec: Codec, peers: Peers,
                     stats: Stats, label: str, *, rng_stream: int, eager: bool = False,
                     memory: ErrorFeedback | None = None) -> Steps:
    """Encode ``x`` — the parts for each peer, ``padded[i]`` elements for peer ``i``, end
    to end — once (through ``memory``, keyed by ``label``), exchange, decode what every
    peer sent this rank and sum in fp32, in peer order → ``(padded[peers.rank],)``."""
    dtype, itemsize, device = x.dtype, x.element_size(), x.device
    with stats.timed(label, "encode_s", device):
        rows = chunks.encode_rows(codec, x, rng_stream=rng_stream, key=label, padded=padded,
                                  memory=memory)
    del x  # only codes are kept while the peers answer
    received = yield from send_rows(rows, codec, peers, stats, label, padded, itemsize, eager)
    with stats.timed(label, "decode_s", device):
        return chunks.decode_sum_rows(codec, received, padded[peers.rank], dtype)


def reduce_scatter_steps(flat: torch.Tensor, sizes: int | list[int], codec: Codec,
                         peers: Peers, stats: Stats, label: str, op: str, *,
                         out: torch.Tensor | None = None, eager: bool = False,
                         memory: ErrorFeedback | None = None) -> Steps:
    """One rank's reduce-scatter of ``flat``, the parts for each peer end to end:
    ``sizes`` elements each (an int), or ``sizes[i]`` for peer ``i`` (uneven parts, any
    length, zero included) → its ``sizes[rank]`` values (fp32 when compressed; ``out``
    itself when exact, even and given). Each part is padded to the codec's alignment
    alone, so a rank receives only its elements, each encoded once; ``memory``: the
    error feedback applied around the encode."""
    n = peers.size
    if n == 1:
        return flat
    sizes = [sizes] * n if isinstance(sizes, int) else list(sizes)
    m = sizes[peers.rank]
    if is_exact(codec, memory) and len(set(sizes)) == 1:
        count_sent(stats, label, (n - 1) * m, (n - 1) * m * flat.element_size(),
                   flat.element_size())
        request = Reduce(peers, stats, label, eager, flat, op, True, out)
        del flat
        return (yield request)
    # Step 1-2: encode once, part i for rank i; all-to-all
    padded = [chunks.padded_chunk(codec, size) for size in sizes]
    x = chunks.pad_parts(flat, sizes, padded)
    del flat
    # Step 3: decode the parts received and sum them in fp32, in rank order
    total = yield from exchange_and_sum(x, padded, codec, peers, stats, label,
                                        rng_stream=peers.rank, eager=eager, memory=memory)
    if op == "avg":
        total /= n
    return total[:m]


def run_reduce_scatter(output: torch.Tensor, input: torch.Tensor, codec: Codec,
                       memory: ErrorFeedback | None, group: dist.ProcessGroup, stats: Stats,
                       label: str, op: str) -> Handle:
    """The reduce-scatter itself, once ranks agree, over torch.distributed."""
    peers = Peers(rank_in(group), group.size(), group)
    return run_into(output, lambda out: reduce_scatter_steps(
        input.reshape(-1), out.numel(), codec, peers, stats, label, op, out=out,
        memory=memory))


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    codec="none",
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
    async_op: bool = False,
    *,
    memory: ErrorFeedback | None = None,
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
        memory: a :class:`commpress.ErrorFeedback` applied around the encode (this call
            site's own; its residuals are keyed by ``label``).

    Example::

        commpress.reduce_scatter(shard, grads, "int4:hadamard=128", label="dp.grad")
    """
    call = begin("reduce_scatter", group, label, {"codec": codec}, op=op,
                 memories={"codec": memory}, tensors={"input": input, "output": output},
                 check=lambda n: check_sizes("reduce_scatter", input, output, n, "input",
                                             "output"))
    input = owned_input(input, call.codec, async_op)
    return end(run_reduce_scatter(output, input, call.codec, call.memory, call.group,
                                  call.stats, call.label, op), async_op)

