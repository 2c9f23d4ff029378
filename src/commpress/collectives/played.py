"""Collectives played by one process for every rank: what ``commpress simulate`` runs.

Each class below takes the ranks' inputs one at a time (so a caller can compute rank
``r``'s gradient, hand it over and free it) and gives every rank's result, bit for bit
what the real collective gives on ``N`` processes. It does so with the very steps the
real collectives run — :mod:`commpress.collectives.chunks` to pad, lay out, encode and
decode, each rank's own codec objects (their stochastic-rounding counters and
error-feedback memory), the same random streams (``rng_stream``: the rank in the group
that runs the step), the same row order in every sum — and replaces only the moving of
bytes by indexing. The equivalence is tested against real multi-process runs.

What is kept per rank is encoded: ``N`` ranks' codes of a bucket, not ``N`` fp32
gradients. Exact (uncompressed) reductions are summed here in rank order; a real
backend sums in its own order, so those agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import math

import torch

from commpress.codecs import Delta
from commpress.collectives import chunks
from commpress.collectives.call import AnyCodec, is_exact
from commpress.collectives.stats import Stats


def _received(rows_by_source: list, index: int):
    """What a destination gets: row ``index`` of every source, in source order."""
    picked = [rows[index] for rows in rows_by_source]
    return picked if isinstance(rows_by_source[0], list) else torch.stack(picked)


class PlayedReduceScatter:
    """:func:`commpress.reduce_scatter` over ``world`` ranks, ``m`` output elements each.

    ``codecs[r]`` is rank ``r``'s codec object; ``add(r, input)`` in any order; ``finish()``
    → every rank's output (fp32).
    """

    def __init__(self, codecs: list[AnyCodec], m: int, label: str, op: str,
                 stats: Stats | None = None) -> None:
        self.codecs, self.m, self.label, self.op = codecs, m, label, op
        self.stats = stats or Stats()  # bytes every rank sends, summed over the ranks
        self.world = len(codecs)
        self.exact = is_exact(codecs[0])
        self.m_pad = chunks.padded_chunk(codecs[0], m)
        self.rows: list = [None] * self.world
        self.total: torch.Tensor | None = None  # exact: the running sum in rank order
        self.dtype: torch.dtype | None = None
        self._added = 0

    def add(self, rank: int, input: torch.Tensor) -> None:
        self.dtype = input.dtype
        if self.exact:
            sent = (self.world - 1) * self.m * input.element_size()
            self.stats.record(self.label, calls=1, elements=(self.world - 1) * self.m,
                              wire_bytes=sent, raw_bytes=sent)
            # the running sum must be taken in rank order: keep inputs until their turn
            self.rows[rank] = input.reshape(-1).clone()
            while self._added < self.world and self.rows[self._added] is not None:
                x = self.rows[self._added].float()
                self.total = x.clone() if self.total is None else self.total.add_(x)
                self.rows[self._added] = True
                self._added += 1
            return
        x = chunks.pad_chunks(input.reshape(-1), self.world, self.m, self.m_pad)
        self.rows[rank] = chunks.encode_rows(self.codecs[rank], x, rng_stream=rank,
                                             key=self.label)
        _count(self.stats, self.label, self.rows[rank], rank, self.m_pad, input.element_size())

    def finish(self) -> list[torch.Tensor]:
        n = self.world
        if self.exact:
            total = self.total / n if self.op == "avg" else self.total
            return list(total.view(n, self.m))
        outs = []
        for d in range(n):
            total = chunks.decode_sum_rows(self.codecs[d], _received(self.rows, d), self.m_pad,
                                           self.dtype)
            if self.op == "avg":
                total /= n
            outs.append(total[: self.m].clone())
        return outs


class PlayedTwoLevelReduceScatter:
    """:func:`commpress.hierarchical_reduce_scatter` (TLq-HS) over ``nodes × L`` ranks.

    ``intra[r]``/``inter[r]`` are rank ``r``'s codecs. Once a node's ``L`` ranks are
    added, its intra-node step runs and their intra codes are dropped.
    """

    def __init__(self, intra: list[AnyCodec], inter: list[AnyCodec], ranks_per_node: int,
                 m: int, label: str, op: str, stats: Stats | None = None) -> None:
        self.intra, self.inter, self.L, self.m, self.op = intra, inter, ranks_per_node, m, op
        self.stats = stats or Stats()
        self.world = len(intra)
        self.nodes = self.world // ranks_per_node
        unit = math.lcm(max(intra[0].alignment, 1), max(inter[0].alignment, 1))
        self.m_pad = -(-m // unit) * unit
        self.lab_intra, self.lab_inter = f"{label}.intra", f"{label}.inter"
        self.intra_rows: list = [None] * self.world
        self.inter_rows: list = [None] * self.world
        self.dtype: torch.dtype | None = None

    def add(self, rank: int, input: torch.Tensor) -> None:
        L, nodes, m, m_pad = self.L, self.nodes, self.m, self.m_pad
        self.dtype = input.dtype
        # Step 1: lay out for the node (local rank l gets chunks l, L + l, …) and encode
        x = chunks.pad_chunks(input.reshape(-1), self.world, m, m_pad)
        x = x.view(nodes, L, m_pad).transpose(0, 1).reshape(L, nodes * m_pad)
        self.intra_rows[rank] = chunks.encode_rows(self.intra[rank], x, rng_stream=rank,
                                                   key=self.lab_intra)
        _count(self.stats, self.lab_intra, self.intra_rows[rank], rank % L, nodes * m_pad,
               input.element_size())
        node = rank // L
        members = range(node * L, (node + 1) * L)
        if all(self.intra_rows[r] is not None for r in members):
            self._node_step(node)

    def _node_step(self, node: int) -> None:
        """Steps 2-3 for every rank of ``node``: its share of the node's codes, summed
        and re-encoded for the link across nodes."""
        L, nodes, m_pad = self.L, self.nodes, self.m_pad
        sources = self.intra_rows[node * L:(node + 1) * L]
        for local in range(L):
            d = node * L + local
            intra, inter = self.intra[d], self.inter[d]
            received = _received(sources, local)
            if intra.requantizes_into(inter):
                packet = chunks.packet_of_rows(intra, received, nodes * m_pad, torch.float32)
                self.inter_rows[d] = chunks.rows_of_packet(
                    intra.sum_requantize(packet, inter, rng_stream=d), nodes)
            else:
                partial = chunks.decode_sum_rows(intra, received, nodes * m_pad, self.dtype)
                self.inter_rows[d] = chunks.encode_rows(inter, partial.view(nodes, m_pad),
                                                        rng_stream=d, key=self.lab_inter)
            _count(self.stats, self.lab_inter, self.inter_rows[d], node, m_pad,
                   self.dtype.itemsize)
        for r in range(node * L, (node + 1) * L):
            self.intra_rows[r] = True  # done: the codes are no longer needed

    def finish(self) -> list[torch.Tensor]:
        # Steps 4-5: rank (n, l) sums what the ranks of local index l sent it
        outs = []
        for d in range(self.world):
            node, local = divmod(d, self.L)
            sources = [self.inter_rows[n * self.L + local] for n in range(self.nodes)]
            total = chunks.decode_sum_rows(self.inter[d], _received(sources, node), self.m_pad,
                                           torch.float32)
            if self.op == "avg":
                total /= self.world
            outs.append(total[: self.m].clone())
        return outs


def _count(stats: Stats, label: str, rows, own: int, m_pad: int, itemsize: int) -> None:
    """A rank's sent bytes, as the real collective records them (all rows but its own)."""
    sent, count = chunks.row_bytes(rows, skip=own)
    stats.record(label, calls=1, elements=count * m_pad, wire_bytes=sent,
                 raw_bytes=count * m_pad * itemsize)


