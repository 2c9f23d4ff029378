"""torchtitan integration: compress a torchtitan model's FSDP2 traffic (HSDP included).

torchtitan shards its models with FSDP2 (``apply_fsdp_to_decoder`` in
``torchtitan.distributed.fsdp``; a 2-D ``["dp_replicate", "fsdp"]`` mesh when
``data_parallel_replicate_degree > 1`` is HSDP). :func:`compress` installs commpress's
collectives on those FSDP modules: call it at the end of the model's parallelize step
(after ``apply_fsdp_to_decoder``) or on the trainer's ``model_parts`` once built::

    model = parallelize_llama(model, parallel_dims=..., ...)
    comm = commpress.torchtitan.compress(model, "sdp4bit")

torchtitan's trainer sets FSDP's gradient divide factor to 1.0 (it scales by the token
count itself); the compressed reduce-scatter and replicate all-reduce honour it.

The codec state (error-feedback residuals, rounding counters) is a DCP ``Stateful``:
add it to the checkpointer's states so it is saved and loaded with the model::

    trainer.checkpointer.states["commpress"] = comm

Resuming on another number of ranks (torchtitan's checkpoints reshard through DCP), put
``comm.elastic()`` there instead: the codecs then start fresh, said once. ``comm.remove()``
gives FSDP its own collectives back.

Mixture-of-experts models (Qwen3-MoE, DeepSeek-V3, … with expert parallelism): where the
policy names ``ep`` rules, every ``AllToAllTokenDispatcher`` with an
expert-parallel mesh sends its tokens through an :class:`~commpress.ep.EPExchange` of its
own — dispatch and combine forward, and their gradients backward — in place of its two
token exchanges (``_dispatch_token_exchange``, ``_combine_token_exchange``; the small
count exchange stays torchtitan's). ``remove()`` gives the stock dispatchers back; a
policy without ``ep`` rules touches nothing. The ``ep`` codecs round to nearest, so they keep no
state (the policy refuses stochastic rounding on ``ep``): a checkpoint holds only the
FSDP part's. A model with expert parallelism and no
FSDP gets an :class:`ExpertCompression` handle (the same verbs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torchtitan  # noqa: F401  (the engine this adapter is for: missing means an ImportError)
from torch.distributed.fsdp import FSDPModule
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from commpress.collectives import Topology
from commpress.collectives.agreement import agree_across, rendezvous
from commpress.engines import fsdp
from commpress.engines.fsdp import FSDPCompression
from commpress.engines.seam import Swap, install, restore
from commpress.ep import EPExchange
from commpress.policy import Policy
from commpress.validate import InputError

log = logging.getLogger(__name__)
WHAT = "commpress.torchtitan.compress"


class ExpertCompression:
    """The expert-parallel token exchanges :func:`compress` installed, by dispatcher name
    (the MoE module's, as ``model.named_modules()`` gives it). Stateless (``ep`` codecs
    round to nearest): :meth:`state_dict` holds the policy, which a load checks."""

    def __init__(self, policy: Policy, exchanges: dict[str, EPExchange],
                 swaps: list[Swap]) -> None:
        self.policy, self.exchanges, self._swaps = policy, exchanges, swaps

    def state_dict(self) -> dict[str, Any]:
        return {"policy": repr(self.policy.to_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.state_dict():
            raise InputError(f"{WHAT}: expert-parallel state {state!r} was saved under another "
                             f"policy than this run's {self.policy.name!r}: resume with the "
                             "same policy")

    def remove(self) -> None:
        """Give every dispatcher its own token exchanges back. Idempotent."""
        if self._swaps:
            restore(self._swaps)
            self._swaps = []
            log.info("Removed commpress %s from %d expert-parallel dispatchers",
                     self.policy.name, len(self.exchanges))


def compress(model: nn.Module | Sequence[nn.Module], policy: str | dict | Policy = "sdp4bit",
             topology: Topology | None = None, *, fallback: str | None = None
             ) -> FSDPCompression | ExpertCompression:
    """Compress the FSDP2 collectives of a torchtitan model (or its ``model_parts``,
    pipeline stages) by ``policy``, and its expert-parallel token all-to-alls where the
    policy names ``ep`` codecs; returns the handle to checkpoint and ``remove()``: the
    :class:`FSDPCompression` (which also restores the dispatchers), or for a model with
    expert parallelism and no FSDP an :class:`ExpertCompression`.

    The FSDP modules are named as in ``model.named_modules()``; with several model parts,
    prefixed by the part's index (``"0.layers.1"``). ``fallback="measured"``: each FSDP
    module's collectives are timed compressed and exact in their first calls and stay
    compressed only where faster (:mod:`commpress.dp.fallback`); None: the policy's.
    """
    if isinstance(model, nn.Module):
        root = model
    else:
        parts = list(model)
        if not parts or not all(isinstance(p, nn.Module) for p in parts):
            raise InputError(f"{WHAT}: model must be an nn.Module or a non-empty list of them "
                             f"(model_parts); got {model!r}")
        root = nn.ModuleList(parts)
    policy = Policy.resolve(policy).with_fallback(fallback)
    experts = compress_experts(root, policy)
    if not any(isinstance(m, FSDPModule) for m in root.modules()):
        if experts is None:
            raise InputError(f"{WHAT}: the model has no FSDPModule (call fully_shard, or "
                             "torchtitan's parallelize, first) and no expert-parallel "
                             "dispatcher whose tokens the policy's ep codecs compress")
        return experts
    try:
        comm = fsdp.compress(root, policy, topology)
    except BaseException:
        if experts is not None:
            experts.remove()
        raise
    if experts is not None:
        comm.also_remove(experts.remove)
    return comm


def compress_experts(model: nn.Module, policy: Policy) -> ExpertCompression | None:
    """Route every expert-parallel ``AllToAllTokenDispatcher`` of ``model`` through an
    :class:`EPExchange` of the policy (None where the policy names no ``ep`` rule or the
    model has no such dispatcher; ``ep`` rules of ``none`` are torchtitan's exchange, bit
    for bit, with commpress's agreement and counters). Ranks of each expert-parallel group
    first agree on the policy and on which dispatchers they compress."""
    if not policy.names("ep"):
        return None
    found = [(name, m.token_dispatcher) for name, m in model.named_modules()
             if isinstance(getattr(m, "token_dispatcher", None), AllToAllTokenDispatcher)
             and m.token_dispatcher.ep_mesh is not None]
    if not found:
        return None
    groups = {id(d.ep_mesh.get_group()): d.ep_mesh.get_group() for _, d in found}
    names = [name for name, _ in found]
    for group in groups.values():
        rendezvous(group, "torchtitan.compress_experts")
    agree_across("torchtitan.compress_experts",
                 [(g, {"label": "ep", "policy": policy.to_dict(), "dispatchers": names})
                  for g in groups.values()])
    exchanges, swaps = {}, []
    for name, dispatcher in found:
        ep = exchanges[name] = EPExchange(policy, dispatcher.ep_mesh.get_group())
        swaps += [Swap(dispatcher, "_dispatch_token_exchange", _dispatch(ep)),
                  Swap(dispatcher, "_combine_token_exchange", _combine(ep))]
    log.info("commpress %s on the token all-to-alls of %d expert-parallel dispatchers",
             policy.name, len(found))
    return ExpertCompression(policy, exchanges, install(swaps))


def _dispatch(ep: EPExchange):
    def exchange(routed_input: torch.Tensor, pg: Any, output_splits: list[int],
                 input_splits: list[int]) -> torch.Tensor:
        return ep.dispatch(routed_input, input_splits, output_splits)
    return exchange


def _combine(ep: EPExchange):
    # torchtitan's combine receives input_splits[j] rows from rank j and sends it
    # output_splits[j]: the dispatch's splits, the other way
    def exchange(routed_output: torch.Tensor, pg: Any, input_splits: list[int],
                 output_splits: list[int]) -> torch.Tensor:
        return ep.combine(routed_output, output_splits, input_splits)
    return exchange


__all__ = ["ExpertCompression", "FSDPCompression", "compress", "compress_experts"]
