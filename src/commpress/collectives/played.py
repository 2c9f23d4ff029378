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

from commpress.codecs import Delta, packet_to_bytes
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import AnyCodec, is_exact


def played_levels(two_level: bool, world: int, ranks_per_node: int) -> tuple[str, ...]:
    """The codec levels a gradient path runs on ``world`` ranks in nodes of
    ``ranks_per_node`` — ``("single",)``, ``("intra", "inter")``, or the one level left
    when there is one node (``intra``) or one rank per node (``inter``) — as
    :func:`commpress.hierarchical_reduce_scatter` and its kin choose them."""
    if world < 1 or ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks={world}, ranks_per_node={ranks_per_node} is not allowed; "
                         "allowed: positive, ranks a multiple of ranks_per_node")
    if not two_level:
        return ("single",)
    if world == ranks_per_node:
        return ("intra",)
    return ("inter",) if ranks_per_node == 1 else ("intra", "inter")


def level_label(label: str, level: str) -> str:
    """The stats label of one level (``dp.grad.inter``; a single level keeps ``label``)."""
    return label if level == "single" else f"{label}.{level}"


class _RankOrderSum:
    """A running sum of the ranks' tensors in rank order — how an exact (uncompressed)
    reduction is played; the backend sums in its own order, so the two agree to
    rounding, not bit for bit. A tensor that arrives before its turn waits; only one
    sum and the early arrivals are held, not every rank's tensor."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self._waiting: dict[int, torch.Tensor] = {}
        self._next = 0

    def add(self, rank: int, x: torch.Tensor) -> None:
        """Add rank ``rank``'s tensor (owned by the sum from now on)."""
        self._waiting[rank] = x
        while self._next in self._waiting:
            y = self._waiting.pop(self._next)
            self.total = y if self.total is None else self.total.add_(y)
            self._next += 1


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
        self.exact_sum = _RankOrderSum()
        self.dtype: torch.dtype | None = None

    def add(self, rank: int, input: torch.Tensor) -> None:
        self.dtype = input.dtype
        if self.exact:
            sent = (self.world - 1) * self.m * input.element_size()
            self.stats.record(self.label, calls=1, elements=(self.world - 1) * self.m,
                              wire_bytes=sent, raw_bytes=sent)
            self.rows[rank] = True
            self.exact_sum.add(rank, input.reshape(-1).to(torch.float32, copy=True))
            return
        x = chunks.pad_chunks(input.reshape(-1), self.world, self.m, self.m_pad)
        self.rows[rank] = chunks.encode_rows(self.codecs[rank], x, rng_stream=rank,
                                             key=self.label)
        _count(self.stats, self.label, self.rows[rank], rank, self.m_pad, input.element_size())

    def finish(self) -> list[torch.Tensor]:
        n = self.world
        if self.exact:
            total = self.exact_sum.total
            return list((total / n if self.op == "avg" else total).view(n, self.m))
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


