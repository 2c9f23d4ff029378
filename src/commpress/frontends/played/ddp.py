""":func:`commpress.ddp_hook`'s gradient all-reduce, played by one process for ``N`` ranks.

What ``commpress simulate --engine ddp`` runs: the hook's own fixed buckets
(:func:`~commpress.frontends.ddp.hook_layout`, the same layout as in a real run),
one :class:`GradPath` per rank and bucket (each rank's stochastic-rounding counters and
error-feedback memory), and each rank running the hook's own all-reduce steps
(:meth:`GradPath.all_reduce_steps`) over the played transport
(:mod:`commpress.collectives.played`) — one level, or two over ``N / M`` nodes.
DDP then holds the same averaged gradient on every rank; so does the one replica here.

Per step: :meth:`take` after each rank's backward (its gradients are encoded and
cleared), then :meth:`finish` writes the averaged gradients into ``p.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from commpress.collectives import Topology
from commpress.collectives.byte_stats import Stats
from commpress.collectives.played import Played, played_peers
from commpress.dp import DPBucket, grad_levels
from commpress.frontends.ddp import BUCKET_NUMEL, grad_policy, hook_layout
from commpress.policy import Policy
from commpress.validate import check_saved_state

STATE_FORMAT = "commpress.played_ddp_hook/2"


class PlayedDDPHook:
    """``N`` data-parallel ranks of the DDP hook in one process.

    Args mirror :func:`commpress.ddp_hook`'s; ``ranks`` and ``ranks_per_node`` replace
    the process group and topology; ``stats`` receives the byte counts.
    """

    def __init__(self, model: nn.Module, policy: str | dict | Policy, *, ranks: int,
                 ranks_per_node: int, bucket_numel: int = BUCKET_NUMEL,
                 label: str = "dp.grad", stats: Stats | None = None) -> None:
        self.policy = grad_policy(policy)
        grad_levels(self.policy, ranks, ranks_per_node)  # checks the layout
        self.world, self.L, self.label = ranks, ranks_per_node, label
        # gradient bytes every rank sends, summed over the ranks
        self.stats = stats if stats is not None else Stats()
        topology = Topology(ranks_per_node)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = dict(named)
        make_dp = lambda *_: DPBucket(self.policy, topology, label)  # noqa: E731
        self.buckets = hook_layout(named, bucket_numel, make_dp)
        # each rank's own codecs per bucket: played rank 0's are the bucket's own
        self.dps = [[b.dp, *(make_dp() for _ in range(1, ranks))] for b in self.buckets]
        self._reductions: list[Played] | None = None  # this step's all-reduces

    def state_dict(self) -> dict[str, Any]:
        """Every rank's codec states, bucket by bucket."""
        return {"format": STATE_FORMAT, **self._identity(),
                "codecs": [[dp.state_dict() for dp in row] for row in self.dps]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of a run with the same ranks, policy and layout."""
        check_saved_state(state, STATE_FORMAT, "PlayedDDPHook", self._identity(),
                          "resume with the same ranks, ranks per node, policy, model and "
                          "bucket_numel (they fix the layout)")
        for row, states in zip(self.dps, state["codecs"], strict=True):
            for dp, s in zip(row, states, strict=True):
                dp.load_state_dict(s)

    def _identity(self) -> dict[str, Any]:
        return {"ranks": self.world, "ranks_per_node": self.L,
                "policy": self.policy.to_dict(), "layout": [b.names for b in self.buckets]}

    def _all_reduce(self, j: int) -> Played:
        dps = self.dps[j]  # every rank ends with the same values: rank 0's are kept
        return Played(self.world, lambda r, flat: dps[r].all_reduce_steps(
            flat, played_peers(r, self.world, self.L), self.stats), keep=(0,))

    @torch.no_grad()
    def take(self, rank: int) -> None:
        """Rank ``rank``'s gradients (now in ``p.grad``) into its bucket all-reduces; the
        gradients are cleared."""
        if self._reductions is None:
            self._reductions = [self._all_reduce(j) for j in range(len(self.buckets))]
        for played, b in zip(self._reductions, self.buckets):
            grads = []
            for name, numel in zip(b.names, b.numels):
                p = self.params[name]
                grads.append(p.grad.reshape(-1) if p.grad is not None
                             else torch.zeros(numel, dtype=p.dtype, device=p.device))
                p.grad = None
            played.add(rank, torch.cat(grads))

    @torch.no_grad()
    def finish(self) -> None:
        """Every bucket's all-reduced gradient — what every rank holds — into ``p.grad``."""
        reductions, self._reductions = self._reductions, None
        for played, b in zip(reductions, self.buckets):
            reduced = played.finish()[0]
            for name, off, numel in zip(b.names, b.offsets, b.numels):
                p = self.params[name]
                p.grad = reduced[off:off + numel].view_as(p).clone()
