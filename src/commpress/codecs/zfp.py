"""ZFP fixed-rate lossy compression through the ``zfpy`` package (CPU).

The hybrid-compression paper (Xu et al., CCGrid 2024) used ZFP's fixed-rate mode
inside MPI collectives. ``rate`` is bits per value (ZFP pads to blocks of 4 values
and adds a small header, so the stream is treated as variable-size). GPU tensors go
through host memory. ZFP does not preserve NaN/Inf, so a 4-byte non-finite flag
follows the stream: any NaN or ±Inf input decodes to an all-NaN tensor.

Install with ``pip install 'commpress[zfp]'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from commpress.codecs.base import Codec, Packet, finish_decode, option_error, register_codec

INSTALL_HINT = "the zfp codec needs zfpy: pip install 'commpress[zfp]' (or zfpy==1.0.1.post0)"


def _zfpy():
    try:
        import zfpy
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return zfpy


@register_codec
@dataclass
class ZFP(Codec):
    """ZFP fixed-rate mode, ``rate`` bits per value (1…32); variable-size packet."""

    name: ClassVar[str] = "zfp"
    fixed_rate: ClassVar[bool] = False
    rate: float = 8.0

    def __post_init__(self) -> None:
        if not 1.0 <= self.rate <= 32.0:
            raise option_error(self.name, "rate", self.rate, "allowed: 1 <= rate <= 32 bits/value")

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        flat = x.detach().reshape(-1).float().cpu()
        flag = (flat * 0).sum().view(1)
        if flat.numel():
            stream_bytes = _zfpy().compress_numpy(flat.numpy(), rate=self.rate)
            body = torch.frombuffer(bytearray(stream_bytes), dtype=torch.uint8)
        else:
            body = torch.empty(0, dtype=torch.uint8)
        blob = torch.cat([body, flag.view(torch.uint8)]).to(x.device)
        return Packet((blob,), x.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        blob = packet.tensors[0].cpu()
        flag = blob[-4:].clone().view(torch.float32)
        if packet.numel:
            arr = _zfpy().decompress_numpy(blob[:-4].numpy().tobytes())
            values = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        else:
            values = torch.empty(0)
        values = (values + flag).to(device=packet.tensors[0].device)
        return finish_decode(values, packet, out)  # fp32 → the packet's dtype, saturating
