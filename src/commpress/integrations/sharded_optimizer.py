"""A ZeRO-1/2 distributed optimizer with compressed gradients and weights (SDP4Bit).

Model parameters stay in their training dtype, packed into flat buckets (each
parameter becomes a view into its bucket, so the model is unchanged for the user).
Each data-parallel rank owns one contiguous shard of every bucket: its fp32 master
weights and the inner optimizer's state live only there. A step:

1. backward: each parameter's gradient is added into its bucket's fp32 gradient
   buffer; when a bucket is complete its compressed reduce-scatter starts at once
   (overlapping the rest of backward) with the policy's ``dp.grad`` codec — two-level
   TLq-HS when the policy names ``intra``/``inter`` codecs;
2. ``step()``: wait for the shards, reduce one float — the squared gradient norm —
   across ranks (it is non-finite if any gradient is: a NaN anywhere skips or stops
   the step on every rank alike), clip, step the inner optimizer on the fp32 shard;
3. all-gather the new weights with the ``dp.param`` codec. With ``delta`` (qWD) each
   rank sends ``Δ = lowp(master) − W`` and **every** rank, the owner too, applies
   ``W += Δ̂`` from the same bytes: replicas stay bitwise identical and the master
   weights never see the quantization error (SDP4Bit, Jia et al., NeurIPS 2024).

Megatron's distributed optimizer is the model; we rejected hooking into
``torch.optim`` per parameter because per-parameter collectives cost one latency
each, and flat buckets let one codec call cover many parameters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.collectives import (
    all_gather,
    hierarchical_all_gather,
    hierarchical_reduce_scatter,
    reduce_scatter,
)
from commpress.collectives.handle import Handle, completed
from commpress.collectives.topology import Topology
from commpress.policy import Policy

log = logging.getLogger(__name__)

STATE_FORMAT = "commpress.ShardedOptimizer/1"
NONFINITE_CHOICES = ("skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or ±Inf and the optimizer was told to stop."""


@dataclass
class _Bucket:
    """Parameters packed into one flat buffer, sharded across the data-parallel ranks."""

    index: int
    dtype: torch.dtype
    decay: bool
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of world × alignment
    param_buffer: torch.Tensor = field(repr=False, default=None)  # training dtype
    grad_buffer: torch.Tensor = field(repr=False, default=None)  # fp32
    grad_shard: torch.Tensor = field(repr=False, default=None)  # fp32, this rank's
    master: nn.Parameter = field(repr=False, default=None)  # fp32, this rank's
    grad_codecs: dict = field(default_factory=dict)
    param_codec: Any = None
    ready: set = field(default_factory=set)
    handle: Handle | None = None


