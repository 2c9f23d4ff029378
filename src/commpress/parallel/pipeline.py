"""Pipeline parallelism: the GPT split into stages, GPipe schedule, compressed p2p.

Stage ``s`` of ``pp`` holds a contiguous, balanced range of blocks; the first stage
also holds the embeddings, the last the final norm and the output head. A step runs
every micro-batch forward (activations sent downstream with the policy's ``pp.act``
codec), then every micro-batch backward in reverse (activation gradients sent
upstream with ``pp.act_grad``). GPipe keeps all micro-batches' activations alive;
1F1B would bound that memory and is the next step.

One schedule serves a real rank, which holds one stage and moves tensors between
processes (:class:`ProcessP2P`), and ``commpress simulate``, which holds every stage of
a played rank and plays each transfer in-process (:class:`PlayedP2P`): the schedule
never asks which.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from commpress.codecs.error_feedback import coder_state, load_coder_state
from commpress.collectives import isend, recv
from commpress.collectives.byte_stats import Stats
from commpress.collectives.played import played_transfer
from commpress.model.gpt import GPT
from commpress.parallel.mesh import Mesh, MeshShape
from commpress.policy import Policy
from commpress.validate import InputError

KINDS = ("act", "act_grad")


def stage_layers(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Balanced ``[start, end)`` block ranges, earlier stages taking the remainder."""
    if pp > n_layer:
        raise InputError(f"pp={pp} is larger than n_layer={n_layer}; allowed: pp <= n_layer")
    base, extra = divmod(n_layer, pp)
    start = [s * base + min(s, extra) for s in range(pp + 1)]  # the first `extra` get one more
    return list(zip(start[:-1], start[1:]))


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


class ProcessP2P:
    """The pipeline's transfers between processes: this rank's stage sends with
    :func:`commpress.isend` and receives with :func:`commpress.recv` over the ``pp`` group;
    its codecs are this rank's own."""

    def __init__(self, mesh: Mesh, policy: Policy) -> None:
        self.mesh = mesh
        self.codecs = {kind: policy.codec_for("pp", kind) for kind in KINDS}
        self.memories = {kind: policy.memory_for("pp", kind) for kind in KINDS}  # the sends'
        self._sends: list = []

    def send(self, kind: str, src: int, dst: int, tensor: torch.Tensor) -> None:
        self._sends.append(isend(tensor, dst, self.codecs[kind], group=self.mesh.pp_group,
                                 label=f"pp.{kind}", memory=self.memories[kind]))

    def recv(self, kind: str, src: int, dst: int, like: torch.Tensor) -> torch.Tensor:
        return recv(like, src, self.codecs[kind], group=self.mesh.pp_group, label=f"pp.{kind}")

    def finish(self, loss_mean: torch.Tensor) -> None:
        """Wait for the step's sends; every stage gets the last stage's loss."""
        for h in self._sends:
            h.wait()
        self._sends = []
        if self.mesh.shape.pp > 1:
            dist.broadcast(loss_mean, src=self.mesh.pp_ranks[-1], group=self.mesh.pp_group)

    def state_dict(self) -> dict:
        return {kind: coder_state(codec, self.memories[kind])
                for kind, codec in self.codecs.items()}

    def load_state_dict(self, state: dict) -> None:
        for kind, codec in self.codecs.items():
            load_coder_state(codec, self.memories[kind], state[kind])


