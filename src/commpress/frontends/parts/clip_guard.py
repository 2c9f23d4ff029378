"""``torch.nn.utils.clip_grad_norm_`` on parameters whose gradients an optimizer holds.

:class:`~commpress.ShardedOptimizer` moves each gradient into its flat bucket during
backward (``param.grad`` is None after it), and only its ``step()`` reduces them across
ranks. torch's function would find no gradient there, clip nothing and return 0 — the
silent zero nanoGPT-style loops and accelerate's ``clip_grad_norm_`` would log. So while
such an optimizer holds gradients, torch's function (both names it has) passes those
parameters to the optimizer's own ``clip_grad_norm_``: the global norm across ranks, with
the same clipping. A call that holds some of an optimizer's parameters but not all, or
parameters of two optimizers, is refused: a global norm of part of a model is not what
the optimizer can compute. A holder may be reached through more than one view of its
parameters — :class:`~commpress.ShardedOptimizer`'s model parameters, and the fp32 master
shards in its ``param_groups`` that Lightning and ``accelerate`` clip — each view whole.
Parameters no optimizer holds go to torch's function unchanged. A loop that imported the
function before the optimizer existed (``from torch.nn.utils import clip_grad_norm_``)
keeps torch's original: call ``opt.clip_grad_norm_`` there.
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


# parameter → (the holder of its gradient, which of its views it is in); weak both ways:
# a dropped optimizer lets go
_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_VIEW_SIZES: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
_TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_


def hold(holder: GradientHolder, *views: Iterable[torch.Tensor]) -> None:
    """Route torch's ``clip_grad_norm_`` to ``holder`` from now on, over each of ``views``
    (each one whole set of tensors that stands for all of its parameters)."""
    ref = weakref.ref(holder)
    sizes = []
    for v, view in enumerate(views):
        tensors = list(view)
        for p in tensors:
            _HOLDERS[p] = (ref, v)
        sizes.append(len(tensors))
    _VIEW_SIZES[holder] = sizes
    _install()


def release(holder: GradientHolder, *views: Iterable[torch.Tensor]) -> None:
    """``holder`` gives its gradients back to ``param.grad``: torch's function sees the
    tensors of ``views`` again (those another holder took since stay routed to it)."""
    for view in views:
        for p in view:
            if _holder_of(p)[0] is holder:
                del _HOLDERS[p]


def _holder_of(p: torch.Tensor) -> tuple[GradientHolder | None, int]:
    ref, view = _HOLDERS.get(p, (None, -1))
    return (ref() if ref is not None else None), view


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, except over parameters a holder holds (module doc)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    held = {id(p): where for p in params if (where := _holder_of(p))[0] is not None}
    if not held:
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    holders = {id(h): h for h, _ in held.values()}
    if len(holders) > 1:
        raise InputError("clip_grad_norm_: the parameters belong to several "
                         f"{type(next(iter(holders.values()))).__name__}s; allowed: one "
                         "optimizer's parameters (clip each with its own clip_grad_norm_)")
    holder = next(iter(holders.values()))
    views = {v for _, v in held.values()}
    size = _VIEW_SIZES.get(holder, [0])[min(views)]
    others = [p for p in params if id(p) not in held and p.grad is not None]
    if others or len(views) > 1 or len(held) != size:
        raise InputError(f"clip_grad_norm_: {len(held)} of the {size} "
                         f"parameters of a {type(holder).__name__}"
                         + (f" and {len(others)} parameters with .grad outside it"
                            if others else "")
                         + (" (model parameters mixed with its param_groups' master "
                            "weights)" if len(views) > 1 else "")
                         + " were given; allowed: all of its parameters (the global norm "
                         "is of the whole model), e.g. model.parameters() or every "
                         "parameter of its param_groups")
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
