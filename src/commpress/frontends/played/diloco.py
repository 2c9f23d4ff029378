""":class:`commpress.DiLoCo` across sites, played by one process (``commpress simulate
--outer``).

A real run holds one site per node: its ranks train one replica under DDP, and at a
sync every rank all-reduces its site's pseudo-gradient across the sites with the
policy's ``outer.grad`` codecs, two levels over ``N / M`` nodes. Here every site's
weights and inner optimizer live in one process (:class:`SiteWeights`: one module,
each site's weights swapped in while it computes); each played rank keeps its own
codecs per fragment (error-feedback memory, rounding streams) and runs the all-reduce's
own steps (:meth:`GradPath.all_reduce_steps`) over the played transport; the schedule,
the outer step and the local weights after it are :class:`commpress.DiLoCo`'s own. The
weights then equal a real ``commpress train --outer``'s bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.collectives import Topology
from commpress.collectives.byte_stats import Stats
from commpress.collectives.played import Played, played_peers
from commpress.dp import DPBucket, grad_levels
from commpress.frontends.diloco import LABEL, DiLoCo
from commpress.frontends.parts.outer_fragments import Fragment, named_parameters
from commpress.validate import InputError


class SiteWeights(Protocol):
    """The sites a played run holds in one module."""

    count: int

    def held(self, site: int) -> Any:
        """A context in which ``site``'s weights are the module's."""



class PlayedDiLoCo(DiLoCo):
    """:class:`commpress.DiLoCo` for ``ranks`` played ranks, ``ranks_per_site`` per site,
    over the sites ``sites`` holds in ``model``; ``stats`` receives the byte counts. The
    other arguments are :class:`commpress.DiLoCo`'s (its schedule, policy and outer
    step); :meth:`step` after each inner step of every site."""

    def __init__(self, model: nn.Module, sites: SiteWeights, *, ranks: int,
                 ranks_per_site: int, stats: Stats, **kwargs: Any) -> None:
        self.sites, self.ranks, self.per_site, self.stats = sites, ranks, ranks_per_site, stats
        super().__init__(model, None, topology=Topology(ranks_per_site), **kwargs)
        self._first_sync = False  # played sites share no links to check
        # each played rank's own codecs per fragment: rank 0's are the fragment's own
        self.rank_dps = [[f.dp, *(self._new_dp() for _ in range(1, ranks))]
                         for f in self.fragments]

    def _new_dp(self) -> DPBucket:
        return DPBucket(self.policy, self.topology, LABEL, axis="outer")

    def _open(self, group: dist.ProcessGroup | None,
              named: list[tuple[str, torch.Tensor]]) -> None:
        grad_levels(self.policy, self.ranks, self.per_site, axis="outer")  # checks the layout

    def _each_site(self) -> Iterator[tuple[str, torch.optim.Optimizer | None]]:
        # no inner optimizer, as the trainer's real DiLoCo holds none (it counts every
        # inner step itself): a non-finite restart drops no optimizer state in either
        for site in range(self.sites.count):
            with self.sites.held(site):
                yield f"site {site}", None

    @torch.no_grad()
    def _start(self, fragment: Fragment, fields: dict[str, Any], agreed: bool) -> None:
        if not fragment.names:
            return
        deltas = [fragment.global_ - fragment.local(named_parameters(self.model))
                  for _ in self._each_site()]
        dps = self.rank_dps[fragment.index]
        played = Played(self.ranks, lambda r, flat: dps[r].all_reduce_steps(
            flat, played_peers(r, self.ranks, self.per_site), self.stats), keep=(0,))
        for r in range(self.ranks):  # each rank sends its own site's pseudo-gradient
            played.add(r, deltas[r // self.per_site].clone())
        averaged = played.finish()[0]
        if self.config.delay:
            self._pending[fragment.index] = (self.inner_steps + self.config.delay, averaged)
        else:
            self._apply(fragment, averaged)

    # -- checkpoints: every played rank's codecs ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "rank_codecs": [[dp.state_dict() for dp in row[1:]] for row in self.rank_dps]}

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        state = dict(state)
        ranks = state.pop("rank_codecs", None)
        if not isinstance(ranks, list) or [len(r) for r in ranks] != [
                len(row) - 1 for row in self.rank_dps]:
            raise InputError(f"PlayedDiLoCo: the saved state holds codecs of "
                             f"{[len(r) + 1 for r in ranks] if isinstance(ranks, list) else 0}"
                             f" played ranks per fragment; this run plays {self.ranks} "
                             f"ranks in {len(self.rank_dps)} fragments: resume with the same "
                             "ranks and fragments")
        super().load_state_dict(state, elastic)
        self._site_check = None
        for row, saved in zip(self.rank_dps, ranks):
            for dp, s in zip(row[1:], saved):
                dp.load_state_dict(s, not elastic)

    def _identity(self) -> tuple[int, int]:
        return 0, self.ranks  # every played rank's state, saved as rank 0's
