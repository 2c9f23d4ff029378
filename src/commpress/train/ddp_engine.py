"""Data parallelism through torch's DDP, for comparing commpress with the hooks users
would otherwise pick: plain all-reduce, ``fp16_compress_hook``, PowerSGD, or
commpress's own hook (:func:`commpress.ddp_hook`) — real, or played for ``simulate``;
and, with ``--outer``, DDP inside each site and :class:`~commpress.DiLoCo` across sites.

The optimizer is torch's AdamW on the full replica; gradients are clipped with
``clip_grad_norm_`` and a non-finite norm skips the step (or raises), as in
:class:`~commpress.ShardedOptimizer`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from commpress.collectives.byte_stats import Stats, record
from commpress.collectives.topology import Topology
from commpress.dp.guard import GradGuard
from commpress.frontends.ddp import DDPHookState, ddp_hook
from commpress.frontends.diloco import DiLoCo
from commpress.frontends.played.ddp import PlayedDDPHook
from commpress.frontends.played.diloco import PlayedDiLoCo
from commpress.frontends.sharded_optimizer import NonFiniteGradientError
from commpress.validate import InputError

log = logging.getLogger(__name__)


def _counting(hook, bytes_per_elem: float):
    """Wrap a torch hook so its wire bytes reach ``commpress.stats()`` (ring all-reduce:
    ``2 (n − 1) / n`` of the bucket per rank)."""

    def wrapped(state, bucket):
        n = dist.get_world_size(state if isinstance(state, dist.ProcessGroup) else None)
        numel = bucket.buffer().numel()
        sent = 2 * (n - 1) / n * numel
        record("dp.grad", calls=1, elements=sent, wire_bytes=sent * bytes_per_elem,
               raw_bytes=sent * bucket.buffer().element_size())
        return hook(state, bucket)

    return wrapped


def install_hook(model: DDP, name: str, policy, group, topology: Topology) -> object:
    """Register the named hook; returns its state (checkpointed when it has one)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    # torch's hooks and the bytes per element they send
    torch_hooks = {"allreduce": (default_hooks.allreduce_hook, 4),
                   "fp16": (default_hooks.fp16_compress_hook, 2)}
    if name in torch_hooks:
        model.register_comm_hook(group, _counting(*torch_hooks[name]))
        return None
    if name.startswith("powersgd:"):
        state = powerSGD_hook.PowerSGDState(process_group=group,
                                            matrix_approximation_rank=int(name.split(":")[1]),
                                            start_powerSGD_iter=2, random_seed=0)

        def powersgd_in_order(state, bucket):
            # PowerSGD chains all-reduces in future callbacks; on Gloo, callbacks of two
            # buckets interleave differently on different ranks and the collectives
            # mismatch ("Received data size doesn't match"). Finishing each bucket
            # before the next keeps the order (and costs PowerSGD its overlap).
            fut = powerSGD_hook.powerSGD_hook(state, bucket)
            fut.wait()
            return fut

        model.register_comm_hook(state, powersgd_in_order)
        return state
    state, hook = ddp_hook(model, policy, group=group, topology=topology)
    model.register_comm_hook(state, hook)
    return state


def replica_optimizer(module: nn.Module, lr: float,
                      weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over a whole replica; matrices decay, biases and norms do not."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def step_replica(module: nn.Module, opt: torch.optim.Optimizer, max_grad_norm: float | None,
                 nonfinite: str, what: str) -> bool:
    """Clip the averaged gradients and step; a non-finite norm skips the step (or raises
    :class:`NonFiniteGradientError`). Gradients are cleared either way."""
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf).item()
    if not math.isfinite(norm):
        opt.zero_grad()
        if nonfinite == "raise":
            raise NonFiniteGradientError(f"{what}: gradient norm {norm}")
        log.warning("%s: non-finite gradient norm, step skipped", what)
        return False
    opt.step()
    opt.zero_grad()
    return True


