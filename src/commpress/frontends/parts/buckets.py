"""Flat parameter buckets of the sharded optimizer.

A bucket packs parameters of one dtype, one weight-decay setting and one *replication
class* into a flat buffer; each parameter becomes a view into it. Each data-parallel
rank owns one contiguous shard of the bucket: its fp32 master weights and gradient
shard. The bucket's length is padded to ``world × alignment`` so every codec group and
Hadamard block lies inside one rank's shard.

Replication classes keep apart parameters that are sliced across tensor-parallel ranks
(their values differ from one TP rank to the next) from parameters every TP rank holds
a replica of (norms, row-parallel biases, embeddings, head). Mixed in one bucket, a
quantization group or Hadamard block would hold both, its scale would differ between
TP ranks, and the replicas would receive different decoded gradients and weight
differences and drift apart; kept apart, replicas see bit-identical inputs and codes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from commpress.collectives import Handle
from commpress.dp import DPBucket
from commpress.validate import InputError

ReplicationKey = Callable[[str, nn.Parameter], Hashable]


def tensor_parallel_key(name: str, p: nn.Parameter) -> bool:
    """True for a parameter sliced across tensor-parallel ranks: commpress's own mark
    (``p.tp_sharded``) or Megatron's (``p.tensor_model_parallel``)."""
    return bool(getattr(p, "tp_sharded", False) or getattr(p, "tensor_model_parallel", False))


