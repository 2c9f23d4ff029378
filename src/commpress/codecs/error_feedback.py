"""Error feedback: remember what a lossy codec dropped and send it next time.

For a residual ``e`` (zero at first) and input ``g``: send ``C(g + e)`` and keep
``e ← g + e − Ĉ(g + e)`` (Seide et al. 2014; Karimireddy et al. 2019). It makes biased
codecs (top-k, int2, sign-like) converge, and trims the error of the others. With a
``decay`` β < 1 (SparseLoCo's 0.95) the residual fades: send ``C(g + βe)``, so what a
sparse code leaves behind for long is forgotten instead of arriving stale.

The memory is kept apart from the codec (GRACE's compressor / memory split): a codec only
turns values into bytes and back; :class:`ErrorFeedback` only holds residuals; a
collective applies the memory around its codec — :meth:`ErrorFeedback.compensate` before
the encode, :meth:`ErrorFeedback.update` with the decoded values after — and so can
decode once what it sent (an all-gather takes this rank's decoded row from the gathered
bytes it decodes anyway).

Residuals are fp32, one per ``key`` (a label, or a label and part), and part of
``state_dict()``. Where the compensated value is not finite the old residual is kept: a
NaN/Inf step must not poison every later step through the memory. Where ``g + e`` is
finite but beyond the range of ``g``'s dtype (fp16's 65504), it saturates there before
encoding — the excess stays in the residual — rather than overflowing to ±Inf and
sending a non-finite value for finite input.
"""

from __future__ import annotations

from typing import Any

import torch

from commpress.codecs.base import Codec, Packet
from commpress.kernels.reference import saturate
from commpress.validate import InputError


class ErrorFeedback:
    """Residual memory (GRACE's ``Memory``), per key, held beside a codec.

    Collectives take it as ``memory=`` next to their ``codec``; each call site keeps its
    own (the memory belongs to the values it compresses).

    Example::

        memory = commpress.ErrorFeedback()
        commpress.all_reduce(grad, "int2", memory=memory, label="dp.grad")
    """

    def __init__(self, *args: object, decay: float = 1.0) -> None:
        if args:
            raise InputError(f"ErrorFeedback({', '.join(map(repr, args))}) is not allowed: the "
                             "memory holds no codec; allowed: ErrorFeedback(), passed as "
                             "memory= beside the codec (e.g. all_reduce(x, 'int2', "
                             "memory=ErrorFeedback()))")
        if not (isinstance(decay, int | float) and not isinstance(decay, bool)
                and 0 < decay <= 1):
            raise InputError(f"ErrorFeedback(decay={decay!r}) is not allowed; allowed: a "
                             "number in (0, 1] (1: the residual kept whole)")
        self.decay = float(decay)
        # internal state: residual per key, fp32, the shape of what is encoded
        self.residuals: dict[str, torch.Tensor] = {}

    def spec(self) -> str:
        return "ef" if self.decay == 1.0 else f"ef:decay={self.decay:g}"

    def compensate(self, x: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(to encode, x + residual[key] in fp32)``; what is encoded is in ``x``'s dtype,
        saturated to its range."""
        old = self.residuals.get(key)
        if old is not None and old.shape != x.shape:
            raise InputError(f"ErrorFeedback key {key!r}: shape {tuple(x.shape)} differs "
                             f"from the residual's {tuple(old.shape)}")
        if old is None:
            compensated = x.float().clone()
        else:
            compensated = x.float() + (old if self.decay == 1.0 else self.decay * old)
        # the cast to x's dtype is part of what is lost: the residual includes it
        return saturate(compensated, x.dtype).to(x.dtype), compensated

    def update(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """``residual[key] ← compensated − decoded`` where finite (else the old one);
        ``compensated`` (from :meth:`compensate`) is consumed."""
        old = self.residuals.get(key)
        new = compensated.sub_(decoded.reshape(compensated.shape).float())  # in place
        # keep the old memory where this step was not finite (no host sync to check)
        self.residuals[key] = torch.where(torch.isfinite(new), new,
                                          old if old is not None else 0.0)

    def encode(self, codec: Codec, x: torch.Tensor, *, key: str, rng_stream: int = 0
               ) -> Packet:
        """Encode ``x + residual[key]`` with ``codec`` and update the residual (a caller
        that decodes the packet anyway calls :meth:`compensate` and :meth:`update`
        itself, and decodes once)."""
        sent, compensated = self.compensate(x, key)
        packet = codec.encode(sent, rng_stream=rng_stream)
        self.update(key, compensated, codec.decode(packet))
        return packet

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone().float() for k, v in state["residuals"].items()}

    def __repr__(self) -> str:
        return f"ErrorFeedback({len(self.residuals)} residuals)"


def encode(codec: Codec, x: torch.Tensor, *, rng_stream: int, key: str,
           memory: ErrorFeedback | None = None) -> Packet:
    """Encode ``x`` with ``codec``, through ``memory`` (keyed by ``key``) when given."""
    if memory is None:
        return codec.encode(x, rng_stream=rng_stream)
    return memory.encode(codec, x, key=key, rng_stream=rng_stream)


def coder_state(codec: Codec, memory: ErrorFeedback | None) -> dict[str, Any]:
    """One call site's saved state: its codec's, and with memory ``{"codec": …,
    "residuals": …}`` (the layout checkpoints have always had)."""
    if memory is None:
        return codec.state_dict()
    return {"codec": codec.state_dict(), **memory.state_dict()}


def load_coder_state(codec: Codec, memory: ErrorFeedback | None,
                     state: dict[str, Any]) -> None:
    """Restore :func:`coder_state`; a state with memory for a site without it, or the
    reverse, is refused by name."""
    saved_memory = isinstance(state, dict) and "residuals" in state
    if saved_memory != (memory is not None):
        raise InputError(f"codec state {'with' if saved_memory else 'without'} error-feedback "
                         f"memory for a {codec.spec()} site "
                         f"{'with' if memory is not None else 'without'} it: resume with the "
                         "same policy")
    if memory is None:
        codec.load_state_dict(state)
        return
    codec.load_state_dict(state["codec"])
    memory.load_state_dict(state)
