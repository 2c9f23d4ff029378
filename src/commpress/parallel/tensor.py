"""Megatron-style tensor parallelism with compressed all-reduces.

Attention and MLP become column-parallel first layers (``qkv``, ``fc``: each rank holds
a slice of the output features — whole heads for attention) and row-parallel second
layers (``proj``, ``out``: a slice of the input features, partial sums all-reduced).
Two autograd functions carry the communication (Shoeybi et al., 2019):

* :class:`_CopyToTP` — identity forward; backward all-reduces the input gradient
  with the policy's ``tp.act_grad`` codec;
* :class:`_ReduceFromTP` — forward all-reduces the partial output with ``tp.act``;
  identity backward.

Both use :func:`commpress.all_reduce`, whose result is bitwise identical on every
rank, so replicated parameters (norms, embeddings) get identical gradients.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from commpress.codecs import Codec, ErrorFeedback
from commpress.codecs.error_feedback import coder_state, load_coder_state
from commpress.collectives import all_reduce
from commpress.policy import Policy
from commpress.validate import InputError

log = logging.getLogger(__name__)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, codec, memory, label):
        ctx.group, ctx.codec, ctx.memory, ctx.label = group, codec, memory, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.codec, group=ctx.group, op="sum", label=ctx.label,
                   memory=ctx.memory)
        return grad, None, None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, codec, memory, label):
        y = x.contiguous().clone()
        all_reduce(y, codec, group=group, op="sum", label=label, memory=memory)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class ColumnParallelLinear(nn.Module):
    """``y_local = x W_local^T + b_local`` with the output features split across ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, codec,
                 memory: ErrorFeedback | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        # tp.act_grad (backward all-reduce), and its error feedback if the policy asks
        self.group, self.codec, self.memory = group, codec, memory
        for p in self.parameters():
            p.tp_sharded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group, self.codec, self.memory, "tp.act_grad")
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = Σ_ranks x_local W_local^T + b`` with the input features split across ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, codec,
                 memory: ErrorFeedback | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        # tp.act (forward all-reduce), and its error feedback if the policy asks
        self.group, self.codec, self.memory = group, codec, memory
        self.weight.tp_sharded = True  # the bias is added after the reduce: replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.group, self.codec, self.memory,
                                "tp.act")
        return y + self.bias if self.bias is not None else y


def is_tp_sharded(p: nn.Parameter) -> bool:
    """Whether a parameter holds a slice (True) or a replica (False) across TP ranks."""
    return getattr(p, "tp_sharded", False)


def tp_norm_weights(module: nn.Module, tp: int) -> dict[str, float]:
    """Weights of the squared gradient norm's parts: ``1/tp`` for the parameters every
    tensor-parallel rank holds a replica of (summed over the ranks they count once)."""
    if tp == 1:
        return {}
    return {n: 1.0 / tp for n, p in module.named_parameters() if not is_tp_sharded(p)}


def codec_states(module: nn.Module) -> dict[str, dict]:
    """Codec states (stochastic counters, error-feedback memory) of the TP layers."""
    return {name: coder_state(m.codec, m.memory) for name, m in module.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)}


def load_codec_states(module: nn.Module, states: dict[str, dict]) -> None:
    for name, m in module.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            load_coder_state(m.codec, m.memory, states[name])


def _rows(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[idx]


def _coder(policy: Policy, kind: str) -> tuple[Codec, ErrorFeedback | None]:
    """A fresh codec and memory for one layer's ``tp.kind`` all-reduce."""
    return policy.codec_for("tp", kind), policy.memory_for("tp", kind)


def apply_tp(blocks: nn.ModuleList, group: dist.ProcessGroup | None, policy: Policy) -> None:
    """Split every block's attention and MLP across the tensor-parallel ``group``, in place."""
    tp = dist.get_world_size(group) if group is not None else 1
    if tp == 1:
        return
    rank = dist.get_rank(group)
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        if attn.n_head % tp:
            raise InputError(f"n_head={attn.n_head} is not divisible by tp={tp}; allowed: a tp "
                             "that divides the number of heads")
        C = attn.proj.in_features
        heads_local = attn.n_head // tp
        # qkv rows are [q; k; v], each split by heads: take this rank's heads of each
        width = heads_local * attn.head_dim
        idx = torch.cat([torch.arange(part * C + rank * width, part * C + (rank + 1) * width)
                         for part in range(3)])
        attn.qkv = ColumnParallelLinear(attn.qkv.weight[idx], _rows(attn.qkv.bias, idx), group,
                                        *_coder(policy, "act_grad"))
        attn.proj = RowParallelLinear(attn.proj.weight[:, rank * width:(rank + 1) * width],
                                      attn.proj.bias, group, *_coder(policy, "act"))
        attn.n_head = heads_local
        hidden = mlp.fc.out_features // tp
        cols = torch.arange(rank * hidden, (rank + 1) * hidden)
        mlp.fc = ColumnParallelLinear(mlp.fc.weight[cols], _rows(mlp.fc.bias, cols), group,
                                      *_coder(policy, "act_grad"))
        mlp.out = RowParallelLinear(mlp.out.weight[:, cols], mlp.out.bias, group,
                                    *_coder(policy, "act"))
    log.info("Applied tensor parallelism (tp=%d) to %d blocks", tp, len(blocks))