def played_gather(codecs: list[AnyCodec], shards: list[torch.Tensor], label: str,
                  rng_streams: list[int]) -> list[torch.Tensor]:
    """What :func:`commpress.all_gather` decodes for each rank's shard (every rank decodes
    the same bytes), in the shard's dtype — fp32 values before the caller's cast."""
    out = []
    for r, shard in enumerate(shards):
        codec = codecs[r]
        if is_exact(codec):
            out.append(shard.reshape(-1).clone())
            continue
        m = shard.numel()
        m_pad = chunks.padded_chunk(codec, m)
        x = chunks.pad_chunks(shard.reshape(-1), 1, m, m_pad)
        rows = chunks.encode_rows(codec, x, rng_stream=rng_streams[r], key=label)
        out.append(chunks.decode_rows(codec, rows, m_pad, shard.dtype)[0, :m])
    return out


def played_delta_gather(weights: torch.Tensor, shards: list[torch.Tensor],
                        codecs: list[AnyCodec], label: str, rng_streams: list[int]) -> None:
    """:func:`commpress.delta_all_gather` for every rank: ``weights`` (the one replica all
    ranks hold) moves, slice by slice, to the ranks' new shards — through the encoded
    differences (qWD)."""
    m = shards[0].numel()
    flat = weights.view(-1)
    diffs = [Delta.difference(s.reshape(-1).to(weights.dtype), flat[r * m:(r + 1) * m])
             for r, s in enumerate(shards)]
    decoded = played_gather(codecs, diffs, label, rng_streams)
    for r, d in enumerate(decoded):
        view = weights.view(-1)[r * m:(r + 1) * m]
        Delta.apply(view, d.float(), out=view)

