"""Top-k sparsification: send the ``k = ceil(ratio · numel)`` largest-magnitude
elements as (values, int32 indices), the rest decode to zero.

Biased: pair it with :class:`~commpress.codecs.error_feedback.ErrorFeedback`
(Deep Gradient Compression). Wire size ``k · (element_size + 4) + 4`` bytes; the
extra 4 bytes carry a non-finite flag, so a NaN or ±Inf that top-k would drop makes
the whole decoded tensor NaN instead of silently vanishing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from commpress.codecs.base import Codec, Packet, finish_decode, option_error, register_codec


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


@register_codec
@dataclass
class TopK(Codec):
    """Keep the ``ratio`` fraction of largest-magnitude elements (values + indices)."""

    name: ClassVar[str] = "topk"
    ratio: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise option_error(self.name, "ratio", self.ratio, "allowed: 0 < ratio <= 1")

    @property
    def alignment(self) -> int:
        return 0  # the k largest of the whole tensor: not splittable

    def k(self, numel: int) -> int:
        return min(numel, math.ceil(self.ratio * numel))

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        flat = x.reshape(-1)
        k = self.k(flat.numel())
        magnitude = flat.abs().float().nan_to_num(nan=float("inf"))
        idx = magnitude.topk(k, sorted=False).indices
        # fp32 sum of x·0 is 0, or NaN if any element is NaN or ±Inf
        flag = (flat.float() * 0).sum().view(1)
        return Packet(
            (flat[idx].contiguous(), idx.to(_index_dtype(flat.numel())), flag),
            flat.numel(), tuple(x.shape), x.dtype,
        )

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        values, idx, flag = packet.tensors
        dense = torch.zeros(packet.numel, dtype=packet.dtype, device=values.device)
        dense[idx.long()] = values.to(packet.dtype)
        dense += flag.to(packet.dtype)
        return finish_decode(dense, packet, out)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        k = self.k(numel)
        return [(dtype, k), (_index_dtype(numel), k), (torch.float32, 1)]
