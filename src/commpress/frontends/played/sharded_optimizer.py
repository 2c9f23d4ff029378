""":class:`ShardedOptimizer`'s data-parallel step, played by one process for ``N`` ranks.

``commpress simulate`` trains one model replica — every replica of a real data-parallel
run holds the same bits — and feeds it the ``N`` ranks' gradients one at a time. This
object keeps what the ``N`` real optimizers keep: the same flat buckets
(:func:`build_buckets` with ``world = N``), one set of codec objects per rank and
bucket (stochastic-rounding counters, error-feedback memory), the ``N`` master shards
(together: one fp32 master per bucket, updated by the same elementwise optimizer). Each
rank runs the real optimizer's own collective steps — its :class:`DPBucket`'s
reduce-scatter and weight gather — over the played transport
(:mod:`commpress.collectives.played`). The gradient norm adds the ranks' parts in rank
order, as the real optimizer does.

Per step: :meth:`take` after each rank's backward (the gradient is encoded and freed:
only codes of ``N`` ranks are held), then :meth:`step`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from commpress.collectives import Topology
from commpress.collectives.byte_stats import Stats
from commpress.collectives.played import Played, played_peers
from commpress.dp import DPBucket, grad_levels
from commpress.frontends.parts.buckets import (
    Bucket,
    buckets_identity,
    buckets_state,
    build_buckets,
    build_optimizer,
    load_buckets_state,
    tensor_parallel_key,
)
from commpress.frontends.sharded_optimizer import (
    finish_step,
    norm_of_parts,
)
from commpress.policy import Policy
from commpress.validate import check_saved_state

STATE_FORMAT = "commpress.played_sharded_optimizer/2"


class PlayedShardedOptimizer:
    """``N`` data-parallel ranks of :class:`ShardedOptimizer` in one process.

    Args mirror :class:`ShardedOptimizer`'s; ``ranks`` and ``ranks_per_node`` replace the
    process group and topology; ``stats`` receives the byte counts (default: its own).
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer] | None,
                 policy: str | dict | Policy, *, ranks: int, ranks_per_node: int,
                 bucket_numel: int = 1 << 22, max_grad_norm: float | None = None,
                 nonfinite: str = "skip", decay_1d: bool = False, stats: Stats | None = None,
                 norm_weights: dict[str, float] | None = None,
                 **optimizer_kwargs: Any) -> None:
        self.policy = Policy.resolve(policy)
        grad_levels(self.policy, ranks, ranks_per_node)  # checks the layout
        self.world, self.L = ranks, ranks_per_node
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self.norm_weights = dict(norm_weights or {})
        self.steps = self.skipped_steps = 0
        self.last_grad_norm = float("nan")
        # gradient bytes every rank sends, summed over the ranks
        self.stats = stats if stats is not None else Stats()
        topology = Topology(ranks_per_node)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # the one replica's buffers: weights (the parameters become views), one rank's
        # gradient at a time, and the whole fp32 master (all ranks' shards)
        make_dp = lambda: DPBucket(self.policy, topology, weights=True)  # noqa: E731
        self.buckets = build_buckets(named[::-1], bucket_numel, decay_1d, make_dp, ranks,
                                     tensor_parallel_key)
        for b in self.buckets:
            b.materialize(0, 1)
        # each rank's own codecs per bucket: played rank 0's are the bucket's own
        self.dps = [[b.dp, *(make_dp() for _ in range(1, ranks))] for b in self.buckets]
        # internal state: this step's reduce-scatters, then their shards by rank
        self._reductions: list[Played] | None = None
        self._shards: list[dict[int, torch.Tensor]] | None = None
        self.optimizer = build_optimizer(self.buckets, optimizer_cls, optimizer_kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _peers(self, rank: int):
        return played_peers(rank, self.world, self.L)

    # -- gradients ---------------------------------------------------------------------
    def _reduce_scatter(self, j: int, b: Bucket) -> Played:
        dps, m = self.dps[j], b.numel // self.world
        return Played(self.world, lambda r, flat: dps[r].reduce_scatter_steps(
            flat, m, self._peers(r), self.stats))

    @torch.no_grad()
    def take(self, rank: int) -> None:
        """Rank ``rank``'s gradients (now in ``p.grad``) into its reduce-scatters; the
        gradients are cleared (accumulated over micro-batches first, as the real
        optimizer's buffer does: call :meth:`accumulate` after each backward)."""
        self.accumulate()
        if self._reductions is None:
            self._reductions = [self._reduce_scatter(j, b) for j, b in enumerate(self.buckets)]
        for played, b in zip(self._reductions, self.buckets):
            played.add(rank, b.grad_buffer)
            b.grad_buffer = torch.zeros_like(b.grad_buffer)  # handed over to the steps

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add ``p.grad`` into the fp32 bucket buffer and clear it (one micro-batch)."""
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets):
                if p.grad is not None:
                    b.grad_buffer[off:off + p.numel()].add_(p.grad.reshape(-1))
                    p.grad = None

    # -- step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Reduce, take the norm over these ranks, update; False if the step was skipped."""
        return self.update(norm_of_parts(torch.stack(self.reduce())))

    @torch.no_grad()
    def reduce(self) -> list[torch.Tensor]:
        """Finish the reduce-scatters; returns each rank's part of the squared gradient
        norm (fp64), in rank order — a pipeline adds the parts of every stage's ranks."""
        self._shards = [played.finish() for played in self._reductions]
        self._reductions = None
        return [sum(b.grad_sumsq(r, self.world, self.norm_weights, s[r])
                    for b, s in zip(self.buckets, self._shards)) for r in range(self.world)]

    @torch.no_grad()
    def update(self, norm: float) -> bool:
        """Clip to ``norm`` (the global norm), step and gather the new weights; a
        non-finite norm skips the step (or raises)."""
        self.last_grad_norm = norm
        shards, self._shards = self._shards, None
        return finish_step(
            self, norm, self.max_grad_norm, "simulated step",
            lambda: [(b.master, torch.cat([s[r] for r in range(self.world)]))
                     for b, s in zip(self.buckets, shards)],
            lambda: [self._gather(j, b) for j, b in enumerate(self.buckets)])

    def _gather(self, j: int, b: Bucket) -> None:
        """The new weights to the replica, as every rank's gather gives them."""
        new = b.master.detach().to(b.dtype).view(self.world, -1)
        if self.world == 1:  # as ShardedOptimizer: nothing crosses a wire
            b.param_buffer.copy_(new.view(-1))
            return
        dps, weights = self.dps[j], b.param_buffer.view(-1)
        played = Played(self.world, lambda r, shard: dps[r].gather_weights_steps(
            weights, shard, self._peers(r), self.stats), keep=(0,))
        for r in range(self.world):
            played.add(r, new[r])
        b.param_buffer.copy_(played.finish()[0])

    # -- checkpoints ----------------------------------------------------------------------
    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """Nothing: played ranks have no links to measure (simulate refuses the fallback)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything the ``N`` ranks keep: masters, weights, inner optimizer, every
        rank's codec states, step counters."""
        return {
            "format": STATE_FORMAT, "ranks": self.world,
            "policy": self.policy.to_dict(), **buckets_state(self.buckets, self.optimizer),
            "steps": self.steps, "skipped_steps": self.skipped_steps,
            "codecs": [[dp.state_dict() for dp in row] for row in self.dps],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of a run with the same ranks, policy and model."""
        check_saved_state(state, STATE_FORMAT, "PlayedShardedOptimizer", {
            "ranks": self.world, "policy": self.policy.to_dict(),
            **buckets_identity(self.buckets)},
            "resume with the same ranks, policy and model")
        load_buckets_state(self.buckets, self.optimizer, state)
        for row, row_states in zip(self.dps, state["codecs"], strict=True):
            for dp, s in zip(row, row_states, strict=True):
                dp.load_state_dict(s)
        self.steps, self.skipped_steps = state["steps"], state["skipped_steps"]