class ShardedOptimizer:
    """ZeRO-1/2 optimizer whose gradient reduce-scatter and weight all-gather are
    compressed by ``policy`` (``"none"``: exact ZeRO; ``"sdp4bit"``: qWD + TLq-HS).

    Used like any optimizer::

        opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "sdp4bit", lr=3e-4)
        loss.backward(); opt.step(); opt.zero_grad()

    Args:
        model: the module to train (its parameters become views into flat buckets).
        optimizer_cls: inner optimizer class, run on the fp32 master shards.
        policy: preset name, policy file, dict or :class:`~commpress.Policy`.
        group: data-parallel process group (default: the world).
        topology: node layout for the two-level gradient path (default from
            ``LOCAL_WORLD_SIZE``).
        bucket_numel: target elements per bucket (larger: fewer collectives).
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        nonfinite: ``"skip"`` the step (logged, counted in ``skipped_steps``) or
            ``"raise"`` :class:`NonFiniteGradientError` on every rank.
        overlap: start each bucket's reduce-scatter as soon as its gradients are ready.
        decay_1d: also apply weight decay to 1-D parameters (biases, norms).
        norm_group: group over which the squared gradient norm is summed (default: the
            data-parallel group; with tensor/pipeline parallelism, the whole world, so
            clipping and the non-finite check see the whole model on every rank).
        norm_weights: per-parameter-name weight of its squared norm (e.g. ``1/tp`` for
            parameters replicated across tensor-parallel ranks, counted once in all).
        **optimizer_kwargs: passed to ``optimizer_cls`` (lr, betas, weight_decay, ...).
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer] = None,
                 policy: str | dict | Policy | None = "none",
                 group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None, *, bucket_numel: int = 1 << 22,
                 max_grad_norm: float | None = None, nonfinite: str = "skip",
                 overlap: bool = True, decay_1d: bool = False,
                 norm_group: dist.ProcessGroup | None = None,
                 norm_weights: dict[str, float] | None = None,
                 **optimizer_kwargs: Any) -> None:
        if nonfinite not in NONFINITE_CHOICES:
            raise ValueError(f"nonfinite={nonfinite!r} is not allowed; allowed: "
                             f"{', '.join(NONFINITE_CHOICES)}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel} is not allowed; allowed: >= 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} is not allowed; allowed: > 0 or None")
        self.model = model
        self.policy = Policy.resolve(policy)
        self.group = group if group is not None else (dist.group.WORLD if dist.is_initialized()
                                                      else None)
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.topology = topology or Topology()
        self.max_grad_norm = max_grad_norm
        self.norm_group = norm_group if norm_group is not None else self.group
        self.norm_weights = norm_weights or {}
        self.nonfinite = nonfinite
        self.overlap = overlap
        # stats
        self.steps = 0
        self.skipped_steps = 0
        self._no_sync = False
        optimizer_cls = optimizer_cls or torch.optim.AdamW
        self.param_rule = self.policy.rule("dp", "param")
        self.buckets = self._build_buckets(model, bucket_numel, decay_1d)
        weight_decay = optimizer_kwargs.pop("weight_decay", None)
        groups = []
        for b in self.buckets:
            g: dict[str, Any] = {"params": [b.master]}
            if weight_decay is not None:
                g["weight_decay"] = weight_decay if b.decay else 0.0
            groups.append(g)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        log.info("ShardedOptimizer: %d buckets, %d parameters, world %d, policy %s",
                 len(self.buckets), sum(b.numel for b in self.buckets), self.world,
                 self.policy.name)

    # -- construction ---------------------------------------------------------------
    def _grad_codecs(self) -> dict:
        if self.policy.two_level():
            return {"intra": self.policy.codec_for("dp", "grad", "intra"),
                    "inter": self.policy.codec_for("dp", "grad", "inter")}
        return {"single": self.policy.codec_for("dp", "grad")}

    def _alignment(self, codecs: list) -> int:
        unit = 1
        for c in codecs:
            unit = math.lcm(unit, max(c.alignment, 1))
        return unit

    def _build_buckets(self, model: nn.Module, bucket_numel: int,
                       decay_1d: bool) -> list[_Bucket]:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ShardedOptimizer: the model has no parameters that require grad")
        # gradients arrive roughly in reverse registration order during backward
        named.reverse()
        groups: dict[tuple, list[list[tuple[str, nn.Parameter]]]] = {}
        for name, p in named:
            key = (p.dtype, p.dim() >= 2 or decay_1d)
            lists = groups.setdefault(key, [[]])
            if lists[-1] and sum(q.numel() for _, q in lists[-1]) + p.numel() > bucket_numel:
                lists.append([])
            lists[-1].append((name, p))
        buckets = []
        for (dtype, decay), lists in groups.items():
            for members in lists:
                grad_codecs = self._grad_codecs()
                param_codec = self.param_rule.build()
                unit = self._alignment([*grad_codecs.values(), param_codec]) * self.world
                offsets, total = [], 0
                for _, p in members:
                    offsets.append(total)
                    total += p.numel()
                b = _Bucket(index=len(buckets), dtype=dtype, decay=decay,
                            names=[n for n, _ in members], params=[p for _, p in members],
                            offsets=offsets, numel=-(-total // unit) * unit,
                            grad_codecs=grad_codecs, param_codec=param_codec)
                self._materialize(b)
                buckets.append(b)
        return buckets

    def _materialize(self, b: _Bucket) -> None:
        device = b.params[0].device
        b.param_buffer = torch.zeros(b.numel, dtype=b.dtype, device=device)
        for p, off in zip(b.params, b.offsets):
            b.param_buffer[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = b.param_buffer[off : off + p.numel()].view_as(p)
        b.grad_buffer = torch.zeros(b.numel, dtype=torch.float32, device=device)
        shard = b.numel // self.world
        b.grad_shard = torch.zeros(shard, dtype=torch.float32, device=device)
        lo = self.rank * shard
        b.master = nn.Parameter(b.param_buffer[lo : lo + shard].detach().float().clone())

    def _shard(self, b: _Bucket) -> slice:
        shard = b.numel // self.world
        return slice(self.rank * shard, (self.rank + 1) * shard)

    # -- backward ---------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, i = self._where[id(p)]
        off = b.offsets[i]
        if b.handle is not None:
            raise RuntimeError(
                f"ShardedOptimizer: a gradient of {b.names[i]!r} arrived after its bucket's "
                "reduce-scatter started; call step() (or use no_sync()) between backward passes")
        b.grad_buffer[off : off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        b.ready.add(i)
        if len(b.ready) == len(b.params):
            b.ready.clear()
            if self.overlap and not self._no_sync:
                self._launch(b)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients of this backward without communicating (micro-batches)."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def _launch(self, b: _Bucket) -> None:
        if self.world == 1:
            b.grad_shard.copy_(b.grad_buffer)
            b.handle = completed(b.grad_shard)
        elif "single" in b.grad_codecs:
            b.handle = reduce_scatter(b.grad_shard, b.grad_buffer, b.grad_codecs["single"],
                                      group=self.group, op="avg", label="dp.grad", async_op=True)
        else:
            b.handle = hierarchical_reduce_scatter(
                b.grad_shard, b.grad_buffer, b.grad_codecs["intra"], b.grad_codecs["inter"],
                topology=self.topology, group=self.group, op="avg", label="dp.grad",
                async_op=True)

    # -- step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Reduce gradients, update the shards, gather weights. Returns False if skipped."""
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        for b in self.buckets:
            if b.handle is None:
                self._launch(b)
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.ready.clear()
        norm = self._global_grad_norm()
        self.last_grad_norm = norm
        self._zero_grad_buffers()
        if not math.isfinite(norm):
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"ShardedOptimizer step {self.steps}: the global gradient norm is {norm} "
                    "(a gradient holds NaN or Inf on some rank); the weights were not changed")
            log.warning("ShardedOptimizer step %d: non-finite gradient norm %s, step skipped",
                        self.steps, norm)
            self.steps += 1
            return False
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            coef = self.max_grad_norm / (norm + 1e-6)
            for b in self.buckets:
                b.grad_shard.mul_(coef)
        for b in self.buckets:
            b.master.grad = b.grad_shard
        self.optimizer.step()
        for b in self.buckets:
            b.master.grad = None
        self._gather_params()
        self.steps += 1
        return True

    def _global_grad_norm(self) -> float:
        """The gradient norm over ``norm_group``: one float all-reduced, NaN if any rank
        holds a non-finite gradient (so all ranks skip or stop together)."""
        sumsq = torch.zeros(1, dtype=torch.float64, device=self.buckets[0].grad_shard.device)
        for b in self.buckets:
            lo = self._shard(b).start
            for name, p, off in zip(b.names, b.params, b.offsets):
                # this param's part of the shard
                start, end = max(off, lo), min(off + p.numel(), lo + b.grad_shard.numel())
                if start < end:
                    part = b.grad_shard[start - lo : end - lo].double().pow(2).sum()
                    sumsq += part * self.norm_weights.get(name, 1.0)
        if self.norm_group is not None and dist.get_world_size(self.norm_group) > 1:
            dist.all_reduce(sumsq, group=self.norm_group)
        value = sumsq.item()
        return math.sqrt(value) if value >= 0 else float("nan")

    def _gather_params(self) -> None:
        levels = self.topology.resolve(self.group) if self.world > 1 else None
        # With several nodes, compressed weights cross the slow link once per shard and
        # are shared inside the node exactly; uncompressed stays torch's own all-gather.
        two_level = (levels is not None and levels.nodes > 1 and levels.ranks_per_node > 1
                     and not self.param_rule.exact)
        for b in self.buckets:
            sl = self._shard(b)
            new = b.master.detach().to(b.dtype)
            if self.world == 1:  # nothing crosses a wire: nothing is compressed
                b.param_buffer.copy_(new)
            elif self.param_rule.delta and two_level:
                self._gather_differences_two_level(b, new.float() - b.param_buffer[sl].float(),
                                                   levels)
            elif self.param_rule.delta:
                # qWD: every rank, the owner too, applies the decoded difference
                diff = new.float() - b.param_buffer[sl].float()
                full = torch.empty(b.numel, dtype=torch.float32, device=diff.device)
                all_gather(full, diff, b.param_codec, group=self.group, label="dp.param")
                b.param_buffer.copy_((b.param_buffer.float() + full).to(b.dtype))
            elif two_level:
                hierarchical_all_gather(b.param_buffer, new, b.param_codec,
                                        topology=self.topology, group=self.group,
                                        label="dp.param")
            else:
                all_gather(b.param_buffer, new, b.param_codec, group=self.group,
                           label="dp.param")

    def _gather_differences_two_level(self, b: _Bucket, diff: torch.Tensor, levels) -> None:
        """qWD over two levels: ranks of one local index exchange their encoded weight
        differences across nodes and apply them to those shards; the node then shares
        the updated weights in the training dtype — the same bits as every rank applying
        every difference, in half the intra-node bytes of fp32 differences for bf16."""
        L, nodes, m = levels.ranks_per_node, levels.nodes, diff.numel()
        across = torch.empty(nodes * m, dtype=torch.float32, device=diff.device)
        all_gather(across, diff, b.param_codec, group=levels.inter, label="dp.param.inter")
        shards = b.param_buffer.view(nodes, L, m)  # rank node·L + l owns shards[node, l]
        mine = shards[:, levels.local_rank].float() + across.view(nodes, m)
        local = torch.empty(L * nodes * m, dtype=b.dtype, device=diff.device)
        all_gather(local, mine.to(b.dtype).reshape(-1), "none", group=levels.intra,
                   label="dp.param.intra")
        shards.copy_(local.view(L, nodes, m).transpose(0, 1))

    def _zero_grad_buffers(self) -> None:
        for b in self.buckets:
            b.grad_buffer.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (the flat buffers; ``param.grad`` stays None)."""
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.ready.clear()
            for p in b.params:
                p.grad = None
        self._zero_grad_buffers()

    # -- introspection -----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: master shards, inner optimizer, codec states, weights."""
        return {
            "format": STATE_FORMAT,
            "world_size": self.world,
            "rank": self.rank,
            "policy": self.policy.to_dict(),
            "bucket_numels": [b.numel for b in self.buckets],
            "bucket_names": [b.names for b in self.buckets],
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "master": [b.master.detach().clone() for b in self.buckets],
            "params": [b.param_buffer.clone() for b in self.buckets],
            "optimizer": self.optimizer.state_dict(),
            "grad_codecs": [{k: c.state_dict() for k, c in b.grad_codecs.items()}
                            for b in self.buckets],
            "param_codecs": [b.param_codec.state_dict() for b in self.buckets],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by the same rank of a run with the same world size,
        policy and model; anything else is refused with the reason."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a ShardedOptimizer state (expected format {STATE_FORMAT!r})")
        for key, mine in (("world_size", self.world), ("rank", self.rank),
                          ("policy", self.policy.to_dict()),
                          ("bucket_numels", [b.numel for b in self.buckets]),
                          ("bucket_names", [b.names for b in self.buckets])):
            if state[key] != mine:
                raise ValueError(f"checkpoint {key} {state[key]!r} does not match this run's "
                                 f"{mine!r}; resharding is not supported: resume with the same "
                                 "world size, policy and model")
        for b, master, params in zip(self.buckets, state["master"], state["params"]):
            b.master.copy_(master)
            b.param_buffer.copy_(params)
        self.optimizer.load_state_dict(state["optimizer"])
        for b, codecs, pcodec in zip(self.buckets, state["grad_codecs"], state["param_codecs"]):
            for k, c in b.grad_codecs.items():
                c.load_state_dict(codecs[k])
            b.param_codec.load_state_dict(pcodec)
        self.steps = state["steps"]
        self.skipped_steps = state["skipped_steps"]
