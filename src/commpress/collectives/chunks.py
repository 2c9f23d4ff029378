"""Encode a tensor as per-destination byte rows, and decode rows back to values.

A collective that sends chunk ``i`` of its input to rank ``i`` pads each chunk to the
codec's alignment, encodes all chunks in **one** codec call when the codec allows it
(fixed-rate, splittable: the packet's tensors split evenly by chunk), and lays the
bytes out as a ``(world, row_bytes)`` tensor whose row ``i`` goes to rank ``i``.
Variable-rate or unsplittable codecs (zfp, nvcomp, topk) encode chunk by chunk into
a list of byte tensors of different sizes.

The functions take a plain codec; :func:`encode_rows` also an error-feedback memory,
applied around the encode.
"""

from __future__ import annotations

import itertools

import torch

from commpress.codecs import Codec, ErrorFeedback, Packet, packet_to_bytes
from commpress.codecs.base import itemsize, sum_rows
from commpress.codecs.error_feedback import encode
from commpress.collectives.watch import Watch, current

Rows = torch.Tensor | list[torch.Tensor]


def padded_chunk(codec: Codec, m: int) -> int:
    """Chunk length after padding to the codec's alignment (unchanged if it has none)."""
    a = codec.alignment
    return m if a <= 1 else -(-m // a) * a


def splittable(codec: Codec) -> bool:
    return codec.fixed_rate and codec.alignment > 0


def rows_of_packet(packet: Packet, n: int) -> torch.Tensor:
    """A splittable packet of ``n`` equal chunks as ``(n, row_bytes)`` bytes, row ``i``
    holding every tensor's part for chunk ``i``."""
    parts = [t.contiguous().view(torch.uint8).view(n, -1) for t in packet.tensors]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def packet_of_rows(codec: Codec, rows: torch.Tensor, m_pad: int,
                   wire_dtype: torch.dtype) -> Packet:
    """Inverse of :func:`rows_of_packet`: the ``(n, m_pad)`` packet of ``n`` byte rows."""
    n = rows.shape[0]
    tensors, offset = [], 0
    for dt, count in codec.packet_layout(n * m_pad, wire_dtype):
        width = count * itemsize(dt) // n
        tensors.append(rows[:, offset : offset + width].contiguous().view(-1).view(dt))
        offset += width
    return Packet(tuple(tensors), n * m_pad, (n, m_pad), torch.float32)


def rows_of_parts(codec: Codec, packet: Packet, padded: list[int]) -> Rows:
    """A splittable packet of parts of ``padded`` elements laid end to end (each a multiple
    of the codec's alignment) as one byte row per part: a ``(n, row_bytes)`` tensor when
    the parts are equal (:func:`rows_of_packet`), else a list."""
    if len(set(padded)) == 1:
        return rows_of_packet(packet, len(padded))
    a = codec.alignment
    bounds = list(itertools.accumulate((p // a for p in padded), initial=0))
    # each tensor splits into bounds[-1] equal pieces of ``a`` elements (the alignment's
    # contract); a part's row holds its pieces of every tensor, as rows_of_packet's do
    pieces = [t.contiguous().view(torch.uint8).view(bounds[-1], -1) for t in packet.tensors]
    return [torch.cat([t[lo:hi].reshape(-1) for t in pieces])
            for lo, hi in zip(bounds, bounds[1:])]


def encode_rows(codec: Codec, x: torch.Tensor, *, rng_stream: int, key: str,
                padded: list[int] | None = None, memory: ErrorFeedback | None = None) -> Rows:
    """Encode ``x`` into byte rows, one per chunk: ``x`` of shape ``(n, m_pad)``, or 1-D
    holding parts of ``padded`` elements end to end (uneven parts, each a multiple of
    the codec's alignment). A splittable codec encodes everything in one call;
    ``memory``, keyed by ``key`` (and the part, for one call per part), is applied
    around the encode."""
    if padded is None:
        padded = [x.shape[1]] * x.shape[0]
    x = x.reshape(-1)
    watch = current()
    if watch is not None and codec.lossless and memory is None:
        watch = None  # exact values: nothing to measure
    if splittable(codec):
        packet = encode(codec, x, rng_stream=rng_stream, key=key, memory=memory)
        if watch is not None:
            _measure(watch, codec, packet, x, memory, key)
        return rows_of_parts(codec, packet, padded)
    rows = []
    for i, part in enumerate(x.split(padded)):
        packet = encode(codec, part, rng_stream=rng_stream, key=f"{key}#{i}", memory=memory)
        if watch is not None:
            _measure(watch, codec, packet, part, memory, f"{key}#{i}")
        rows.append(packet_to_bytes(packet))
    return rows


def _measure(watch: Watch, codec: Codec, packet: Packet, x: torch.Tensor,
             memory: ErrorFeedback | None, key: str) -> None:
    """What ``packet`` (the codes of ``x``) decodes to, against what the codec was given:
    ``x``, or with error feedback ``x`` plus the memory (= decoded + the memory after)."""
    decoded = codec.decode(packet).reshape(-1)[: x.numel()]
    residual = memory.residuals.get(key) if memory is not None else None
    if residual is None:
        watch.add(x, decoded)
        return
    watch.add(decoded + residual.reshape(-1), decoded, residual, given=x)


def _row_packet(codec: Codec, row: torch.Tensor, m_pad: int,
                wire_dtype: torch.dtype) -> Packet:
    p = codec.packet_from_bytes(row, m_pad, (m_pad,), wire_dtype)
    return Packet(p.tensors, p.numel, p.shape, torch.float32)


def decode_rows(codec: Codec, rows: Rows, m_pad: int,
                wire_dtype: torch.dtype) -> torch.Tensor:
    """Decode byte rows (as produced by :func:`encode_rows`) to ``(n, m_pad)`` fp32.

    ``wire_dtype`` is the dtype the sender encoded (it fixes the layout of codecs that
    send values in the input's dtype, such as ``none`` and ``topk``).
    """
    if isinstance(rows, list):
        return torch.stack([codec.decode(_row_packet(codec, r, m_pad, wire_dtype))
                            for r in rows])
    return codec.decode(packet_of_rows(codec, rows, m_pad, wire_dtype))


def decode_sum_rows(codec: Codec, rows: Rows, m_pad: int,
                    wire_dtype: torch.dtype) -> torch.Tensor:
    """Decode byte rows and sum them in fp32, in row order → ``(m_pad,)``."""
    if isinstance(rows, list):
        return sum_rows(decode_rows(codec, rows, m_pad, wire_dtype))
    return codec.decode_sum(packet_of_rows(codec, rows, m_pad, wire_dtype))


def row_bytes(rows: Rows, skip: int) -> tuple[int, int]:
    """(bytes, rows) over all rows except row ``skip`` (this rank's own)."""
    if isinstance(rows, list):
        return sum(r.numel() for i, r in enumerate(rows) if i != skip), len(rows) - 1
    return rows[0].numel() * (rows.shape[0] - 1), rows.shape[0] - 1


def pad_parts(flat: torch.Tensor, sizes: list[int], padded: list[int]) -> torch.Tensor:
    """``flat``'s parts of ``sizes`` elements (end to end; the last ones may be short)
    laid out 1-D at their ``padded`` lengths, zero-padded. No copy when none is padded."""
    if len(set(sizes)) == 1 and len(set(padded)) == 1:
        return pad_chunks(flat, len(sizes), sizes[0], padded[0]).reshape(-1)
    out = flat.new_zeros(sum(padded))
    src = dst = 0
    for size, pad in zip(sizes, padded):
        piece = flat[src:src + size]
        out[dst:dst + piece.numel()] = piece
        src, dst = src + size, dst + pad
    return out


def pad_chunks(flat: torch.Tensor, n: int, m: int, m_pad: int) -> torch.Tensor:
    """View ``flat`` (numel ≤ n·m) as ``(n, m_pad)``: chunk ``i`` is ``flat[i·m:(i+1)·m]``,
    zero-padded. No copy when no padding is needed."""
    if flat.numel() == n * m and m == m_pad:
        return flat.view(n, m)
    out = torch.zeros(n, m_pad, dtype=flat.dtype, device=flat.device)
    full = torch.zeros(n * m, dtype=flat.dtype, device=flat.device)
    full[: flat.numel()] = flat
    out[:, :m] = full.view(n, m)
    return out
