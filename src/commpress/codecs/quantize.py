"""Group-quantization codecs: ``int8``, ``int4``, ``int2`` and ``fp8``.

Symmetric per-group scales (``scale = absmax / qmax``, ``qmax = 2**(bits-1) - 1``:
SDP4Bit found -7..7 converges better than -8..7 for int4). Options:

* ``group``: elements per scale (default 128);
* ``hadamard``: 0 (off) or a power of two 16…256 — a block Hadamard rotation fused
  into encode and decode that spreads outliers across the block (SDP4Bit's TLq-HS);
* ``scale_dtype``: ``fp32`` (default) or ``fp16``;
* ``rounding``: ``nearest`` or ``stochastic`` (unbiased, from a counter-based hash of
  (seed, call counter, stream, element index): reproducible on every device);
* ``seed``.

Wire size per element: ``bits + scale_bits / group`` — int4, group 128, fp32
scales: 4.25 bits. Elements are padded to whole groups (never read or written past
the end of the caller's tensor). A group holding NaN or ±Inf decodes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

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

SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
HADAMARD_SIZES = (0, 16, 32, 64, 128, 256)


def group_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` as fp32, zero-padded to whole groups, shaped ``(groups, group)``."""
    flat = x.reshape(-1)
    g = torch.zeros(-(-flat.numel() // group) * group, dtype=torch.float32, device=x.device)
    g[: flat.numel()] = flat
    return g.view(-1, group)


MAX_GROUP = 1 << 20  # elements per scale; the papers use 32…4096


def check_group(name: str, group: int) -> None:
    """A group size is bounded when parsed: a typo such as 1e11 must not reach an
    allocation of hundreds of GB."""
    if not 1 <= group <= MAX_GROUP:
        raise option_error(name, "group", group,
                           f"allowed: an integer from 1 to {MAX_GROUP} (e.g. 128)")


class ScaledGroups(Codec):
    """Base of codecs with one scale per ``group`` elements of ``bits``-bit codes, padded
    to whole groups and Hadamard blocks. Subclasses are dataclasses with the options
    ``group``, ``scale_dtype`` and, where they rotate, ``hadamard``."""

    group: int
    scale_dtype: str
    bits: ClassVar[int]
    hadamard: int = 0  # no rotation unless the subclass has the option

    def __post_init__(self) -> None:
        check_group(self.name, self.group)
        if self.hadamard not in HADAMARD_SIZES:
            raise option_error(self.name, "hadamard", self.hadamard,
                               "allowed: 0 (off) or a power of two 16, 32, 64, 128, 256")

    @property
    def alignment(self) -> int:
        return kernels.padded_unit(self.bits, self.group, self.hadamard)

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        total = kernels.padded_numel(numel, self.bits, self.group, self.hadamard)
        return [(torch.uint8, total * self.bits // 8),
                (self.torch_scale_dtype, total // self.group)]


@dataclass
class _GroupQuantizer(ScaledGroups):
    group: int = 128
    hadamard: int = 0
    scale_dtype: Literal["fp32", "fp16"] = "fp32"
    rounding: Literal["nearest", "stochastic"] = "nearest"
    seed: int = 0
    # internal state: encode calls so far (selects the stochastic-rounding stream)
    _calls: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed < 0:
            raise option_error(self.name, "seed", self.seed, "allowed: an integer >= 0")

    @property
    def bit_packed(self) -> bool:
        """Codes packed ``8 // bits`` per byte, as the fused kernels read and write them."""
        return True

    @property
    def kernel(self) -> str:
        if getattr(self, "packing", "bits") == "trits":
            return "trits"
        return "int_hadamard" if self.hadamard else self.name

    def next_keys(self, rng_stream: int) -> tuple[int, int] | None:
        """Keys of this encode call's random stream (None for nearest rounding)."""
        calls = self._calls
        self._calls += 1
        if self.rounding == "nearest":
            return None
        return kernels.stream_keys(self.seed, calls, rng_stream)

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        codes, scales = kernels.quantize(
            x, bits=self.bits, group=self.group, hadamard=self.hadamard,
            scale_dtype=self.torch_scale_dtype, keys=self.next_keys(rng_stream))
        return Packet((codes, scales), x.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = packet.tensors
        flat = kernels.dequantize(codes, scales, packet.numel, bits=self.bits, group=self.group,
                                  hadamard=self.hadamard, out_dtype=packet.dtype,
                                  out=direct_out(packet, out))
        return finish_decode(flat, packet, out)

    def decode_sum(self, packet: Packet) -> torch.Tensor:
        """Sum in the rotated domain and rotate back once (the rotation is linear)."""
        if not self.bit_packed:
            return super().decode_sum(packet)
        codes, scales = packet.tensors
        k = packet.shape[0]
        return kernels.dequantize_sum(codes.view(k, -1), scales.view(k, -1), bits=self.bits,
                                      group=self.group, hadamard=self.hadamard)

    def requantizes_into(self, other: Codec) -> bool:
        return (isinstance(other, _GroupQuantizer) and self.bit_packed and other.bit_packed
                and self.hadamard == other.hadamard)

    def sum_requantize(self, packet: Packet, into: Codec, *, rng_stream: int = 0) -> Packet:
        """TLq-HS step 3: decode ``k`` chunks, sum in fp32 and encode with ``into`` — all in
        the rotated domain, one fused kernel, no second rotation."""
        if not self.requantizes_into(into):
            return super().sum_requantize(packet, into, rng_stream=rng_stream)
        codes, scales = packet.tensors
        k, m = packet.shape
        out_codes, out_scales = kernels.dequant_reduce_requant(
            codes.view(k, -1), scales.view(k, -1), bits_in=self.bits, group_in=self.group,
            bits_out=into.bits, group_out=into.group, scale_dtype=into.torch_scale_dtype,
            keys=into.next_keys(rng_stream))
        return Packet((out_codes, out_scales), m, (m,), torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calls = int(state["calls"])


@register_codec
@dataclass
class Int8(_GroupQuantizer):
    """8-bit symmetric group quantization (codes -127..127)."""

    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8


@register_codec
@dataclass
class Int4(_GroupQuantizer):
    """4-bit symmetric group quantization (codes -7..7, two per byte)."""

    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4


@register_codec
@dataclass
class Int2(_GroupQuantizer):
    """2-bit symmetric group quantization: ternary codes -1, 0, 1.

    ``packing="bits"`` stores four codes per byte (2 bits each, one value unused);
    ``packing="trits"`` five per byte (3⁵ = 243 ≤ 256), ``ceil(group / 5)`` bytes per
    group: 1.625 bits per element at group 128, 22 % fewer bytes for the same values.
    """

    name: ClassVar[str] = "int2"
    bits: ClassVar[int] = 2
    packing: Literal["bits", "trits"] = "bits"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing not in ("bits", "trits"):
            raise option_error(self.name, "packing", self.packing, "allowed: bits, trits")

    @property
    def bit_packed(self) -> bool:
        return self.packing == "bits"

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        if self.packing == "bits":
            return super().encode(x, rng_stream=rng_stream)
        self.check_input(x)
        trits, scales = kernels.trits_quantize(
            x, group=self.group, hadamard=self.hadamard, scale_dtype=self.torch_scale_dtype,
            keys=self.next_keys(rng_stream))
        return Packet((trits, scales), x.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.packing == "bits":
            return super().decode(packet, out)
        trits, scales = packet.tensors
        flat = kernels.trits_dequantize(trits, scales, packet.numel, group=self.group,
                                        hadamard=self.hadamard, out_dtype=packet.dtype,
                                        out=direct_out(packet, out))
        return finish_decode(flat, packet, out)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        layout = super().packet_layout(numel, dtype)
        if self.packing == "bits":
            return layout
        groups = layout[1][1]
        return [(torch.uint8, groups * kernels.reference.trit_bytes(self.group)), layout[1]]


@register_codec
@dataclass
class FP8(ScaledGroups):
    """float8 e4m3 with one scale per group (``absmax / 448``): 8 bits + scale per element.

    ``hadamard`` (0 or 16…256) rotates blocks first, as for the int codecs (TACO uses
    Hadamard + fp8 for tensor-parallel activations): outliers spread, the group's
    absmax shrinks. Nearest rounding only (torch's cast). A group holding NaN or ±Inf
    decodes to NaN; finite values saturate (fp16 scales at 65504), never decode to Inf.
    """

    name: ClassVar[str] = "fp8"
    kernel: ClassVar[str] = "fp8"
    bits: ClassVar[int] = 8
    group: int = 128
    scale_dtype: Literal["fp32", "fp16"] = "fp32"
    hadamard: int = 0

    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        self.check_input(x)
        codes, scales = kernels.fp8_quantize(x, group=self.group, hadamard=self.hadamard,
                                             scale_dtype=self.torch_scale_dtype)
        return Packet((codes, scales), x.numel(), tuple(x.shape), x.dtype)

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = packet.tensors
        flat = kernels.fp8_dequantize(codes, scales, packet.numel, group=self.group,
                                      hadamard=self.hadamard, out_dtype=packet.dtype,
                                      out=direct_out(packet, out))
        return finish_decode(flat, packet, out)
