"""FSDP2 integration: compressed all-gather of weights and reduce-scatter of gradients.

``commpress.fsdp.compress(model, policy)`` installs, on every ``FSDPModule`` of
``model``, a custom ``AllGather`` (the policy's ``dp.param`` codec applied to the
weights themselves) and ``ReduceScatter`` (``dp.grad``: TLq-HS when the policy names
``intra``/``inter`` codecs). FSDP2 frees the gathered weights after use, so there is
no persistent copy to take differences against: a ``delta`` (qWD) rule cannot apply
here and the weights are gathered exactly instead (logged) — use
:class:`~commpress.ShardedOptimizer` for qWD.

Both run synchronously inside FSDP's communication streams and return ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from commpress.collectives import Topology, all_gather
from commpress.collectives.comm import all_gather_single
from commpress.integrations.grad_path import GradPath
from commpress.policy import Policy

log = logging.getLogger(__name__)


class _Allocate:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedAllGather(_Allocate, AllGather):
    """FSDP2 all-gather of the sharded weights through a commpress codec."""

    def __init__(self, codec, label: str = "dp.param") -> None:
        self.codec = codec
        self.label = label

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        if not input_tensor.is_floating_point():
            # mixed-dtype parameters travel as raw bytes: nothing to quantize
            all_gather_single(output_tensor, input_tensor, group)
            return None
        all_gather(output_tensor, input_tensor, self.codec, group=group, label=self.label)
        return None


class CompressedReduceScatter(_Allocate, ReduceScatter):
    """FSDP2 reduce-scatter of gradients (one- or two-level) through commpress codecs.

    Accepts ``ReduceOp.AVG``, ``ReduceOp.SUM`` and ``ReduceOp.PREMUL_SUM(factor)``
    (FSDP passes it for a custom gradient divide factor): the input is scaled by
    ``factor`` and summed.
    """

    def __init__(self, grad_path: GradPath) -> None:
        self.grad_path = grad_path

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        self.grad_path.reduce_scatter(output_tensor, input_tensor, group,
                                      op=_op_name(op, input_tensor))
        return None


def _op_name(op, input_tensor: torch.Tensor) -> str:
    red = dist.ReduceOp
    if op == red.AVG or getattr(op, "op", None) == red.RedOpType.AVG:
        return "avg"
    if op == red.SUM or getattr(op, "op", None) == red.RedOpType.SUM:
        return "sum"
    factor = getattr(op, "factor", None)
    if factor is not None:
        input_tensor.mul_(factor)
        return "sum"
    raise ValueError(f"commpress FSDP reduce-scatter: op {op!r} is not supported; "
                     "allowed: AVG, SUM, PREMUL_SUM")


def compress(model: nn.Module, policy: str | dict | Policy = "sdp4bit",
             topology: Topology | None = None) -> int:
    """Install compressed collectives on every FSDPModule in ``model``; returns the count.

    Call after ``fully_shard``. Example::

        for block in model.blocks: fully_shard(block)
        fully_shard(model)
        commpress.fsdp.compress(model, "zeropp")
    """
    policy = Policy.resolve(policy)
    topology = topology or Topology()
    param_rule = policy.rule("dp", "param")
    if param_rule.delta:
        log.warning("commpress.fsdp: policy %s asks for weight differences (qWD) on dp.param, "
                    "which FSDP2 cannot keep; weights are all-gathered exactly", policy.name)
    count = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_codec = "none" if param_rule.delta else param_rule.build()
        module.set_custom_all_gather(CompressedAllGather(param_codec))
        module.set_custom_reduce_scatter(CompressedReduceScatter(GradPath(policy, topology)))
        count += 1
    if count == 0:
        raise ValueError("commpress.fsdp.compress: no FSDPModule found; call fully_shard first")
    log.info("Applied commpress %s to %d FSDP modules", policy.name, count)
    return count