class PlayedAllReduce:
    """:func:`commpress.all_reduce` over ``len(codecs)`` ranks of a ``numel``-element tensor.

    ``add(r, tensor)`` in any order; ``finish()`` → the result every rank holds (bitwise
    the same on all of them), in the tensor's dtype.
    """

    def __init__(self, codecs: list[AnyCodec], numel: int, label: str, op: str,
                 stats: Stats | None = None) -> None:
        self.codecs, self.numel, self.label, self.op = codecs, numel, label, op
        self.stats = stats or Stats()
        self.world = n = len(codecs)
        self.exact = is_exact(codecs[0])
        # two ranks exchange whole tensors; more ranks reduce-scatter chunks first
        self.chunk = numel if n == 2 else -(-numel // n)
        self.m_pad = chunks.padded_chunk(codecs[0], self.chunk)
        self.rows: list = [None] * n
        self.exact_sum = _RankOrderSum()
        self.dtype: torch.dtype | None = None

    def add(self, rank: int, tensor: torch.Tensor) -> None:
        n, flat = self.world, tensor.reshape(-1)
        self.dtype = flat.dtype
        if n == 1 or self.numel == 0 or self.exact:
            if n > 1:
                size = 2 * (n - 1) * self.chunk * flat.element_size()
                self.stats.record(self.label, calls=1, elements=2 * (n - 1) * self.chunk,
                                  wire_bytes=size, raw_bytes=size)
            self.rows[rank] = True
            self.exact_sum.add(rank, flat.clone())  # in the tensor's dtype, as the backend
            return
        parts = 1 if n == 2 else n
        x = chunks.pad_chunks(flat, parts, self.chunk, self.m_pad)
        rows = chunks.encode_rows(self.codecs[rank], x, rng_stream=rank, key=self.label)
        if n == 2:
            self.rows[rank] = rows.view(-1) if isinstance(rows, torch.Tensor) else rows[0]
            _count_gather(self.stats, self.label, self.rows[rank], n, self.m_pad,
                          flat.element_size(), calls=1)
        else:
            self.rows[rank] = rows
            _count(self.stats, self.label, rows, rank, self.m_pad, flat.element_size())

    def finish(self) -> torch.Tensor:
        n, dtype = self.world, self.dtype
        total = self.exact_sum.total
        if n == 1 or self.numel == 0:
            return total
        if self.exact:
            return total / n if self.op == "avg" else total
        if n == 2:
            c = self.codecs[0]
            values = chunks.decode_rows(c, _gathered(c, self.rows), self.m_pad, dtype)
            total = values[0] + values[1]
            if self.op == "avg":
                total /= 2
            return total[: self.numel].to(dtype)
        shards = []
        for d in range(n):  # rank d's reduced chunk, encoded once for the all-gather
            shard = chunks.decode_sum_rows(self.codecs[d], _received(self.rows, d), self.m_pad,
                                           dtype)
            if self.op == "avg":
                shard /= n
            row = chunks.encode_rows(self.codecs[d], shard.to(dtype).view(1, -1), rng_stream=d,
                                     key=self.label + ".shard")
            shards.append(row.view(-1) if isinstance(row, torch.Tensor) else row[0])
            _count_gather(self.stats, self.label, shards[-1], n, self.m_pad,
                          dtype.itemsize, calls=0)
        c = self.codecs[0]
        values = chunks.decode_rows(c, _gathered(c, shards), self.m_pad, dtype)
        return values[:, : self.chunk].reshape(-1)[: self.numel].to(dtype)


class PlayedHierarchicalAllReduce:
    """:func:`commpress.hierarchical_all_reduce` over ``nodes × L`` ranks.

    ``intra[r]``/``inter[r]`` are rank ``r``'s codecs. Once a node's ``L`` ranks are
    added, its reduction inside the node runs and each local index's chunk enters the
    all-reduce across nodes; ``finish()`` → the result every rank holds.
    """

    def __init__(self, intra: list[AnyCodec], inter: list[AnyCodec], ranks_per_node: int,
                 numel: int, label: str, op: str, stats: Stats | None = None) -> None:
        self.world, self.L, self.numel, self.op = len(intra), ranks_per_node, numel, op
        self.stats = stats or Stats()
        self.label = label
        self.nodes = self.world // ranks_per_node
        self.m = -(-numel // ranks_per_node)
        L, nodes = self.L, self.nodes
        self.exact_intra = is_exact(intra[0])
        self.intra = [PlayedReduceScatter(intra[k * L:(k + 1) * L], self.m, f"{label}.intra",
                                          "sum", self.stats) for k in range(nodes)]
        self.across = [PlayedAllReduce(inter[local::L], self.m, f"{label}.inter", "sum",
                                       self.stats) for local in range(L)]
        self.padded: list = [None] * self.world  # exact intra: inputs until the node is in

    def add(self, rank: int, tensor: torch.Tensor) -> None:
        L, m = self.L, self.m
        node, local = divmod(rank, L)
        flat = tensor.reshape(-1)
        padded = torch.zeros(L * m, dtype=flat.dtype, device=flat.device)
        padded[: self.numel] = flat
        if not self.exact_intra:
            self.intra[node].add(local, padded)
            if all(r is not None for r in self.intra[node].rows):
                for j, c in enumerate(self.intra[node].finish()):
                    self.across[j].add(node, c.to(flat.dtype))
            return
        self.padded[rank] = padded
        members = self.padded[node * L:(node + 1) * L]
        if any(p is None for p in members):
            return
        size = (L - 1) * m * flat.element_size()
        for j in range(L):
            # what local rank j received, summed in local-rank order as the real one does
            recv = torch.stack([p.view(L, m)[j] for p in members])
            chunk = torch.empty(m, dtype=flat.dtype, device=flat.device)
            torch.sum(recv, dim=0, out=chunk)
            self.stats.record(f"{self.label}.intra", calls=1, elements=(L - 1) * m,
                              wire_bytes=size, raw_bytes=size)
            self.across[j].add(node, chunk)
        self.padded[node * L:(node + 1) * L] = [True] * L

    def finish(self) -> torch.Tensor:
        L, m = self.L, self.m
        parts = []
        for a in self.across:
            chunk = a.finish()
            if self.op == "avg":
                chunk.div_(self.world)
            parts.append(chunk)
            size = (L - 1) * m * chunk.element_size()
            for _ in range(self.nodes):  # every rank of local index j shares its chunk
                self.stats.record(f"{self.label}.gather.intra", calls=1,
                                  elements=(L - 1) * m, wire_bytes=size, raw_bytes=size)
        return torch.cat(parts)[: self.numel]


def _gathered(codec: AnyCodec, rows: list[torch.Tensor]):
    """What an all-gather of one byte row per rank hands every rank: a ``(n, bytes)``
    tensor for a splittable codec, else the list of rows."""
    return torch.stack(rows) if chunks.splittable(codec) else rows


def _count(stats: Stats, label: str, rows, own: int, m_pad: int, itemsize: int) -> None:
    """A rank's sent bytes, as the real collective records them (all rows but its own)."""
    sent, count = chunks.row_bytes(rows, skip=own)
    stats.record(label, calls=1, elements=count * m_pad, wire_bytes=sent,
                 raw_bytes=count * m_pad * itemsize)


def _count_gather(stats: Stats, label: str, row: torch.Tensor, n: int, m_pad: int,
                  itemsize: int, calls: int) -> None:
    """A rank's bytes in an all-gather of its one row, as the real one records them."""
    stats.record(label, calls=calls, elements=(n - 1) * m_pad, wire_bytes=(n - 1) * row.numel(),
                 raw_bytes=(n - 1) * m_pad * itemsize)


def played_gather(codecs: list[AnyCodec], shards: list[torch.Tensor], label: str,
                  rng_streams: list[int], stats: Stats | None = None,
                  group_size: int | None = None) -> list[torch.Tensor]:
    """What :func:`commpress.all_gather` decodes for each rank's shard (every rank decodes
    the same bytes), in the shard's dtype — fp32 values before the caller's cast.

    ``stats`` gets each rank's bytes as the real all-gather records them, in a group of
    ``group_size`` ranks (default: one rank per shard)."""
    n = group_size or len(shards)
    out = []
    for r, shard in enumerate(shards):
        codec = codecs[r]
        m = shard.numel()
        if is_exact(codec):
            if stats is not None:
                count_exact_gather(stats, label, m, shard.element_size(), n)
            out.append(shard.reshape(-1).clone())
            continue
        m_pad = chunks.padded_chunk(codec, m)
        x = chunks.pad_chunks(shard.reshape(-1), 1, m, m_pad)
        rows = chunks.encode_rows(codec, x, rng_stream=rng_streams[r], key=label)
        if stats is not None:
            row = rows.view(-1) if isinstance(rows, torch.Tensor) else rows[0]
            _count_gather(stats, label, row, n, m_pad, shard.element_size(), calls=1)
        out.append(chunks.decode_rows(codec, rows, m_pad, shard.dtype)[0, :m])
    return out


def count_exact_gather(stats: Stats, label: str, m: int, itemsize: int, n: int,
                       ranks: int = 1) -> None:
    """The bytes ``ranks`` ranks record, each in an uncompressed all-gather of ``m``
    elements over ``n`` ranks, as the real one records them."""
    size = ranks * (n - 1) * m * itemsize
    stats.record(label, calls=ranks, elements=ranks * (n - 1) * m, wire_bytes=size,
                 raw_bytes=size)


def played_delta_gather(weights: torch.Tensor, shards: list[torch.Tensor],
                        codecs: list[AnyCodec], label: str, rng_streams: list[int],
                        stats: Stats | None = None, group_size: int | None = None) -> None:
    """:func:`commpress.delta_all_gather` for every rank: ``weights`` (the one replica all
    ranks hold) moves, slice by slice, to the ranks' new shards — through the encoded
    differences (qWD). ``stats`` and ``group_size`` as for :func:`played_gather`."""
    m = shards[0].numel()
    flat = weights.view(-1)
    diffs = [Delta.difference(s.reshape(-1).to(weights.dtype), flat[r * m:(r + 1) * m])
             for r, s in enumerate(shards)]
    decoded = played_gather(codecs, diffs, label, rng_streams, stats, group_size)
    for r, d in enumerate(decoded):
        view = weights.view(-1)[r * m:(r + 1) * m]
        Delta.apply(view, d.float(), out=view)



def played_transfer(send_codec: AnyCodec, recv_codec: AnyCodec, tensor: torch.Tensor, *,
                    rng_stream: int, key: str, stats: Stats | None = None,
                    label: str = "p2p") -> torch.Tensor:
    """What :func:`commpress.recv` writes on the receiver when the sender calls
    :func:`commpress.isend` on ``tensor`` (``rng_stream``: the sender's global rank;
    ``key``: ``"<label>-><dst>"``) — the same encode, bytes and decode into a new tensor."""
    packet = chunks.encode(send_codec, tensor.detach(), rng_stream=rng_stream, key=key)
    payload = packet_to_bytes(packet)
    if stats is not None:
        stats.record(label, calls=1, elements=tensor.numel(), wire_bytes=payload.numel(),
                     raw_bytes=tensor.numel() * tensor.element_size())
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    received = recv_codec.packet_from_bytes(payload, out.numel(), tuple(out.shape), out.dtype)
    recv_codec.decode(received, out=out)
    return out
