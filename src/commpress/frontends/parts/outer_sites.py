"""What DiLoCo checks of each site: that a resume brought back the site's own state, that
the sites train independently (no DDP across them), what a site that went non-finite
drops, and the inner optimizers and parameters the outer step cannot reach.

A site's local weights and inner optimizer state are its own, between syncs: a loop that
checkpoints on rank 0 alone and restores rank 0's model and optimizer on every site loses
the others' silently, so the synchronizer saves checksums of them and compares after a
resume (:class:`SiteCheck`). A DistributedDataParallel over every site's ranks all-reduces
every gradient between sites in full precision, undoing what DiLoCo saves: refused when
DiLoCo is given the DDP module, said at the first sync when the sites' local weights are
identical (the module inside a DDP given).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.collectives import Topology
from commpress.collectives.agreement import all_gather_objects
from commpress.frontends.parts.buckets import checksum
from commpress.validate import InputError

log = logging.getLogger(__name__)


class SiteCheck:
    """A resumed site's own state against the checksums saved with the synchronizer's:
    compared before the first inner step after the load (a pre-step hook on the inner
    optimizer, removed when it has run, or by :meth:`close`), the sites' verdicts gathered
    at the next sync. ``saved`` None (an elastic resume), or no inner optimizer to check
    before: nothing to compare."""

    def __init__(self, saved: dict[str, int | None] | None,
                 params: Callable[[], list[torch.Tensor]],
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.wrong: list[str] = []
        self._hook = None
        if saved is None or optimizer is None:
            return

        def check(*_: Any) -> None:
            self.close()
            mine = site_fingerprint(params(), optimizer)
            self.wrong = [what for what, key in (("model weights", "weights"),
                                                 ("inner optimizer state", "inner"))
                          if saved.get(key) is not None and mine[key] != saved[key]]

        self._hook = optimizer.register_step_pre_hook(check)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def problem(self) -> str | None:
        if not self.wrong:
            return None
        return (f"DiLoCo: this site's {' and '.join(self.wrong)} are not those saved with "
                "its DiLoCo state. A checkpoint that restores one rank's model and optimizer "
                "on every site (a loop that saves on rank 0 alone) loses every other site's "
                "local weights and inner optimizer state: save and load each rank's own "
                "(commpress.save_rank_state({'model': ..., 'optimizer': ..., 'diloco': "
                "sync.state_dict()}, f'.../commpress-rank{rank}.pt')). A synchronizer "
                "constructed after the model was loaded broadcast the first rank's weights "
                "over it: construct it first, then load the model, the optimizer and its "
                "state. Or restart every site from θ_global: load_state_dict(state, "
                "elastic=True)")


def weights_checksum(params: list[torch.Tensor]) -> int:
    """One checksum of ``params``' bits, one parameter at a time (no flat copy)."""
    return sum(checksum(p) * (i + 1) for i, p in enumerate(params))


def site_fingerprint(params: list[torch.Tensor],
                     optimizer: torch.optim.Optimizer | None) -> dict[str, int | None]:
    """Checksums of this site's own state, which a checkpoint must bring back with the
    synchronizer's: the local weights of the trained parameters ``params``, and the inner
    optimizer's state (None without one)."""
    inner = None
    if optimizer is not None:
        tensors = [v for s in optimizer.state_dict()["state"].values() for v in s.values()
                   if isinstance(v, torch.Tensor)]
        inner = weights_checksum(tensors)
    return {"weights": weights_checksum(params), "inner": inner}


def warn_if_sites_identical(local: int, group: dist.ProcessGroup,
                             topology: Topology) -> None:
    """At the first sync: sites whose local weights are identical trained as one (a DDP
    over every site's ranks, or the same batches everywhere): DiLoCo averages nothing."""
    every = all_gather_objects(local, group, "DiLoCo: independent sites")
    world = len(every)
    sites = world // topology.ranks_per_node_in(world)
    if sites > 1 and len(set(every)) == 1 and dist.get_rank(group) == 0:
        log.warning("DiLoCo: every site's local weights are identical at the first sync: the "
                    "sites did not train independently — a DistributedDataParallel over "
                    "every site's ranks (DDP must run on each site's own ranks), or the same "
                    "batches on every site. DiLoCo averages nothing then")


def ddp_spanning_sites(model: nn.Module, group: dist.ProcessGroup,
                        topology: Topology) -> str:
    """The ranks of a DDP ``model`` whose group reaches beyond this rank's site, in words
    ('' when it stays inside it, or is not DDP)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return ""
    ddp_ranks = dist.get_process_group_ranks(model.process_group)
    ranks = dist.get_process_group_ranks(group)
    rpn = topology.ranks_per_node_in(len(ranks))
    site = ranks.index(dist.get_rank()) // rpn
    mine = set(ranks[site * rpn:(site + 1) * rpn])
    if set(ddp_ranks) <= mine:
        return ""
    sites = sorted({ranks.index(r) // rpn for r in ddp_ranks if r in ranks})
    return f"ranks {ddp_ranks}, which spans sites {sites} ({rpn} ranks per site)"


def drop_nonfinite_state(optimizer: torch.optim.Optimizer | None) -> int:
    """Forget the optimizer state of parameters whose state holds a non-finite value
    (moments of a non-finite gradient); the number of parameters it was dropped for."""
    if optimizer is None:
        return 0
    dropped = 0
    for p, s in list(optimizer.state.items()):
        if any(isinstance(v, torch.Tensor) and v.is_floating_point()
               and not bool(torch.isfinite(v).all()) for v in s.values()):
            optimizer.state[p] = {}
            dropped += 1
    return dropped


def check_inner(params: list[nn.Parameter], inner_optimizer: Any) -> None:
    """Refuse what the outer step cannot reach: an inner optimizer that keeps master weights
    of its own (its next step would write them back over θ_global), and sharded
    parameters (each rank's shard would be averaged with other shards)."""
    if hasattr(inner_optimizer, "buckets") and hasattr(inner_optimizer, "policy"):
        raise InputError("DiLoCo: inner_optimizer is a commpress.ShardedOptimizer, whose fp32 "
                         "master shards would undo every sync; allowed: an optimizer that steps "
                         "the parameters themselves (DDP inside a site)")
    sharded = [type(p).__name__ for p in params
               if type(p).__name__ in ("FlatParameter", "DTensor") or hasattr(p, "_local_tensor")]
    if sharded:
        raise InputError(f"DiLoCo: the model's parameters are sharded ({sharded[0]}: FSDP); "
                         "allowed: whole parameters on every rank (DDP or one process per "
                         "site)")
