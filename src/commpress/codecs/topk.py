"""Top-k sparsification: send the ``k = ceil(ratio · numel)`` largest-magnitude
elements as (values, int32 indices), the rest decode to zero. The selection is
deterministic (ties at the k-th magnitude go to the lowest indices, indices increase):
:func:`commpress.kernels.topk_select`, a radix select on CUDA.

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

from commpress import kernels
from commpress.codecs.base import (
    Codec,
    Packet,
    direct_out,
    finish_decode,
    option_error,
    register_codec,
)


@register_codec
@dataclass
class TopK(Codec):
    """Keep the ``ratio`` fraction of largest-magnitude elements (values + indices)."""

    name: ClassVar[str] = "topk"
    kernel: ClassVar[str] = "topk"
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
        values, idx, flag = kernels.topk_select(flat, self.k(flat.numel()))
        return Packet((values, idx, flag), flat.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        values, idx, flag = packet.tensors
        dense = direct_out(packet, out)
        if dense is None:
            dense = torch.empty(packet.numel, dtype=packet.dtype, device=values.device)
        # every element gets the flag (0, or NaN), the selected ones their value plus it
        flag = flag.to(packet.dtype)
        dense.copy_(flag.expand(packet.numel))
        dense[idx] = values.to(packet.dtype) + flag
        return finish_decode(dense, packet, out)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        k = self.k(numel)
        return [(dtype, k), (kernels.reference.topk_index_dtype(numel), k), (torch.float32, 1)]