class PlayedP2P:
    """The pipeline's transfers of one data-parallel rank whose every stage this process
    holds: each send is :func:`~commpress.collectives.played.played_transfer` (the bytes
    ``isend`` and ``recv`` would make, through each stage's own codecs), received next."""

    def __init__(self, policy: Policy, shape: MeshShape, dp_idx: int, tp_idx: int,
                 stats: Stats) -> None:
        self.shape, self.dp_idx, self.tp_idx, self.stats = shape, dp_idx, tp_idx, stats
        self.codecs = {kind: [policy.codec_for("pp", kind) for _ in range(shape.pp)]
                       for kind in KINDS}
        self.memories = {kind: [policy.memory_for("pp", kind) for _ in range(shape.pp)]
                         for kind in KINDS}
        self._sent: dict[tuple[str, int, int], torch.Tensor] = {}

    def send(self, kind: str, src: int, dst: int, tensor: torch.Tensor) -> None:
        codecs, label = self.codecs[kind], f"pp.{kind}"
        self._sent[kind, src, dst] = played_transfer(
            codecs[src], codecs[dst], tensor,
            rng_stream=self.shape.rank_of(self.dp_idx, src, self.tp_idx),  # the sender's rank
            key=f"{label}->{dst}", stats=self.stats, label=label,
            send_memory=self.memories[kind][src])

    def recv(self, kind: str, src: int, dst: int, like: torch.Tensor) -> torch.Tensor:
        return self._sent.pop((kind, src, dst))

    def finish(self, loss_mean: torch.Tensor) -> None:
        assert not self._sent, f"transfers sent but not received: {list(self._sent)}"

    def state_dict(self) -> dict:
        return {kind: [coder_state(c, m) for c, m in zip(codecs, self.memories[kind])]
                for kind, codecs in self.codecs.items()}

    def load_state_dict(self, state: dict) -> None:
        for kind, codecs in self.codecs.items():
            for codec, memory, s in zip(codecs, self.memories[kind], state[kind], strict=True):
                load_coder_state(codec, memory, s)


class GPipe:
    """A GPipe step of the ``stages`` this process holds (one stage of a real rank, or
    every stage of a played one), over a transport: :class:`ProcessP2P` or
    :class:`PlayedP2P`. Every stage but the first receives its input, every stage but the
    last sends its output; the same order of codec calls either way."""

    def __init__(self, stages: list[Stage], micro_batches: int,
                 p2p: ProcessP2P | PlayedP2P) -> None:
        self.stages, self.micro, self.p2p = stages, micro_batches, p2p

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        stage = self.stages[0]
        dtype = next(stage.parameters()).dtype
        return torch.empty(B, T, stage.cfg.n_embd, device=x.device, dtype=dtype)

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True,
             sync_ctx: Callable[[], AbstractContextManager] | None = None,
             after_backward: Callable[[int], None] | None = None) -> float:
        """Forward (and backward when ``train``) all micro-batches of this rank's batch.

        Returns the batch's mean loss on every stage (from the last). ``sync_ctx`` (e.g.
        ``optimizer.no_sync``) wraps every backward but the last, so gradients are
        communicated once per step; ``after_backward(i)`` runs after held stage ``i``'s
        backward of each micro-batch.
        """
        p2p, micro = self.p2p, self.micro
        inputs = [[] for _ in self.stages]
        outputs = [[] for _ in self.stages]
        loss_sum = torch.zeros((), device=x.device)
        with torch.enable_grad() if train else torch.no_grad():
            for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
                for j, stage in enumerate(self.stages):
                    if stage.first:
                        inp = xm
                    else:
                        inp = p2p.recv("act", stage.index - 1, stage.index, self._hidden(xm))
                        inp.requires_grad_(train)
                    out = stage(inp)
                    if stage.last:
                        loss = F.cross_entropy(out.reshape(-1, out.size(-1)), ym.reshape(-1))
                        loss_sum += loss.detach()
                        out = loss / micro
                    else:
                        p2p.send("act", stage.index, stage.index + 1, out.detach())
                    inputs[j].append(inp)
                    outputs[j].append(out)
        if train:
            for i in reversed(range(micro)):
                for j, stage in reversed(list(enumerate(self.stages))):
                    with sync_ctx() if (sync_ctx is not None and i > 0) else nullcontext():
                        if stage.last:
                            outputs[j][i].backward()
                        else:
                            g = p2p.recv("act_grad", stage.index + 1, stage.index,
                                         torch.empty_like(outputs[j][i]))
                            outputs[j][i].backward(g)
                    if not stage.first:
                        p2p.send("act_grad", stage.index, stage.index - 1, inputs[j][i].grad)
                    if after_backward is not None:
                        after_backward(j)
        loss_mean = loss_sum / micro
        p2p.finish(loss_mean)
        return float(loss_mean)
