"""A mixture-of-experts MLP: top-k routing, a load-balancing loss, dropless experts.

Each token's router picks its ``top_k`` experts; their outputs are added with the
router's probabilities renormalized over the chosen ones (Mixtral's gating). Every
token reaches its experts — no capacity, nothing dropped — and all experts run in one
grouped matmul (``torch._grouped_mm``) over the tokens sorted by expert.

With expert parallelism each rank holds ``n_local`` of the experts, from
``first_expert`` on, and an ``exchange`` (:class:`commpress.ep.EPExchange`, set by
:func:`commpress.parallel.expert.apply_ep`) sends each token to the rank of its expert
and the expert's output back; without one, every expert is here.

The load-balancing loss (Switch Transformer: ``E · Σ_e f_e · P_e``, the fraction of
this forward's assignments to expert ``e`` times its mean router probability) joins
the training loss through its gradient alone (:class:`_AddAuxLoss`), so a pipeline
stage needs no second loss and the reported loss is the language model's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward also hands ``aux`` a gradient of one, as if it had
    been added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = aux
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones_like(ctx.aux_like)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in groups ending at ``ends`` times each group's matrix of ``w``."""
    y = torch._grouped_mm(x, w, offs=ends)
    if y.requires_grad:  # its CPU backward refuses a broadcast (stride 0) gradient
        y.register_hook(lambda g: g.contiguous())
    return y


class MoE(nn.Module):
    """``n_expert`` experts (``d → hidden → d``, GELU), ``top_k`` per token."""

    def __init__(self, d: int, hidden: int, n_expert: int, top_k: int,
                 aux_loss_coef: float) -> None:
        super().__init__()
        self.n_expert, self.top_k, self.aux_loss_coef = n_expert, top_k, aux_loss_coef
        self.router = nn.Linear(d, n_expert, bias=False)
        self.w_in = nn.Parameter(torch.empty(n_expert, d, hidden))
        self.w_out = nn.Parameter(torch.empty(n_expert, hidden, d))
        self.first_expert, self.n_local = 0, n_expert
        self.exchange: Any = None  # an EPExchange with expert parallelism
        self.last_aux_loss: float | None = None

    def keep_experts(self, first: int, count: int) -> None:
        """Hold experts ``first … first + count − 1`` only (expert parallelism)."""
        self.w_in = nn.Parameter(self.w_in.detach()[first:first + count].clone())
        self.w_out = nn.Parameter(self.w_out.detach()[first:first + count].clone())
        self.first_expert, self.n_local = first, count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=self.n_expert)  # assignments per expert
        order = flat.argsort(stable=True)  # assignments grouped by expert
        routed = self._experts(tokens[order // self.top_k], counts)
        out = torch.empty_like(routed).index_copy_(0, order, routed)
        y = (out.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1)
        if self.training and self.aux_loss_coef:
            fraction = counts.to(probs.dtype) / flat.numel()
            aux = self.aux_loss_coef * self.n_expert * (fraction * probs.mean(0)).sum()
            self.last_aux_loss = aux.detach()
            y = _AddAuxLoss.apply(y, aux)
        return y.view(shape)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for ``rows`` (grouped by global expert, ``counts`` each),
        computed where each expert lives."""
        if self.exchange is None:
            return self._local(rows, counts)
        peers = self.n_expert // self.n_local
        sent = counts.view(peers, self.n_local)  # [peer, its expert]: rows this rank sends
        received = self.exchange.counts(sent)  # [peer, my expert]: rows each peer sends me
        to_peer, from_peer = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = self.exchange.dispatch(rows, to_peer, from_peer)  # by peer, then expert
        # regroup by expert (then peer) for the grouped matmul, and back
        block = torch.arange(received.numel(), device=rows.device)  # peer · n_local + expert
        key = (block % self.n_local) * peers + block // self.n_local
        order = key.repeat_interleave(received.reshape(-1)).argsort(stable=True)
        computed = self._local(arrived[order], received.sum(0))
        back = torch.empty_like(computed).index_copy_(0, order, computed)
        return self.exchange.combine(back, from_peer, to_peer)

    def _local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``rows`` grouped by expert, ``counts`` rows each."""
        ends = counts.cumsum(0).to(torch.int32)
        hidden = F.gelu(_grouped_mm(rows, self.w_in, ends))
        return _grouped_mm(hidden, self.w_out, ends)