def ddp_forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int,
                         no_sync: Callable[[], AbstractContextManager] | None = None) -> float:
    """One rank's micro-batches, each backward right after its forward (the gradients add
    up in ``p.grad`` in that order); ``no_sync`` (DDP's) wraps all but the last, so the
    hook all-reduces once. Returns the batch's mean loss."""
    total = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        with no_sync() if (no_sync is not None and i < micro - 1) else nullcontext():
            logits = model(xm)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ym.reshape(-1))
            (loss / micro).backward()
        total += loss.item()
    return total / micro


class DDPEngine:
    """Forward/backward/step of a data-parallel replica under torch DDP: a real rank's (DDP
    over ``group`` with the named hook), or, with ``played``, every rank's in turn, the
    hook's all-reduces played by :class:`PlayedDDPHook` (:meth:`take` after each rank)."""

    def __init__(self, module: nn.Module, group, policy, hook: str, topology: Topology,
                 lr: float, weight_decay: float, max_grad_norm: float | None,
                 nonfinite: str, played: PlayedDDPHook | None = None,
                 outer: dict | None = None, outer_group=None) -> None:
        self.module, self.played = module, played
        if played is None:
            self.model = DDP(module, process_group=group, bucket_cap_mb=4)
            self.hook_state = install_hook(self.model, hook, policy, group, topology)
        else:
            self.model, self.hook_state = module, played
        self.optimizer = replica_optimizer(module, lr, weight_decay)
        # DiLoCo across sites (``group`` is then this rank's site); every inner step counts,
        # a skipped one too, so that every site syncs at the same steps
        self.outer = (DiLoCo(module, None, group=outer_group, topology=topology, **outer)
                      if outer else None)
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.steps = 0

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, micro: int) -> float:
        return ddp_forward_backward(self.model, x, y, micro,
                                    self.model.no_sync if self.played is None else None)

    @property
    def guards(self) -> list[GradGuard]:
        """The convergence guards of the commpress hook and of DiLoCo, those that are on
        (the trainer records them)."""
        held = [getattr(self.hook_state, "guard", None) if self.played is None else None,
                getattr(self.outer, "guard", None)]
        return [g for g in held if g is not None]

    def take(self, rank: int) -> None:
        """Played: rank ``rank``'s gradients into the hook's all-reduces."""
        self.played.take(rank)

    def step(self) -> bool:
        if self.played is not None:
            self.played.finish()
        what = "simulated DDP step" if self.played is not None else "DDP step"
        stepped = step_replica(self.module, self.optimizer, self.max_grad_norm, self.nonfinite,
                               f"{what} {self.steps}")
        if self.outer is not None:
            self.outer.step()
        self.steps += 1
        self.skipped_steps += not stepped
        return stepped

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """The commpress hook's and DiLoCo's buckets by the way each collective went."""
        out = {}
        for part in (self.hook_state, self.outer):
            if isinstance(part, DDPHookState | DiLoCo):
                out.update(part.fallback_decisions())
        return out

    def remove(self) -> None:
        """The commpress hook's thread and process group, after the last step (the same
        verb as the optimizers the trainer holds)."""
        if isinstance(self.hook_state, DDPHookState):
            self.hook_state.remove()
        if self.outer is not None:
            self.outer.remove()

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "steps": self.steps,
                 "skipped_steps": self.skipped_steps}
        if hasattr(self.hook_state, "state_dict"):
            state["hook"] = self.hook_state.state_dict()
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.skipped_steps = state["steps"], state["skipped_steps"]
        if "hook" in state:
            self.hook_state.load_state_dict(state["hook"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])


