"""Below two bits: ``sign`` (1 bit) and ``nf2`` (2 bits), scaled by each group's mean |x|.

``int2`` is ternary with an absmax scale: on Gaussian-like gradients most elements
round to zero (mean squared error ≈ 0.5 σ²). Scaling by the group's mean absolute
value ``a`` instead fits the bulk of the distribution:

* ``sign``: each element decodes to ``±a`` — the L2-best single magnitude for a given
  sign pattern (1-bit SGD, Seide et al. 2014; EF-signSGD, Karimireddy et al. 2019).
  MSE ``(1 − 2/π) σ² ≈ 0.36 σ²`` on a Gaussian.
* ``nf2``: four levels ``±0.5675 a, ±1.8925 a`` with threshold ``1.2302 a`` — the
  Lloyd-Max quantizer of a Gaussian (Max 1960) written in units of ``a = 0.7979 σ``
  (as NF4 fits 4-bit levels to a normal distribution). MSE ≈ 0.12 σ².

Both are biased (outliers are clipped to the top level): pair them with
:class:`~commpress.codecs.error_feedback.ErrorFeedback`, which sends the clipped part
later. Wire size per element: ``bits + scale_bits / group`` (sign, group 128, fp32
scales: 1.25 bits). A group holding NaN or ±Inf decodes to NaN; finite values
saturate at the output dtype's largest value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from commpress.codecs.base import Packet, finish_decode, option_error, register_codec
from commpress.codecs.quantize import ScaledGroups, group_rows


@dataclass
class _MeanAbsQuantizer(ScaledGroups):
    group: int = 128
    scale_dtype: Literal["fp32", "fp16"] = "fp32"
    levels: ClassVar[tuple[float, ...]]  # magnitudes, in units of the mean |x|
    threshold: ClassVar[float]  # |x| / a above which the larger magnitude is sent

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group < 8 or self.group % 8:
            raise option_error(self.name, "group", self.group,
                               "allowed: a positive multiple of 8 (e.g. 128)")

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        n = x.numel()
        g = group_rows(x, self.group)
        finite = torch.isfinite(g).all(dim=1)
        sdt = self.torch_scale_dtype
        # mean |x| over the caller's elements only (padding would shrink the last scale)
        counts = torch.full((g.shape[0],), float(self.group), device=x.device)
        if n:
            counts[-1] = n - (g.shape[0] - 1) * self.group
        mean_abs = g.abs().sum(dim=1) / counts
        scale = mean_abs.clamp_max(torch.finfo(sdt).max)  # finite stays finite in fp16
        scale = torch.where(finite, scale, float("nan")).to(sdt)
        codes = (g >= 0).to(torch.uint8)
        if self.bits == 2:
            big = g.abs() > self.threshold * scale.float().view(-1, 1)
            codes = codes * 2 + big.to(torch.uint8)
        codes = torch.where(finite.view(-1, 1), codes, 0)
        return Packet((_pack(codes.view(-1), self.bits), scale), n, tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = packet.tensors
        total = scale.numel() * self.group
        codes = _unpack(packed, self.bits, total).long()
        table = torch.tensor(_signed_levels(self.levels), dtype=torch.float32,
                             device=packed.device)
        vals = table[codes].view(-1, self.group) * scale.float().view(-1, 1)
        flat = vals.view(-1)[: packet.numel]
        big = torch.finfo(packet.dtype).max
        flat = torch.where(torch.isfinite(flat), flat.clamp(-big, big), flat)
        return finish_decode(flat.to(packet.dtype), packet, out)


def _signed_levels(levels: tuple[float, ...]) -> list[float]:
    """Value of each code: the top bit is the sign, the rest index ``levels``."""
    return [-v for v in levels] + list(levels)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    c = codes.view(-1, per_byte).to(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, total: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).view(-1)[:total]


@register_codec
@dataclass
class Sign(_MeanAbsQuantizer):
    """1 bit per element: the sign, decoded as ± the group's mean |x|."""

    name: ClassVar[str] = "sign"
    bits: ClassVar[int] = 1
    levels: ClassVar[tuple[float, ...]] = (1.0,)
    threshold: ClassVar[float] = float("inf")


@register_codec
@dataclass
class NF2(_MeanAbsQuantizer):
    """2 bits per element: Gaussian Lloyd-Max levels scaled by the group's mean |x|."""

    name: ClassVar[str] = "nf2"
    bits: ClassVar[int] = 2
    levels: ClassVar[tuple[float, ...]] = (0.5675, 1.8925)
    threshold: ClassVar[float] = 1.2302