@dataclass
class Bucket:
    """Parameters packed into one flat buffer, sharded across the data-parallel ranks."""

    index: int
    dtype: torch.dtype
    decay: bool
    group: int  # the caller's parameter group (its optimizer options)
    replication: Hashable
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of world × alignment
    dp: DPBucket  # its codecs and their state
    param_buffer: torch.Tensor = field(repr=False, default=None)  # training dtype
    grad_buffer: torch.Tensor = field(repr=False, default=None)  # fp32
    grad_shard: torch.Tensor = field(repr=False, default=None)  # fp32, this rank's
    master: nn.Parameter = field(repr=False, default=None)  # fp32, this rank's
    ready: set = field(default_factory=set)
    handle: Handle | None = None

    @property
    def used(self) -> int:
        """Elements its parameters fill (``numel`` less the padding)."""
        return self.offsets[-1] + self.params[-1].numel()

    def shard(self, rank: int, world: int) -> slice:
        size = self.numel // world
        return slice(rank * size, (rank + 1) * size)

    def materialize(self, rank: int, world: int) -> None:
        """Allocate the buffers; parameters become views into ``param_buffer``."""
        device = self.params[0].device
        self.param_buffer = torch.zeros(self.numel, dtype=self.dtype, device=device)
        for p, off in zip(self.params, self.offsets):
            self.param_buffer[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.param_buffer[off : off + p.numel()].view_as(p)
        self.grad_buffer = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.grad_shard = torch.zeros(self.numel // world, dtype=torch.float32, device=device)
        self.reset_master(rank, world)

    def reset_master(self, rank: int, world: int) -> None:
        """The fp32 master shard from the current weights."""
        shard = self.param_buffer[self.shard(rank, world)].detach().float().clone()
        if self.master is None:
            self.master = nn.Parameter(shard)
        else:
            self.master.data.copy_(shard)

    def grad_sumsq(self, rank: int, world: int, weights: dict[str, float],
                   grad_shard: torch.Tensor | None = None) -> torch.Tensor:
        """Σ weight(name) · ‖rank's part of the parameter's gradient‖² (fp64), from
        ``grad_shard`` (default: this bucket's own)."""
        shard = self.grad_shard if grad_shard is None else grad_shard
        lo = self.shard(rank, world).start
        total = torch.zeros((), dtype=torch.float64, device=shard.device)
        for name, p, off in zip(self.names, self.params, self.offsets):
            start, end = max(off, lo), min(off + p.numel(), lo + shard.numel())
            if start < end:
                part = shard[start - lo : end - lo].double().pow(2).sum()
                total += part * weights.get(name, 1.0)
        return total


def build_buckets(named: list[tuple[str, nn.Parameter]], bucket_numel: int, decay_1d: bool,
                  make_dp: Callable[[], DPBucket], world: int, replication_key: ReplicationKey,
                  group_of: dict[str, int] | None = None) -> list[Bucket]:
    """Pack ``named`` parameters (in backward order) into buckets of about
    ``bucket_numel`` elements, one kind (parameter group of ``group_of``, by name; dtype,
    matrix or not, decay, replication class) per bucket."""
    groups: dict[tuple, list[list[tuple[str, nn.Parameter]]]] = {}
    for name, p in named:
        # 1-D parameters (biases, norms) in buckets of their own, decayed or not: their
        # quantization groups never share a scale with a matrix's
        key = ((group_of or {}).get(name, 0), p.dtype, p.dim() >= 2, p.dim() >= 2 or decay_1d,
               replication_key(name, p))
        lists = groups.setdefault(key, [[]])
        if lists[-1] and sum(q.numel() for _, q in lists[-1]) + p.numel() > bucket_numel:
            lists.append([])
        lists[-1].append((name, p))
    buckets = []
    for (group, dtype, _, decay, replication), lists in groups.items():
        for members in lists:
            dp = make_dp()
            unit = dp.alignment * world
            *offsets, total = itertools.accumulate((p.numel() for _, p in members), initial=0)
            buckets.append(Bucket(
                index=len(buckets), dtype=dtype, decay=decay, group=group,
                replication=replication,
                names=[n for n, _ in members], params=[p for _, p in members],
                offsets=offsets, numel=-(-total // unit) * unit, dp=dp))
    return buckets


def checksum(t: torch.Tensor) -> int:
    """A position-weighted integer sum of ``t``'s bytes: equal tensors give equal sums on
    any device, and one changed element changes it (for checking replicas agree)."""
    words = t.detach().reshape(-1).contiguous().view(torch.uint8)
    pad = (-words.numel()) % 4
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    w = words.view(torch.int32).long()
    weights = torch.arange(w.numel(), device=w.device, dtype=torch.int64) * 2 + 1
    return int((w * weights).sum())


def build_optimizer(buckets: list[Bucket], optimizer_cls: type[torch.optim.Optimizer] | None,
                    optimizer_kwargs: dict[str, Any],
                    group_options: list[dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """The inner optimizer over the buckets' fp32 masters, one group per bucket with the
    options of its parameter group (``group_options``) and, as ``"param_group"``, that
    group's index (the way to set one group's options: every optimizer group with its
    index); the
    optimizer's weight decay (given or its default) applies to decaying buckets, the
    others get ``weight_decay=0``."""
    options = group_options or [{}]
    groups = [{**options[b.group], "params": [b.master], "param_group": b.group,
               **({} if b.decay else {"weight_decay": 0.0})} for b in buckets]
    return (optimizer_cls or torch.optim.AdamW)(groups, **optimizer_kwargs)


def buckets_identity(buckets: list[Bucket]) -> dict[str, Any]:
    """What a resume must match beside the policy: the bucket layout."""
    return {"bucket_numels": [b.numel for b in buckets],
            "bucket_names": [b.names for b in buckets]}


def buckets_state(buckets: list[Bucket], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The buckets' part of an optimizer state: identity, fp32 masters, weights, inner
    optimizer."""
    return {**buckets_identity(buckets),
            "master": [b.master.detach().clone() for b in buckets],
            "params": [b.param_buffer.clone() for b in buckets],
            "optimizer": optimizer.state_dict()}


@torch.no_grad()
def load_buckets_state(buckets: list[Bucket], optimizer: torch.optim.Optimizer,
                       state: dict[str, Any]) -> None:
    """Restore :func:`buckets_state` (its identity already checked); tensors of another
    count or shape are refused before anything is written."""
    for key, mine in (("master", [b.master for b in buckets]),
                      ("params", [b.param_buffer for b in buckets])):
        saved = state.get(key)
        if (not isinstance(saved, list) or len(saved) != len(mine)
                or any(not isinstance(t, torch.Tensor) or t.shape != m.shape
                       for t, m in zip(saved, mine))):
            raise InputError(f"optimizer checkpoint {key}: not {len(mine)} tensors of the "
                             f"shapes of this run's buckets; resume with the same model, world "
                             "size and bucket_numel")
    for b, master, params in zip(buckets, state["master"], state["params"], strict=True):
        b.master.copy_(master)
        b.param_buffer.copy_(params)
    optimizer.load_state_dict(state["optimizer"])
