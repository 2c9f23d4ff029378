"""Error feedback: remember what a lossy codec dropped and send it next time.

For a residual ``e`` (zero at first) and input ``g``: send ``C(g + e)`` and keep
``e ← g + e − Ĉ(g + e)`` (Seide et al. 2014; Karimireddy et al. 2019). It makes biased
codecs (top-k, int2, sign-like) converge, and trims the error of the others.

The residual is kept in fp32 per ``key`` (a parameter or bucket name) and is part of
``state_dict()``. Where the compensated value is not finite the old residual is
kept: a NaN/Inf step must not poison every later step through the memory. Where
``g + e`` is finite but beyond the range of ``g``'s dtype (fp16's 65504), it saturates
there before encoding — the excess stays in the residual — rather than overflowing to
±Inf and sending a non-finite value for finite input.
"""

from __future__ import annotations

from typing import Any

import torch

from commpress.codecs.base import Codec, Packet
from commpress.kernels.reference import saturate


class ErrorFeedback:
    """Wrap ``codec`` with per-key residual memory.

    Example::

        ef = ErrorFeedback(codec("int2"))
        packet = ef.encode(grad, key="layer0.weight")
        approx = ef.decode(packet)
    """

    def __init__(self, codec: Codec) -> None:
        if isinstance(codec, ErrorFeedback):
            raise ValueError("ErrorFeedback(ErrorFeedback(...)): wrap a plain codec once")
        self.codec = codec
        # internal state: residual per key, fp32, same shape as the input
        self.residuals: dict[str, torch.Tensor] = {}

    @property
    def name(self) -> str:
        return self.codec.name

    @property
    def fixed_rate(self) -> bool:
        return self.codec.fixed_rate

    @property
    def alignment(self) -> int:
        return self.codec.alignment

    def spec(self) -> str:
        return f"ef({self.codec.spec()})"

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        return self.codec.wire_bytes(numel, dtype)

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        return self.codec.packet_layout(numel, dtype)

    def packet_from_bytes(self, buf: torch.Tensor, numel: int, shape: tuple[int, ...],
                          dtype: torch.dtype) -> Packet:
        return self.codec.packet_from_bytes(buf, numel, shape, dtype)

    def encode(self, x: torch.Tensor, *, key: str = "default", rng_stream: int = 0) -> Packet:
        """Encode ``x + residual[key]`` and update the residual."""
        old = self.residuals.get(key)
        if old is not None and old.shape != x.shape:
            raise ValueError(f"ErrorFeedback key {key!r}: shape {tuple(x.shape)} differs "
                             f"from the residual's {tuple(old.shape)}")
        compensated = x.float() + old if old is not None else x.float().clone()
        # the cast to x's dtype is part of what is lost: the residual includes it
        sent = saturate(compensated, x.dtype).to(x.dtype)
        packet = self.codec.encode(sent, rng_stream=rng_stream)
        new = compensated.sub_(self.codec.decode(packet).float())  # in place: one pass
        # keep the old memory where this step was not finite (no host sync to check)
        self.residuals[key] = torch.where(torch.isfinite(new), new,
                                          old if old is not None else 0.0)
        return packet

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode(packet, out)

    def decode_sum(self, packet: Packet) -> torch.Tensor:
        return self.codec.decode_sum(packet)

    def requantizes_into(self, other: Codec) -> bool:
        return False  # the residual needs the decoded values of what is sent

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict(),
                "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self.residuals = {k: v.clone().float() for k, v in state["residuals"].items()}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r})"
