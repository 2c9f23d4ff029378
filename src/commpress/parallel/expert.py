"""Expert parallelism: each rank of an expert-parallel group holds ``n_expert / ep`` of
every mixture-of-experts layer's experts, and tokens travel to them through the group's
compressed all-to-alls (:class:`commpress.ep.EPExchange`, the policy's ``ep`` axis).

The expert-parallel group borrows from data parallelism, as torchtitan and Megatron lay
it out: ``ep`` consecutive data-parallel ranks share one copy of the experts; each copy
is replicated over the ``dp / ep`` ranks of its expert-data-parallel group, which reduces
the experts' gradients (the dense weights are reduced over the whole data-parallel group).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from commpress.collectives.topology import Topology
from commpress.ep import EPExchange
from commpress.model.moe import MoE
from commpress.policy import Policy
from commpress.validate import InputError


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def apply_ep(module: nn.Module, group: dist.ProcessGroup, policy: Policy,
             topology: Topology | None = None) -> None:
    """Keep this rank's experts of every MoE layer in ``module`` and route tokens to the
    other ranks of ``group`` through one :class:`EPExchange` of ``policy``'s ``ep`` codecs."""
    ep, index = dist.get_world_size(group), dist.get_rank(group)
    exchange = EPExchange(policy, group, topology=topology)
    for layer in moe_layers(module):
        if layer.n_expert % ep:
            raise InputError(f"ep={ep} does not divide n_expert={layer.n_expert}; allowed: "
                             "an expert-parallel degree that divides the number of experts")
        count = layer.n_expert // ep
        layer.keep_experts(index * count, count)
        layer.exchange = exchange


def split_experts(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``module``'s trained parameters as (dense, experts): the experts are reduced over
    their expert-data-parallel group, the rest over the whole data-parallel group."""
    experts = {id(p) for layer in moe_layers(module) for p in (layer.w_in, layer.w_out)}
    trained = [p for p in module.parameters() if p.requires_grad]
    return ([p for p in trained if id(p) not in experts],
            [p for p in trained if id(p) in experts])
