"""Compressed all-gather: each rank encodes its shard once; every rank — the owner
too — decodes all shards from the same bytes, so all ranks hold identical results.

Bytes this rank sends: ``wire_bytes(shard)`` (to each peer; a ring or tree moves it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import begin, end, is_exact, owned_input
from commpress.collectives.comm import check_sizes, rank_in
from commpress.collectives.handle import Handle
from commpress.collectives.transport import AllGather, Peers, Steps, run_into


def all_gather_steps(flat: torch.Tensor, codec: Codec, peers: Peers, stats: Stats,
                     label: str, *, rng_stream: int | None = None, key: str | None = None,
                     count_call: bool = True, out: torch.Tensor | None = None,
                     then: Callable[[torch.Tensor], object] = lambda values: values,
                     memory: ErrorFeedback | None = None) -> Steps:
    """One rank's all-gather of ``flat`` → ``then(values)``, ``values`` every rank's
    ``m`` elements as ``(peers.size, m)`` (fp32 when compressed, decoded from the same
    bytes on every rank). ``then`` must depend on the gathered values alone.

    ``rng_stream`` defaults to the rank among ``peers``; ``memory``'s key to ``label``;
    ``out`` (exact only) a buffer to gather into. With ``memory`` this rank's row is
    decoded once: its residual takes the row from the gathered values.
    """
    n, m, itemsize = peers.size, flat.numel(), flat.element_size()
    if n == 1:  # nothing crosses the wire, so nothing is compressed
        return then(flat.view(1, m))
    if is_exact(codec, memory):
        count_sent(stats, label, (n - 1) * m, (n - 1) * m * itemsize, itemsize)
        request = AllGather(peers, stats, label, False, flat.contiguous(), True,
                            lambda rows: then(rows.view(n, m)), out)
        del flat
        return (yield request)
    # Step 1: encode this rank's shard once; gather every rank's bytes
    m_pad, dtype = chunks.padded_chunk(codec, m), flat.dtype
    shard = chunks.pad_chunks(flat, 1, m, m_pad)
    del flat
    key = key or label
    with stats.timed(label, "encode_s", shard.device):
        if memory is not None:
            sent, compensated = memory.compensate(shard.view(-1), key)
            shard = sent.view(1, m_pad)
        row = chunks.encode_rows(codec, shard, rng_stream=peers.rank if rng_stream is None
                                 else rng_stream, key=key)
    row = row.view(-1) if isinstance(row, torch.Tensor) else row[0]
    count_sent(stats, label, (n - 1) * m_pad, (n - 1) * row.numel(), itemsize,
               calls=int(count_call))

    def decode(rows) -> torch.Tensor:
        # Step 2: every rank decodes every shard from the same bytes
        with stats.timed(label, "decode_s", row.device):
            return chunks.decode_rows(codec, rows, m_pad, dtype)

    splittable = chunks.splittable(codec)
    if memory is None:
        return (yield AllGather(peers, stats, label, False, row, splittable,
                                lambda rows: then(decode(rows)[:, :m])))
    # the residual takes this rank's row of what every rank decodes: decoded once. Here,
    # not in the request's ``then``: the played transport computes that once for all ranks
    values = yield AllGather(peers, stats, label, False, row, splittable, decode)
    memory.update(key, compensated, values[peers.rank])
    return then(values[:, :m])


def run_all_gather(output: torch.Tensor, input: torch.Tensor, codec: Codec,
                   memory: ErrorFeedback | None, group: dist.ProcessGroup, stats: Stats,
                   label: str) -> Handle:
    """The all-gather itself, once ranks agree, over torch.distributed."""
    peers = Peers(rank_in(group), group.size(), group)
    return run_into(output, lambda out: all_gather_steps(input.reshape(-1), codec, peers, stats,
                                                         label, out=out, memory=memory))


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    codec="none",
    group: dist.ProcessGroup | None = None,
    label: str | None = None,
    async_op: bool = False,
    *,
    memory: ErrorFeedback | None = None,
) -> torch.Tensor | Handle:
    """Gather every rank's ``input`` into ``output`` (``world × input.numel()`` elements,
    rank order). All ranks decode the same bytes: ``output`` is bitwise identical on
    every rank, including the caller's own slice (which is the decoded value, not the
    original). With ``codec="none"`` this is torch's own all-gather; ``memory``: a
    :class:`commpress.ErrorFeedback` applied around the encode.

    Example::

        commpress.all_gather(full, shard, "int8", label="dp.param")
    """
    call = begin("all_gather", group, label, {"codec": codec}, memories={"codec": memory},
                 tensors={"input": input, "output": output},
                 check=lambda n: check_sizes("all_gather", output, input, n, "output", "input"))
    input = owned_input(input, call.codec, async_op)
    return end(run_all_gather(output, input, call.codec, call.memory, call.group, call.stats,
                              call.label), async_op)
