"""Pipeline parallelism: the GPT split into stages, GPipe schedule, compressed p2p.

Stage ``s`` of ``pp`` holds a contiguous, balanced range of blocks; the first stage
also holds the embeddings, the last the final norm and the output head. A step runs
every micro-batch forward (activations sent downstream with the policy's ``pp.act``
codec), then every micro-batch backward in reverse (activation gradients sent
upstream with ``pp.act_grad``). GPipe keeps all micro-batches' activations alive;
1F1B would bound that memory and is the next step.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from commpress.collectives import isend, recv
from commpress.model.gpt import GPT
from commpress.parallel.mesh import Mesh
from commpress.policy import Policy

log = logging.getLogger(__name__)


def stage_layers(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Balanced ``[start, end)`` block ranges, earlier stages taking the remainder."""
    if pp > n_layer:
        raise ValueError(f"pp={pp} is larger than n_layer={n_layer}; allowed: pp <= n_layer")
    base, extra = divmod(n_layer, pp)
    out, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


class Stage(nn.Module):
    """One pipeline stage of a :class:`GPT` (the whole model when ``pp == 1``)."""

    def __init__(self, model: GPT, index: int, count: int) -> None:
        super().__init__()
        self.index, self.count = index, count
        start, end = stage_layers(model.cfg.n_layer, count)[index]
        self.cfg = model.cfg
        self.wte = model.wte if index == 0 else None
        self.wpe = model.wpe if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[start:end])
        self.ln_f = model.ln_f if index == count - 1 else None
        self.lm_head = model.lm_head if index == count - 1 else None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            T = x.shape[1]
            x = self.wte(x) + self.wpe(torch.arange(T, device=x.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return x


class GPipe:
    """Runs a training or evaluation step of one stage in a GPipe schedule."""

    def __init__(self, stage: Stage, mesh: Mesh, policy: Policy, micro_batches: int) -> None:
        self.stage, self.mesh, self.micro = stage, mesh, micro_batches
        self.act_codec = policy.codec_for("pp", "act")
        self.grad_codec = policy.codec_for("pp", "act_grad")

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        dtype = next(self.stage.parameters()).dtype
        return torch.empty(B, T, self.stage.cfg.n_embd, device=x.device, dtype=dtype)

    def _recv(self, like: torch.Tensor, src: int, codec, label: str) -> torch.Tensor:
        return recv(like, src, codec, group=self.mesh.pp_group, label=label)

    def step(self, x: torch.Tensor, y: torch.Tensor, sync_ctx=None,
             train: bool = True) -> float:
        """Forward (and backward when ``train``) all micro-batches of this rank's batch.

        Returns the batch's mean loss on every stage (broadcast from the last).
        ``sync_ctx`` (e.g. ``optimizer.no_sync``) wraps every backward but the last, so
        gradients are communicated once per step.
        """
        stage, mesh = self.stage, self.mesh
        xs, ys = x.chunk(self.micro), y.chunk(self.micro)
        prev, nxt = mesh.pp_idx - 1, mesh.pp_idx + 1
        inputs, outputs, sends = [], [], []
        loss_sum = torch.zeros((), device=x.device)
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        with grad_mode:
            for xm, ym in zip(xs, ys):
                if stage.first:
                    inp = xm
                else:
                    inp = self._recv(self._hidden(xm), prev, self.act_codec, "pp.act")
                    inp.requires_grad_(train)
                out = stage(inp)
                if stage.last:
                    loss = F.cross_entropy(out.reshape(-1, out.size(-1)), ym.reshape(-1))
                    loss_sum += loss.detach()
                    out = loss / self.micro
                else:
                    sends.append(isend(out.detach(), nxt, self.act_codec, group=mesh.pp_group,
                                       label="pp.act"))
                inputs.append(inp)
                outputs.append(out)
        if train:
            for i in reversed(range(self.micro)):
                ctx = sync_ctx() if (sync_ctx is not None and i > 0) else nullcontext()
                with ctx:
                    if stage.last:
                        outputs[i].backward()
                    else:
                        g = self._recv(torch.empty_like(outputs[i]), nxt, self.grad_codec,
                                       "pp.act_grad")
                        outputs[i].backward(g)
                if not stage.first:
                    sends.append(isend(inputs[i].grad, prev, self.grad_codec,
                                       group=mesh.pp_group, label="pp.act_grad"))
        for h in sends:
            h.wait()
        loss_mean = loss_sum / self.micro
        if mesh.shape.pp > 1:
            dist.broadcast(loss_mean, src=mesh.pp_ranks[-1], group=mesh.pp_group)
        return float(loss_mean)
