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
from commpress.validate import InputError


class ErrorFeedback:
    """Residual memory around ``codec`` (grace's ``Memory``), per key.

    A collective applies it around its codec — :meth:`compensate` before the encode,
    :meth:`update` after — and reads and writes bytes with ``codec`` alone
    (:func:`split`). It is not a codec: none of a codec's members are forwarded, so a
    codec method can never be reached through it by mistake.

    Example::

        ef = ErrorFeedback(codec("int2"))
        packet = ef.encode(grad, key="layer0.weight")
        approx = ef.decode(packet)
    """

    def __init__(self, codec: Codec) -> None:
        if isinstance(codec, ErrorFeedback):
            raise InputError(f"ErrorFeedback({codec!r}): wrap a plain codec once")
        self.codec = codec
        # internal state: residual per key, fp32, same shape as the input
        self.residuals: dict[str, torch.Tensor] = {}

    def spec(self) -> str:
        return f"ef({self.codec.spec()})"

    def compensate(self, x: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(to encode, x + residual[key] in fp32)``; what is encoded is in ``x``'s dtype,
        saturated to its range."""
        old = self.residuals.get(key)
        if old is not None and old.shape != x.shape:
            raise InputError(f"ErrorFeedback key {key!r}: shape {tuple(x.shape)} differs "
                             f"from the residual's {tuple(old.shape)}")
        compensated = x.float() + old if old is not None else x.float().clone()
        # the cast to x's dtype is part of what is lost: the residual includes it
        return saturate(compensated, x.dtype).to(x.dtype), compensated

    def update(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """``residual[key] ← compensated − decoded`` where finite (else the old one)."""
        old = self.residuals.get(key)
        new = compensated.sub_(decoded.float())  # in place: one pass
        # keep the old memory where this step was not finite (no host sync to check)
        self.residuals[key] = torch.where(torch.isfinite(new), new,
                                          old if old is not None else 0.0)

    def encode(self, x: torch.Tensor, *, key: str = "default", rng_stream: int = 0) -> Packet:
        """Encode ``x + residual[key]`` with the codec and update the residual."""
        sent, compensated = self.compensate(x, key)
        packet = self.codec.encode(sent, rng_stream=rng_stream)
        self.update(key, compensated, self.codec.decode(packet))
        return packet

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode what :meth:`encode` sent (the codec's own decode)."""
        return self.codec.decode(packet, out)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict(),
                "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self.residuals = {k: v.clone().float() for k, v in state["residuals"].items()}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r})"


def split(coder: Codec | ErrorFeedback) -> tuple[Codec, ErrorFeedback | None]:
    """The codec that reads and writes the bytes, and the memory applied around it."""
    if isinstance(coder, ErrorFeedback):
        return coder.codec, coder
    return coder, None


def encode(coder: Codec | ErrorFeedback, x: torch.Tensor, *, rng_stream: int,
           key: str) -> Packet:
    """Encode ``x``, through the memory (keyed by ``key``) when there is one."""
    codec, memory = split(coder)
    if memory is None:
        return codec.encode(x, rng_stream=rng_stream)
    return memory.encode(x, key=key, rng_stream=rng_stream)
