"""Cast codecs: ``none`` (identity), ``bf16`` and ``fp16``.

``none`` sends the tensor as it is (its own dtype's bytes), so every collective run
with it must equal torch's own collective bit for bit. The casts send 2 bytes per
element. ``fp16`` overflows to ±Inf above 65504, as torch's ``fp16_compress_hook``
does: the overflow is visible (non-finite), never silently clipped. ``bf16`` has
fp32's range, but rounding can carry a finite value just below fp32's max past
bf16's: it saturates at bf16's max instead of becoming Inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from commpress.codecs.base import Codec, Packet, finish_decode, register_codec
from commpress.kernels.reference import saturate


@register_codec
@dataclass
class NoCompression(Codec):
    """Identity: the tensor's own bytes cross the wire (``element_size`` bytes per element)."""

    name: ClassVar[str] = "none"
    lossless: ClassVar[bool] = True

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        return Packet((x.reshape(-1).contiguous(),), x.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return finish_decode(packet.tensors[0], packet, out)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        return [(dtype, numel)]


@dataclass
class _Cast(Codec):
    kernel: ClassVar[str] = "cast"
    wire_dtype: ClassVar[torch.dtype]
    saturates: ClassVar[bool] = False

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        flat = x.reshape(-1)
        if self.saturates and x.dtype == torch.float32:
            flat = saturate(flat, self.wire_dtype)
        flat = flat.to(self.wire_dtype).contiguous()
        return Packet((flat,), x.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return finish_decode(packet.tensors[0], packet, out)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        return [(self.wire_dtype, numel)]


@register_codec
@dataclass
class BF16Cast(_Cast):
    """Cast to bfloat16: 16 bits per element, fp32's range, 8 mantissa bits."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
    saturates: ClassVar[bool] = True


@register_codec
@dataclass
class FP16Cast(_Cast):
    """Cast to float16: 16 bits per element, 11 mantissa bits, overflow above 65504."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16
