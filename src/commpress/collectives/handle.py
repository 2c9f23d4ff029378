"""Handles for asynchronous collectives: ``wait()`` finishes communication and decoding."""

from __future__ import annotations

from collections.abc import Callable

import torch


class Handle:
    """Returned by a collective called with ``async_op=True``.

    ``wait()`` runs the remaining steps (waiting for the transfer, decoding, reducing)
    exactly once and returns the result tensor; training code overlaps compute with
    the transfer by calling it as late as possible. Until then the collective's input
    and output tensors must stay untouched.
    """

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            with torch.no_grad():  # results are written in place, as torch's collectives do
                self._result = finish()
        assert self._result is not None
        return self._result


def completed(result: torch.Tensor) -> Handle:
    """A handle that is already done (world size 1, empty tensors)."""
    h = Handle(lambda: result)
    h.wait()
    return h
