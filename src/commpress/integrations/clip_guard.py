"""``torch.nn.utils.clip_grad_norm_`` on parameters whose gradients an optimizer holds.

:class:`~commpress.ShardedOptimizer` moves each gradient into its flat bucket during
backward (``param.grad`` is None after it), and only its ``step()`` reduces them across
ranks. torch's function would find no gradient there, clip nothing and return 0 — the
silent zero nanoGPT-style loops and accelerate's ``clip_grad_norm_`` would log. So while
such an optimizer holds gradients, torch's function (both names it has) passes those
parameters to the optimizer's own ``clip_grad_norm_``: the global norm across ranks, with
the same clipping. A call that holds some of an optimizer's parameters but not all, or
parameters of two optimizers, is refused: a global norm of part of a model is not what
the optimizer can compute. Parameters no optimizer holds go to torch's function
unchanged. A loop that imported the function before the optimizer existed (``from
torch.nn.utils import clip_grad_norm_``) keeps torch's original: call
``opt.clip_grad_norm_`` there.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.utils.weak import WeakIdKeyDictionary

from commpress.validate import InputError


class GradientHolder(Protocol):
    """An optimizer that holds its parameters' gradients outside ``param.grad``."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


# parameter → the holder of its gradient (weak both ways: a dropped optimizer lets go)
_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_COUNTS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_


def hold(holder: GradientHolder, params: Iterable[torch.Tensor]) -> None:
    """Route torch's ``clip_grad_norm_`` over ``params`` to ``holder`` from now on."""
    params = list(params)
    ref = weakref.ref(holder)
    for p in params:
        _HOLDERS[p] = ref
    _COUNTS[holder] = len(params)
    _install()


def release(holder: GradientHolder, params: Iterable[torch.Tensor]) -> None:
    """``holder`` gives ``params``' gradients back to ``param.grad``: torch's function
    sees them again (those another holder took since stay routed to it)."""
    for p in params:
        if _holder_of(p) is holder:
            del _HOLDERS[p]


def _holder_of(p: torch.Tensor) -> GradientHolder | None:
    ref = _HOLDERS.get(p)
    return ref() if ref is not None else None


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, except over parameters a holder holds (module doc)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    held = [(p, h) for p in params if (h := _holder_of(p)) is not None]
    if not held:
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    holders = {id(h): h for _, h in held}
    if len(holders) > 1:
        raise InputError("clip_grad_norm_: the parameters belong to several "
                         f"{type(held[0][1]).__name__}s; allowed: one optimizer's "
                         "parameters (clip each with its own clip_grad_norm_)")
    holder = held[0][1]
    others = [p for p in params if _holder_of(p) is None and p.grad is not None]
    if others or len({id(p) for p, _ in held}) != _COUNTS.get(holder, 0):
        raise InputError(f"clip_grad_norm_: {len(held)} of the {_COUNTS.get(holder, 0)} "
                         f"parameters of a {type(holder).__name__}"
                         + (f" and {len(others)} parameters with .grad outside it"
                            if others else "")
                         + " were given; allowed: all of its parameters (the global norm "
                         "is of the whole model), e.g. model.parameters()")
    norm = holder.clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm "
                           "anyway, set `error_if_nonfinite=False`")
    return norm


def _install() -> None:
    """Put :func:`clip_grad_norm_` under both names torch exports (once)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
