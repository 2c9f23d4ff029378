"""Delta: encode the difference to a reference both sides hold (the base of qWD).

SDP4Bit's qWD (Jia et al., NeurIPS 2024) all-gathers 4-bit codes of
``Δ = lowp(new master) − W`` instead of the weights ``W`` themselves: weight updates
are small and smooth, so 4 bits lose little, and since every rank — the owner too —
applies ``W += Δ̂`` the quantization error is corrected at the next step (the master
weights never see it). Quantizing W directly (qW) hurt the loss badly in the paper.

The caller owns the reference: ``decode`` returns ``reference + Δ̂`` in the
reference's dtype, computed in fp32, identically on every rank.
"""

from __future__ import annotations

import torch

from commpress.codecs.base import Codec, Packet
from commpress.validate import InputError


class Delta:
    """Wrap ``codec`` to send ``x − reference`` and rebuild ``reference + Δ̂``.

    Example::

        qwd = Delta(codec("int4:group=2048"))
        packet = qwd.encode(new_weights, reference=old_weights)
        qwd.decode(packet, reference=old_weights, out=old_weights)  # in place
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    @property
    def name(self) -> str:
        return self.codec.name

    @property
    def alignment(self) -> int:
        return self.codec.alignment

    def spec(self) -> str:
        return f"delta({self.codec.spec()})"

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        return self.codec.wire_bytes(numel, dtype)

    @staticmethod
    def difference(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """``Δ = x − reference`` in fp32: what qWD encodes."""
        if x.shape != reference.shape:
            raise InputError(f"Delta: x shape {tuple(x.shape)} != reference shape "
                             f"{tuple(reference.shape)}")
        return x.float() - reference.float()

    @staticmethod
    def apply(reference: torch.Tensor, diff: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``reference + Δ̂`` summed in fp32, cast to the reference's dtype — the same bits
        on every rank that holds the same reference and codes. ``out`` may alias it."""
        result = (reference.float() + diff.view(reference.shape)).to(reference.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out

    def encode(self, x: torch.Tensor, *, reference: torch.Tensor,
               rng_stream: int = 0) -> Packet:
        packet = self.codec.encode(self.difference(x, reference), rng_stream=rng_stream)
        return Packet(packet.tensors, packet.numel, packet.shape, reference.dtype)

    def decode(self, packet: Packet, *, reference: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``reference + Δ̂`` (fp32 sum, cast to the reference's dtype); ``out`` may alias it."""
        diff = self.codec.decode(Packet(packet.tensors, packet.numel, packet.shape, torch.float32))
        return self.apply(reference, diff, out)

    def state_dict(self) -> dict:
        return {"codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.codec.load_state_dict(state["codec"])

    def __repr__(self) -> str:
        return f"Delta({self.codec!r})"
