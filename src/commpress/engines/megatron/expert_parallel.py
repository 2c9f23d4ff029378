"""Megatron-core's expert-parallel token all-to-alls through the policy's ``ep`` codecs.

``MoEAlltoAllTokenDispatcher`` moves tokens with ``mappings.all_to_all`` (bound by name in
``token_dispatcher``): twice in ``token_dispatch`` (the tokens, and their routing
probabilities) and once in ``token_combine`` (the experts' outputs), each an autograd
function whose backward is the reverse exchange. Here ``token_dispatch`` and
``token_combine`` mark which direction runs, and the dispatcher's ``all_to_all`` sends a
covered group's token rows through its :class:`~commpress.ep.EPExchange` — the
direction's codec forward, its ``*_grad`` codec backward. What is not a token matrix (the
probabilities, a 1-D vector of one value per token) and every uncovered group stay
Megatron's own.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from commpress.engines.megatron.seams import REGISTRY, Direction
from commpress.engines.seam import Swap

_direction = Direction()  # dispatch or combine, set by the dispatcher's method above

def token_dispatch(self, *args: Any, **kwargs: Any) -> Any:
    """Replaces ``MoEAlltoAllTokenDispatcher.token_dispatch``: its exchange is a dispatch."""
    with _direction("dispatch"):
        return DISPATCH.original(self, *args, **kwargs)


def token_combine(self, *args: Any, **kwargs: Any) -> Any:
    """Replaces ``MoEAlltoAllTokenDispatcher.token_combine``: its exchange is a combine."""
    with _direction("combine"):
        return COMBINE.original(self, *args, **kwargs)


def all_to_all(group: Any, input_: torch.Tensor, output_split_sizes_=None,
               input_split_sizes=None) -> torch.Tensor:
    """Replaces the dispatcher's ``all_to_all``: a covered group's tokens → ``ep``."""
    ep = REGISTRY.ep.get(group)
    kind = _direction.kind
    if (ep is None or kind is None or input_.dim() != 2 or output_split_sizes_ is None
            or input_split_sizes is None):
        return A2A.original(group, input_, output_split_sizes_, input_split_sizes)
    # Megatron hands the splits over as host numpy arrays (or lists)
    out_splits = [int(s) for s in output_split_sizes_]
    in_splits = [int(s) for s in input_split_sizes]
    return getattr(ep, kind)(input_, in_splits, out_splits)


A2A = Swap(token_dispatcher, "all_to_all", all_to_all)
DISPATCH = Swap(MoEAlltoAllTokenDispatcher, "token_dispatch", token_dispatch)
COMBINE = Swap(MoEAlltoAllTokenDispatcher, "token_combine", token_combine)
EP_SWAPS = [A2A, DISPATCH, COMBINE]
