"""Chunked top-k with quantized values: SparseLoCo's code of cross-site pseudo-gradients.

The tensor is cut into chunks of ``chunk`` elements (4096 = 64 × 64); each chunk keeps
its ``k`` largest magnitudes (64: 1.56 %), sent as

- their chunk-local indices, ``log2(chunk)`` bits each (12), packed;
- their values as ``bits``-bit codes (2): ``2**bits`` equal bins over the chunk's mean ±
  ``sigmas`` (6) standard deviations of the kept values, decoded through a table of each
  bin's mean (``2**bits`` bf16 values per chunk).

Everything else decodes to zero. Biased: pair it with error feedback (``diloco-sparse``
does, with SparseLoCo's decay 0.95). Wire size per chunk: ``ceil(k·bits/8) +
ceil(k·log2(chunk)/8) + 2·2**bits`` bytes — at the defaults 16 + 96 + 8 = 120 bytes for
4096 elements, 0.234 bits per element. A chunk holding NaN or ±Inf decodes to NaN whole
(a non-finite value top-k would drop never vanishes). The last chunk of a tensor is
padded with zeros; a tensor smaller than one chunk is refused (an empty one sends
nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from commpress import kernels
from commpress.codecs.base import (
    Codec,
    Packet,
    finish_decode,
    option_error,
    register_codec,
)
from commpress.validate import InputError


@register_codec
@dataclass
class ChunkTopK(Codec):
    """Per chunk of ``chunk`` elements, the ``k`` largest as ``bits``-bit codes of a
    per-chunk table, with packed chunk-local indices."""

    name: ClassVar[str] = "chunktopk"
    kernel: ClassVar[str] = "topk"
    chunk: int = 4096
    k: int = 64
    bits: int = 2
    sigmas: float = 6.0

    def __post_init__(self) -> None:
        if not (isinstance(self.chunk, int) and 2 <= self.chunk <= 1 << 16
                and self.chunk & (self.chunk - 1) == 0):
            raise option_error(self.name, "chunk", self.chunk,
                               "allowed: a power of two from 2 to 65536")
        if not (isinstance(self.k, int) and 1 <= self.k < self.chunk):
            raise option_error(self.name, "k", self.k,
                               f"allowed: 1 <= k < chunk ({self.chunk})")
        if not (isinstance(self.bits, int) and 1 <= self.bits <= 8):
            raise option_error(self.name, "bits", self.bits, "allowed: 1 to 8")
        if not (isinstance(self.sigmas, int | float) and 0 < self.sigmas < float("inf")):
            raise option_error(self.name, "sigmas", self.sigmas,
                               "allowed: a finite number > 0")

    @property
    def alignment(self) -> int:
        return self.chunk  # each chunk's bytes stand alone

    @property
    def index_bits(self) -> int:
        return self.chunk.bit_length() - 1

    def _chunks(self, numel: int) -> int:
        if 0 < numel < self.chunk:
            raise InputError(f"codec {self.spec()}: a tensor of {numel} elements is smaller "
                             f"than one chunk ({self.chunk}); allowed: tensors of at least "
                             "chunk elements (or a smaller chunk option)")
        return -(-numel // self.chunk)

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        if self._chunks(x.numel()) == 0:
            empty = x.new_empty(0, dtype=torch.uint8)
            return Packet((empty, empty.clone(), x.new_empty(0, dtype=torch.bfloat16)), 0,
                          tuple(x.shape), x.dtype)
        codes, indices, table = kernels.chunk_topk_encode(
            x.reshape(-1), chunk=self.chunk, k=self.k, bits=self.bits, sigmas=self.sigmas)
        return Packet((codes.view(-1), indices.view(-1), table.view(-1)), x.numel(),
                      tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, indices, table = packet.tensors
        rows = self._chunks(packet.numel)
        if rows == 0:
            return finish_decode(table.new_zeros(0, dtype=torch.float32), packet, out)
        values = kernels.reference.chunk_topk_decode(
            codes.view(rows, -1), indices.view(rows, -1), table.view(rows, -1), packet.numel,
            chunk=self.chunk, k=self.k, bits=self.bits)
        return finish_decode(values, packet, out)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        rows = self._chunks(numel)
        return [(torch.uint8, rows * -(-self.k * self.bits // 8)),
                (torch.uint8, rows * -(-self.k * self.index_bits // 8)),
                (torch.bfloat16, rows * (1 << self.bits))]