class PlayedSites:
    """``commpress simulate --outer``: ``sites`` sites of ``ranks_per_site`` played ranks
    each, DDP inside a site (the commpress hook, played per site) and DiLoCo across the
    sites (:class:`PlayedDiLoCo`) — the same engine as :class:`DDPEngine` with ``outer``,
    every site in this process. The sites share one module: :meth:`held` swaps a site's
    weights in (the parameters' storage, not a copy); each site has its own inner
    optimizer and hook codecs. Between calls the module holds site 0's weights, which
    are also what the run saves and reports as the model (a real run's rank 0's)."""

    def __init__(self, module: nn.Module, policy, *, sites: int, ranks_per_site: int,
                 stats: Stats, lr: float, weight_decay: float, max_grad_norm: float | None,
                 nonfinite: str, outer: dict) -> None:
        self.module, self.count, self.per_site = module, sites, ranks_per_site
        self.params = list(module.parameters())
        self._current = 0
        self._weights: list[list[torch.Tensor] | None] = [None] + [
            [p.detach().clone() for p in self.params] for _ in range(1, sites)]
        self.optimizers = [replica_optimizer(module, lr, weight_decay) for _ in range(sites)]
        self.hooks = [PlayedDDPHook(module, policy, ranks=ranks_per_site,
                                    ranks_per_node=ranks_per_site, stats=stats)
                      for _ in range(sites)]
        self.outer = PlayedDiLoCo(module, self, ranks=sites * ranks_per_site,
                                  ranks_per_site=ranks_per_site, stats=stats, **outer)
        self.max_grad_norm, self.nonfinite = max_grad_norm, nonfinite
        self.skipped_steps = 0
        self.steps = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Site 0's: the learning-rate schedule's, copied to the others at each step."""
        return self.optimizers[0]

    @contextmanager
    def held(self, site: int) -> Iterator[None]:
        """``site``'s weights in the module for the block; the site held before, after."""
        before = self._current
        self._hold(site)
        try:
            yield
        finally:
            self._hold(before)

    def _hold(self, site: int) -> None:
        if site == self._current:
            return
        kept = [p.data for p in self.params]
        for p, w in zip(self.params, self._weights[site]):
            p.data = w
        self._weights[self._current], self._weights[site] = kept, None
        self._current = site

    def site_of(self, rank: int) -> int:
        return rank // self.per_site

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, micro: int) -> float:
        return ddp_forward_backward(self.module, x, y, micro)

    def take(self, rank: int) -> None:
        """Played rank ``rank``'s gradients into its site's hook."""
        self.hooks[self.site_of(rank)].take(rank % self.per_site)

    def step(self) -> bool:
        """Every site's inner step (its hook's average, its optimizer), then DiLoCo's."""
        stepped = []
        for site in range(self.count):
            with self.held(site):
                self.hooks[site].finish()
                opt = self.optimizers[site]
                for group, first in zip(opt.param_groups, self.optimizers[0].param_groups):
                    group["lr"] = first["lr"]
                stepped.append(step_replica(self.module, opt, self.max_grad_norm,
                                            self.nonfinite, f"simulated DDP step {self.steps} "
                                            f"(site {site})"))
        self.outer.step()
        self.steps += 1
        self.skipped_steps += not stepped[0]  # rank 0's count, as a real run reports
        return stepped[0]

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        return {}  # played: nothing measured

    def remove(self) -> None:
        self.outer.remove()

    def state_dict(self) -> dict:
        with self.held(0):
            others = [[w.clone() for w in self._weights[s]] for s in range(1, self.count)]
        return {"sites": self.count, "weights": others,
                "optimizers": [o.state_dict() for o in self.optimizers],
                "hooks": [h.state_dict() for h in self.hooks], "outer": self.outer.state_dict(),
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("sites") != self.count:
            raise InputError(f"simulate --outer: the saved state holds {state.get('sites')} "
                             f"sites; this run plays {self.count}: resume with the same "
                             "ranks and ranks per node")
        self._hold(0)
        for s, saved in enumerate(state["weights"], start=1):
            for w, t in zip(self._weights[s], saved, strict=True):
                w.copy_(t)
        for o, saved in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(saved)
        for h, saved in zip(self.hooks, state["hooks"], strict=True):
            h.load_state_dict(saved)
        self.outer.load_state_dict(state["outer"])
        self.steps, self.skipped_steps = state["steps"], state["skipped_steps"]
