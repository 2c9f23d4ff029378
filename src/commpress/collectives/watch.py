"""The error of what compressed collectives send, measured where the data already is.

Every compressed collective encodes its values into byte rows in one place
(:func:`commpress.collectives.chunks.encode_rows`: reduce-scatters, all-reduces, all-gathers,
all-to-alls, one level or two). While a :class:`Watch` is watching — a context, so that a
training loop samples every N steps, or one bucket, and pays nothing otherwise — each
encode also decodes its own rows and adds up, on the values' device:

- ``‖v − v̂‖²`` and ``‖v‖²``, ``v`` what the codec was given (with error feedback: the
  input plus the memory) and ``v̂`` what the peers decode — kept apart for encodes with
  and without error feedback, since a memory carries its encode's error to the next call;
- with error feedback, ``‖e‖²`` and ``‖x‖²``: the memory left after the encode, and the
  input ``x`` (the gradient) it was added to.

:meth:`Watch.read` turns them into the relative error ``‖v − v̂‖ / ‖v‖`` (of every encode;
``plain_rel_error``: of those without error feedback, whose error is lost) and the memory
ratio ``‖e‖ / ‖x‖`` (one host sync, when read). Sums, not per-call ratios: a watch over
several calls (a bucket's reduce-scatter and all-gather, every bucket of a step) weighs
each by its size. A call that sends exact values adds nothing: ``watched`` counts the
elements that were encoded lossily. The watch belongs to the thread (a ``ContextVar``) that
issued the call; the encode runs during the call, so an asynchronous call is measured
before it returns.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# what a watch sums: ‖v − v̂‖² and ‖v‖² of encodes without error feedback, the same of
# encodes with it, and their memory ‖e‖² and input ‖x‖²
SUMS = ("plain_err2", "plain2", "ef_err2", "ef2", "memory2", "given2")
_CURRENT: ContextVar[Watch | None] = ContextVar("commpress_watch", default=None)


class Watch:
    """Sums of the encoding error of the calls made while it watches (module docstring).

    Example::

        watch = commpress.Watch()
        with watch.watching():
            commpress.all_reduce(grad, "int2", label="dp.grad")
        watch.read()   # {"rel_error": 0.41, "memory_ratio": 0.0, "elements": 1048576}
    """

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None  # SUMS, fp64
        self.elements = 0
        self.calls = 0

    @contextmanager
    def watching(self) -> Iterator[Watch]:
        """Measure the encodes made on this thread inside the block."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def add(self, sent: torch.Tensor, decoded: torch.Tensor,
            memory: torch.Tensor | None = None, given: torch.Tensor | None = None) -> None:
        """One encode: ``sent`` (what the codec was given), ``decoded`` (what arrives) and,
        with error feedback, ``memory`` (the residual after it) and ``given`` (the input
        before the memory was added); no host sync."""
        v = sent.detach().reshape(-1).double()
        err2 = (v - decoded.detach().reshape(-1)[: v.numel()].double()).square().sum()
        norm2 = v.square().sum()
        zero = v.new_zeros(())
        if memory is None:
            sums = torch.stack([err2, norm2, zero, zero, zero, zero])
        else:
            x2 = given.detach().double().square().sum() if given is not None else zero
            sums = torch.stack([zero, zero, err2, norm2,
                                memory.detach().double().square().sum(), x2])
        self._sums = sums if self._sums is None else self._sums + sums.to(self._sums.device)
        self.elements += v.numel()
        self.calls += 1

    def read(self) -> dict[str, float]:
        """Over everything watched (0 when nothing lossy was encoded; NaN where the values
        were not finite): ``rel_error`` of every encode, ``plain_rel_error`` of those
        without error feedback, ``memory_ratio``; ``elements`` watched."""
        return {**signals(self.sums().tolist()), "elements": self.elements}

    def sums(self) -> torch.Tensor:
        """The raw sums (:data:`SUMS`; fp64, zeros before any encode): what ranks add up to
        agree on one signal (:func:`signals`)."""
        return (self._sums if self._sums is not None
                else torch.zeros(len(SUMS), dtype=torch.float64))

    def reset(self) -> None:
        self._sums, self.elements, self.calls = None, 0, 0


def signals(sums: list[float]) -> dict[str, float]:
    """The signals of :data:`SUMS` (one rank's, or every rank's added up)."""
    plain_err2, plain2, ef_err2, ef2, memory2, given2 = sums
    return {"rel_error": ratio(plain_err2 + ef_err2, plain2 + ef2),
            "plain_rel_error": ratio(plain_err2, plain2),
            "memory_ratio": ratio(memory2, given2)}


def ratio(num2: float, den2: float) -> float:
    """``sqrt(num2 / den2)``; NaN where either is not finite (never read as finite), 0
    for 0 / 0, inf for a positive error of nothing."""
    if not (math.isfinite(num2) and math.isfinite(den2)):
        return math.nan
    if den2 > 0:
        return math.sqrt(num2 / den2)
    return 0.0 if num2 == 0 else math.inf


def current() -> Watch | None:
    """The watch of the calls this thread makes now, if any."""
    return _CURRENT.get()
