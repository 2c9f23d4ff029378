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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from commpress.collectives import Topology
from commpress.collectives.agreement import agree, all_gather_objects, allow_replay, refuse
from commpress.collectives.comm import all_gather_single
from commpress.collectives.group_context import replayable
from commpress.collectives.handle import completed
from commpress.dp import DPBucket
from commpress.dp.fallback import tally
from commpress.dp.grad_path import say_once, warn_if_uncompressed
from commpress.dp.guard import GradGuard
from commpress.dp.saved_state import check_resume, envelope, on_every_rank
from commpress.frontends.parts import clip_guard
from commpress.frontends.parts.buckets import (
    Bucket,
    ReplicationKey,
    buckets_identity,
    buckets_state,
    build_buckets,
    build_optimizer,
    checksum,
    load_buckets_state,
    tensor_parallel_key,
)
from commpress.frontends.parts.replica_sync import broadcast_buffers, sync_initial_state
from commpress.kernels.reference import sum_rows
from commpress.policy import Guard, Policy
from commpress.validate import (
    InputError,
    check_float,
    check_int,
    check_saved_state,
    few,
    raise_if_any,
)

log = logging.getLogger(__name__)

STATE_FORMAT = "commpress.ShardedOptimizer/2"
CONSOLIDATED_FORMAT = "commpress.ShardedOptimizer.consolidated/1"
NONFINITE_CHOICES = ("skip", "raise")
INIT_SYNC_CHOICES = ("broadcast", "verify")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or ±Inf and the optimizer was told to stop."""


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 optimizer whose gradient reduce-scatter and weight all-gather are
    compressed by ``policy`` (``"none"``: exact ZeRO; ``"sdp4bit"``: qWD + TLq-HS).

    Used like any optimizer — it is a ``torch.optim.Optimizer``, so torch's LR
    schedulers drive it::

        opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "sdp4bit", lr=3e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
        loss.backward(); opt.step(); opt.zero_grad(); sched.step()

    ``param_groups`` (and ``state``) are the inner optimizer's own, over the fp32 master
    shards (one group per bucket): a scheduler writing ``group["lr"]`` reaches the shard.
    Groups cannot be added (the buckets are laid out at construction).

    Gradient clipping: pass ``max_grad_norm`` (every step), or call
    ``opt.clip_grad_norm_(max_norm)`` between ``backward()`` and ``step()`` (it returns
    the total norm, as torch's does). The gradients live in the flat buckets, not in
    ``param.grad`` (None after backward), and only ``step()`` reduces them across ranks;
    so ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` is routed to
    ``opt.clip_grad_norm_`` while the optimizer holds them (all of its parameters or
    none: see :mod:`commpress.frontends.parts.clip_guard`).

    Args:
        model: the module to train (its parameters become views into flat buckets), or
            its parameters or parameter groups as torch optimizers (and
            ``ZeroRedundancyOptimizer``) take them — each group's options (``lr``,
            ``weight_decay``, …) are its buckets' inner-optimizer options; without a
            module there are no buffers or frozen parameters to broadcast.
        optimizer_cls: inner optimizer class (default ``torch.optim.AdamW``), run on the
            fp32 master shards.
        policy: preset name, policy file, dict or :class:`~commpress.Policy`.
        group: data-parallel process group (default: the world).
        topology: node layout for the two-level gradient path (default from
            ``LOCAL_WORLD_SIZE``).
        bucket_numel: target elements per bucket (larger: fewer collectives).
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        nonfinite: ``"skip"`` the step (logged, counted in ``skipped_steps``) or
            ``"raise"`` :class:`NonFiniteGradientError` on every rank.
        overlap: start each bucket's reduce-scatter as soon as its gradients are ready.
        decay_1d: apply the optimizer's weight decay to 1-D parameters (biases, norms) too,
            as torch's optimizers do (default); False: to matrices only, as GPT recipes
            set it (1-D parameters get ``weight_decay=0``).
        norm_group: group over which the squared gradient norm is summed (default: the
            data-parallel group; with tensor/pipeline parallelism, the whole world, so
            clipping and the non-finite check see the whole model on every rank).
        norm_weights: per-parameter-name weight of its squared norm (e.g. ``1/tp`` for
            parameters replicated across tensor-parallel ranks, counted once in all).
        replication_key: ``f(name, param)``; parameters with different keys never share a
            bucket (default :func:`tensor_parallel_key`: TP-sliced apart from TP-replicated,
            so replicated parameters stay bitwise identical across TP ranks).
        init_sync: the replicas must start identical (qWD only sends differences, so it
            would never close a gap): ``"broadcast"`` the first data-parallel rank's
            parameters (trainable and frozen) and buffers, as DDP does, or ``"verify"``
            that they are equal and refuse if not.
        broadcast_buffers: copy the first data-parallel rank's buffers (a BatchNorm's
            running statistics, which each rank's forward moves by its own batch) to every
            rank once per ``step()``, in one coalesced broadcast, as DDP's
            ``broadcast_buffers=True`` does before each forward. No buffers: nothing sent.
        fallback: ``"measured"``: each bucket times its gradient reduce-scatter and weight
            all-gather compressed and exact in its first steps and keeps compression only
            where it is faster (:mod:`commpress.dp.fallback`); None: the policy's
            (``fallback:`` in a policy file; default off).
        guard: the convergence guard (:mod:`commpress.dp.guard`): a budget for the
            relative error of each bucket's gradient codes, or ``{"max_rel_error": …,
            "window": …, "every": …}``; a bucket over it is promoted to more bits on
            every rank alike. None: the policy's (``guard:`` in a policy file; default off).
        **optimizer_kwargs: passed to ``optimizer_cls`` (lr, betas, weight_decay, ...).
    """

    def __init__(self, model: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 optimizer_cls: type[torch.optim.Optimizer] | None = None,
                 policy: str | dict | Policy | None = "none",
                 group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None, *, bucket_numel: int = 1 << 22,
                 max_grad_norm: float | None = None, nonfinite: str = "skip",
                 overlap: bool = True, decay_1d: bool = True,
                 norm_group: dist.ProcessGroup | None = None,
                 norm_weights: dict[str, float] | None = None,
                 replication_key: ReplicationKey = tensor_parallel_key,
                 init_sync: str = "broadcast", broadcast_buffers: bool = True,
                 fallback: str | None = None, guard: Guard | dict | float | None = None,
                 **optimizer_kwargs: Any) -> None:
        _check_arguments(model, optimizer_cls, policy, nonfinite, bucket_numel, max_grad_norm,
                         init_sync, broadcast_buffers)
        self.model, named, group_of, group_options = parameter_groups(model)
        self.policy = Policy.resolve(policy).with_fallback(fallback).with_guard(guard)
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
        self.broadcast_buffers = broadcast_buffers
        # stats
        self.steps = 0
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")
        # internal state: this step's reduced gradient norm, once clip_grad_norm_ or step
        # has waited for the reduce-scatters, and clip_grad_norm_'s limit for the step
        self._reduced_norm: float | None = None
        self._clip_norm: float | None = None
        self._no_sync = False
        if not named:
            raise InputError("ShardedOptimizer: the model has no parameters that require grad")
        known = {n for n, _ in (self.model.named_parameters() if self.model is not None
                                else named)}
        unknown = sorted(set(self.norm_weights) - known)
        if unknown:  # a weight that names nothing would be dropped from the norm silently
            raise InputError(f"ShardedOptimizer: norm_weights names {unknown[:3]}, which are not "
                             "parameters here; allowed: the parameters' names"
                             + ("" if self.model is not None else
                                " (given parameters, not a module: group<g>.param<i>)"))
        # gradients arrive roughly in reverse registration order during backward
        self.buckets = build_buckets(
            named[::-1], bucket_numel, decay_1d,
            lambda: DPBucket(self.policy, self.topology, weights=True), self.world,
            replication_key, group_of)
        for b in self.buckets:
            b.materialize(self.rank, self.world)
        # the convergence guard (a policy's guard:), over every bucket's gradient codecs
        self.guard = (GradGuard(self.policy.guard, [b.dp for b in self.buckets],
                                "ShardedOptimizer", weights=True)
                      if self.policy.guard is not None else None)
        if self.world > 1:
            # the guard decides from every rank's signals at the same steps: one guard
            agree(self.group, "ShardedOptimizer", label="guard",
                  guard=None if self.guard is None else self.policy.guard.to_dict())
            sync_initial_state(self.model, self.buckets, self.group, self.rank, self.world,
                               init_sync)
            warn_if_uncompressed(self.policy, self.topology, self.group, "ShardedOptimizer")
            # its buckets' calls are fixed by the layout just agreed: after the first step
            # only a step's first call and the norm carry a header
            allow_replay(self.group)
        self.optimizer = build_optimizer(self.buckets, optimizer_cls, optimizer_kwargs,
                                         group_options)
        # torch.optim.Optimizer's bookkeeping (step hooks, profiling) over the inner
        # optimizer's very groups and state: what a scheduler writes, the shards use
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        clip_guard.hold(self, *self._clip_views())
        log.info("ShardedOptimizer: %d buckets, %d parameters, world %d, policy %s",
                 len(self.buckets), sum(b.numel for b in self.buckets), self.world,
                 self.policy.name)

    def remove(self) -> None:
        """Remove the gradient hooks this optimizer put on the model's parameters, once it
        is done with them: the model then no longer keeps it alive — nor its process
        group's threads, which live as long as the group object does (a process that runs
        many jobs one after another frees each job's this way) — and backward leaves the
        gradients in ``.grad`` again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        clip_guard.release(self, *self._clip_views())

    def _clip_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The two ways a loop names all of this optimizer's parameters to torch's
        ``clip_grad_norm_``: the model's, and the masters in ``param_groups``."""
        return ([p for b in self.buckets for p in b.params], [b.master for b in self.buckets])

    # -- backward ---------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, i = self._where[id(p)]
        off = b.offsets[i]
        if b.handle is not None or self._reduced_norm is not None:
            raise RuntimeError(
                f"ShardedOptimizer: a gradient of {b.names[i]!r} arrived after its bucket's "
                "reduce-scatter started (or after clip_grad_norm_); call step() (or use "
                "no_sync()) between backward passes")
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

    def _launch(self, b: Bucket) -> None:
        if self.world == 1:
            b.grad_shard.copy_(b.grad_buffer)
            b.handle = completed(b.grad_shard)
        else:
            watching = (self.guard.watching(b.index, self.guard.sampling(self.steps))
                        if self.guard is not None
                        else nullcontext())
            with replayable(f"bucket {b.index}:grad"), watching:
                b.handle = b.dp.reduce_scatter(b.grad_shard, b.grad_buffer, self.group,
                                               op="avg", async_op=True)

    # -- step ----------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step's global gradient norm to ``max_norm``; return the norm before
        clipping. Call between ``backward()`` and ``step()``, in place of
        ``torch.nn.utils.clip_grad_norm_`` (which sees no gradients here).

        It waits for the gradients' reduce-scatter and computes the norm over
        ``norm_group`` (one float across ranks); ``step()`` then scales the gradients
        with the same arithmetic as ``max_grad_norm`` (the smaller limit wins when both
        are set). A non-finite norm is returned as is and ``step()`` skips or raises.
        """
        if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
            max_norm = max_norm.item()  # torch's function takes a one-element tensor too
        if not (isinstance(max_norm, int | float) and not isinstance(max_norm, bool)
                and max_norm > 0):  # inf: measure the norm, clip nothing (as torch's)
            raise InputError(f"clip_grad_norm_: max_norm={max_norm!r} is not allowed; "
                             "allowed: a number > 0 (inf: the norm, no clipping)")
        if norm_type != 2.0:
            raise InputError(f"clip_grad_norm_: norm_type={norm_type!r} is not allowed; "
                             "allowed: 2.0 (the global norm is the 2-norm)")
        norm = self._reduce_gradients()
        self._clip_norm = max_norm if self._clip_norm is None else min(self._clip_norm,
                                                                       max_norm)
        return torch.tensor(norm, dtype=torch.float32, device=self.buckets[0].grad_shard.device)

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        """Reduce gradients, update the shards, gather weights.

        Returns the loss ``closure()`` returned when given one (it runs first, with
        gradients enabled, as in ``torch.optim``); else whether the step was taken
        (False: skipped for a non-finite gradient)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = self._step()
        if self.broadcast_buffers and self.world > 1 and self.model is not None:
            broadcast_buffers(self.model, self.group, self.buckets[0].param_buffer.device)
        return loss if closure is not None else stepped

    def _step(self) -> bool:
        self._check_trained_parameters()
        # Steps 1-2: the reduced gradients and their norm (unless clip_grad_norm_ did)
        norm = self._reduce_gradients()
        limits = [x for x in (self.max_grad_norm, self._clip_norm) if x is not None]
        self._reduced_norm = self._clip_norm = None
        # Steps 3-4: clip, the inner optimizer on the fp32 master shards, the new weights
        # to every replica
        return finish_step(self, norm, min(limits) if limits else None, "ShardedOptimizer step",
                           lambda: [(b.master, b.grad_shard) for b in self.buckets],
                           self._gather_params)

    def _check_trained_parameters(self) -> None:
        """Refuse a change of which parameters train since the optimizer was built: its
        flat buckets step whole, so a frozen parameter would keep moving (momentum, weight
        decay), and one unfrozen, added or replaced would never train."""
        frozen = [n for b in self.buckets for n, p in zip(b.names, b.params)
                  if not p.requires_grad]
        outside = [] if self.model is None else [
            n for n, p in self.model.named_parameters()
            if p.requires_grad and id(p) not in self._where]
        if frozen or outside:
            what = (f"{len(frozen)} of its parameters no longer require gradients "
                    f"({few(frozen)}): their buckets step whole, so they would keep moving"
                    if frozen else f"{len(outside)} parameters of the model require "
                    f"gradients but are not among those it was built over ({few(outside)}: "
                    "unfrozen, added, or replaced by load_state_dict(..., assign=True) since): "
                    "they would never train")
            refuse(self.group, "ShardedOptimizer.step", InputError(
                f"ShardedOptimizer: {what}. Allowed: the parameters it was built over, "
                "training throughout; to hold some still for a while, put them in a "
                "parameter group of their own and set lr 0 in every optimizer group whose "
                "'param_group' is its index"))

    def _reduce_gradients(self) -> float:
        """Finish this step's gradient reduce-scatters, once; return the global norm."""
        if self._reduced_norm is not None:
            return self._reduced_norm
        self._finish_reduce_scatters()
        # Step 2: one float across ranks: the norm, non-finite if any gradient is
        return self._take_norm(global_grad_norm(self.local_grad_sumsq(), self.norm_group))

    def _finish_reduce_scatters(self) -> None:
        """Step 1: every bucket's reduce-scatter (most started during backward)."""
        for b in self.buckets:
            if b.handle is None:
                self._launch(b)
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.ready.clear()
            b.grad_buffer.zero_()
        if self.guard is not None and self.world > 1 and self.guard.sampling(self.steps):
            # promotions apply from the next step
            self.guard.decide(self.steps, self.group, weights=self._weight_gaps())

    @torch.no_grad()
    def _weight_gaps(self) -> list[torch.Tensor]:
        """Per bucket, this rank's ``[‖w − m‖², ‖m‖²]`` (fp64) over its shard: ``w`` the
        weights the last all-gather gave, ``m`` the master weights they stand for — the
        error of a lossy ``dp.param`` codec (qWD's differences); zeros where the weights
        are gathered exactly."""
        out = []
        for b in self.buckets:
            if b.dp.param_rule is None or not b.dp.weights_lossy:
                out.append(torch.zeros(2, dtype=torch.float64, device=b.master.device))
                continue
            master = b.master.detach().double()
            gathered = b.param_buffer[b.shard(self.rank, self.world)].double()
            out.append(torch.stack([(gathered - master).square().sum(),
                                    master.square().sum()]))
        return out

    def _take_norm(self, norm: float) -> float:
        self.last_grad_norm = norm
        self._reduced_norm = norm
        return norm

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """With ``fallback="measured"``: how many buckets went each way, by collective
        (:func:`commpress.dp.fallback.tally`); empty without it."""
        return tally(c for b in self.buckets for c in b.dp.choices.values())

    def local_grad_sumsq(self) -> torch.Tensor:
        """This rank's weighted squared gradient sum over its shards (fp64)."""
        return sum(b.grad_sumsq(self.rank, self.world, self.norm_weights)
                   for b in self.buckets)

    def _gather_params(self) -> None:
        for b in self.buckets:
            new = b.master.detach().to(b.dtype)
            if self.world == 1:  # nothing crosses a wire: nothing is compressed
                b.param_buffer.copy_(new)
            else:
                with replayable(f"bucket {b.index}:param"):
                    b.dp.gather_weights(b.param_buffer, new, self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients: the flat buffers, and any ``param.grad`` (None
        after backward here; a gradient set by hand becomes None, or zeros with
        ``set_to_none=False``, as in ``torch.optim``)."""
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.ready.clear()
            b.grad_buffer.zero_()
            for p in b.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                elif p.grad.grad_fn is not None:
                    p.grad.detach_().zero_()
                else:
                    p.grad.requires_grad_(False).zero_()
        self._reduced_norm = self._clip_norm = None

    # -- groups ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the parameters are packed into flat buckets at construction.
        (``torch.optim.Optimizer.__init__`` registers the inner optimizer's groups here.)"""
        if any(param_group is g for g in self.optimizer.param_groups):
            self.param_groups.append(param_group)
            return
        raise InputError(
            "ShardedOptimizer.add_param_group is not supported: the parameters are packed "
            "into flat buckets when the optimizer is built; allowed: build it over a model "
            "holding every parameter to train (set requires_grad before), and change a "
            "group's options (lr, weight_decay, ...) in param_groups")

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: master shards, inner optimizer, codec states, weights."""
        return envelope(STATE_FORMAT, self.policy, self.rank, self.world,
                        **buckets_state(self.buckets, self.optimizer),
                        steps=self.steps, skipped_steps=self.skipped_steps,
                        codecs=[b.dp.state_dict() for b in self.buckets],
                        **({"guard": self.guard.state_dict()} if self.guard else {}))

    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer, on rank ``to`` of the group (None on the others): every
        bucket's fp32 master weights, inner-optimizer state and options, the weights and
        the step counters, unsharded and on the CPU, so any number of ranks can load it
        (``load_state_dict(state, elastic=True)``). Every rank must call it, with the
        same ``to``; the shards are gathered to that rank one at a time, so no rank holds
        more than one bucket's worth on its device. Unlike torch's
        ``ZeroRedundancyOptimizer`` it returns the state rather than keeping it for
        ``state_dict()``, which stays this rank's resumable state. The codecs' state
        (error-feedback memory, rounding streams) is each rank's own, laid out for this
        world, and is not in it.

        The inner optimizer's state must be elementwise (a tensor per element of the
        shard: Adam's moments, SGD's momentum) or scalars every rank holds alike (a step
        count, checked); anything else (a factored second moment) is refused."""
        check_int("consolidate_state_dict: to", to, ge=0, le=self.world - 1)
        inner = self.optimizer.state_dict()
        split = [_elementwise_and_scalars(i, b.master, inner["state"].get(i, {}))
                 for i, b in enumerate(self.buckets)]
        if self.world > 1:  # one rank's scalars stand for all: they must be all alike
            agree(self.group, "gather", label="consolidate", to=to,
                  scalars=repr([{k: v.item() if isinstance(v, torch.Tensor) else v
                                 for k, v in scalars.items()} for _, scalars in split]))
        buckets = []
        for i, (b, (shards, scalars)) in enumerate(zip(self.buckets, split, strict=True)):
            full = {k: self._gather_shard(v, to, f"consolidate bucket {i} {k}")
                    for k, v in {"master": b.master.detach(), **shards}.items()}
            if self.rank == to:
                buckets.append({
                    "names": b.names, "master": full.pop("master")[:b.used],
                    "state": {k: v[:b.used] for k, v in full.items()}, "scalars": scalars,
                    "params": b.param_buffer[:b.used].cpu(),
                    "options": {k: v for k, v in inner["param_groups"][i].items()
                                if k != "params"}})
        if self.rank != to:
            return None
        return {"format": CONSOLIDATED_FORMAT, "policy": self.policy.to_dict(),
                "world_size": self.world, "buckets": buckets, "steps": self.steps,
                "skipped_steps": self.skipped_steps,
                **({"guard": self.guard.state_dict()} if self.guard else {})}

    def _check_consolidated(self, state: dict[str, Any]) -> tuple[int, list[str]]:
        """Refuse a consolidated state this run cannot load; its steps and checksums."""
        check_saved_state(state, CONSOLIDATED_FORMAT, "ShardedOptimizer (consolidated)", {
            "policy": self.policy.to_dict()}, "load a consolidate_state_dict() of a run "
            "with the same policy and model", formats={STATE_FORMAT: "one rank's "
            "state_dict(): load it without elastic=True on the rank that saved it; for "
            "elastic=True, every rank calls consolidate_state_dict()"})
        saved = state["buckets"]
        if [b["names"] for b in saved] != [b.names for b in self.buckets]:
            raise InputError("ShardedOptimizer (consolidated): the buckets hold other "
                             "parameters than this run's; load it with the same model, "
                             "parameter groups and bucket_numel")
        for i, (b, s) in enumerate(zip(self.buckets, saved, strict=True)):
            for key, t in (("master", s["master"]), ("params", s["params"]), *s["state"].items()):
                if not isinstance(t, torch.Tensor) or t.shape != (b.used,):
                    raise InputError(f"ShardedOptimizer (consolidated): bucket {i} {key} is "
                                     f"not a tensor of {b.used} elements")
        if self.guard is not None:
            self.guard.check_state(state.get("guard"))
        return state["steps"], [checksum(b["master"]) for b in saved]

    def _gather_shard(self, shard: torch.Tensor, to: int, label: str) -> torch.Tensor | None:
        """Every rank's ``shard`` end to end, on the CPU of rank ``to``; None elsewhere."""
        if self.world == 1:
            return shard.detach().cpu().clone()
        agree(self.group, "gather", label=label, numel=shard.numel(), dtype=str(shard.dtype))
        parts = ([shard.new_empty(shard.numel()) for _ in range(self.world)]
                 if self.rank == to else None)
        dist.gather(shard.contiguous(), parts, group=self.group, group_dst=to)
        return torch.cat([p.cpu() for p in parts]) if parts is not None else None

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore a state saved by the same rank of a run with the same world size,
        policy and model; anything else is refused with the reason.

        ``elastic=True`` loads a :meth:`consolidate_state_dict` (every rank the same one)
        on any number of ranks: masters, inner-optimizer state and options, weights and
        counters are resharded; the codecs start fresh (their state was each rank's own;
        said once, on rank 0)."""
        if elastic:
            return self._load_consolidated(state)

        def check() -> None:
            check_resume(
                state, STATE_FORMAT, "ShardedOptimizer", self.policy, self.rank, self.world,
                False, "resume each rank from its own state_dict() (every rank saves its own: "
                "commpress.save_rank_state) with the same world size, policy and model; "
                "another world size, or one file for every rank: load_state_dict("
                "consolidated, elastic=True) with the state consolidate_state_dict() returned",
                buckets_identity(self.buckets),
                formats={CONSOLIDATED_FORMAT: "a whole optimizer from consolidate_state_dict(): "
                         "load it with load_state_dict(state, elastic=True)"})
            if self.guard is not None:  # refused on every rank together, before any load
                self.guard.check_state(state.get("guard"))

        on_every_rank(self.group, "ShardedOptimizer", check)
        load_buckets_state(self.buckets, self.optimizer, state)
        # torch's load_state_dict makes new group dicts: share them again (a scheduler
        # writing the old ones would no longer reach the shards)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        for b, group in zip(self.buckets, self.param_groups, strict=True):
            group["param_group"] = b.group  # a state saved before groups named theirs
        if self.guard is not None:  # promoted codecs first: their state's layout
            self.guard.load_state_dict(state.get("guard"))
        for b, codecs in zip(self.buckets, state["codecs"], strict=True):
            b.dp.load_state_dict(codecs)
        self.steps = state["steps"]
        self.skipped_steps = state["skipped_steps"]

    def _load_consolidated(self, state: dict[str, Any]) -> None:
        problem, fingerprint = None, None
        try:  # whatever is wrong here, every rank must still reach the gather below
            fingerprint = self._check_consolidated(state)
        except InputError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - a malformed state, refused on every rank
            problem = (f"ShardedOptimizer (consolidated): not a consolidated state "
                       f"({type(e).__name__}: {e})")
        seen = (all_gather_objects((problem, fingerprint), self.group, "load consolidated")
                if self.world > 1 else [(problem, fingerprint)])
        raise_if_any([p for p, _ in seen], self.rank, "cannot load it")
        if any(f != fingerprint for _, f in seen):  # replicas would part silently
            raise InputError("ShardedOptimizer (consolidated): the ranks were given "
                             f"different states (steps and checksums: {[f for _, f in seen]}); "
                             "allowed: the same consolidate_state_dict() on every rank")
        saved = state["buckets"]
        inner = self.optimizer.state_dict()
        for i, (b, s) in enumerate(zip(self.buckets, saved, strict=True)):
            lo = b.shard(self.rank, self.world)
            b.param_buffer.zero_()[:b.used].copy_(s["params"])
            b.master.data.copy_(_padded(s["master"], b.numel)[lo])
            inner["state"][i] = {**s["scalars"], **{
                k: _padded(v, b.numel)[lo].clone() for k, v in s["state"].items()}}
            inner["param_groups"][i] = {**s["options"], "param_group": b.group,
                                        "params": inner["param_groups"][i]["params"]}
            # fresh codecs: this rank's memory of the old world means nothing here
            b.dp.fresh()
        if self.guard is not None:  # the promotions are every rank's alike: kept
            self.guard.load_state_dict(state.get("guard"))
        self.optimizer.load_state_dict(inner)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.steps, self.skipped_steps = state["steps"], state["skipped_steps"]
        say_once(log, ("consolidated", id(self)), self.rank,
                 "ShardedOptimizer: loaded a state consolidated on %s ranks into %s: the "
                 "codecs start fresh (error-feedback memory, rounding streams)",
                 state.get("world_size"), self.world)


def _elementwise_and_scalars(i: int, master: torch.Tensor, state: dict[str, Any]
                             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Bucket ``i``'s inner-optimizer ``state``: the tensors laid out like its shard, and
    the scalars (numbers, one-element tensors)."""
    shards, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == master.shape:
            shards[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() != 1:
            raise InputError(
                f"ShardedOptimizer.consolidate_state_dict: bucket {i}'s optimizer state "
                f"{key!r} has shape {tuple(value.shape)}, neither one value per element of "
                f"the shard ({tuple(master.shape)}) nor a scalar, so it cannot be resharded; "
                "allowed: an elementwise optimizer (SGD, Adam, AdamW, ...), or "
                "state_dict() per rank on the same number of ranks")
        else:
            scalars[key] = value
    return shards, scalars


def _padded(t: torch.Tensor, numel: int) -> torch.Tensor:
    """``t`` followed by zeros up to ``numel`` elements (a bucket's padding)."""
    return torch.cat([t, t.new_zeros(numel - t.numel())]) if t.numel() < numel else t


def global_grad_norm(local_sumsq: torch.Tensor, norm_group: dist.ProcessGroup | None) -> float:
    """The gradient norm over ``norm_group`` from each rank's squared sum, NaN if any rank
    holds a non-finite gradient (so all ranks skip or stop together). Each rank's squared
    sum is gathered and the parts are added in rank order: the same bits on every backend
    (an all-reduce's order is the backend's), which ``commpress simulate`` repeats."""
    parts = local_sumsq.reshape(1)
    if norm_group is not None and dist.get_world_size(norm_group) > 1:
        agree(norm_group, "all_gather", label="grad norm")
        mine = parts
        parts = torch.empty(dist.get_world_size(norm_group), dtype=mine.dtype,
                            device=mine.device)
        all_gather_single(parts, mine, norm_group)
    return norm_of_parts(parts)


@torch.no_grad()
def step_together(optimizers: Sequence[ShardedOptimizer]) -> bool:
    """Step sharded optimizers over disjoint parts of one model, each over its own
    data-parallel group, with one global gradient norm — a mixture of experts' dense
    weights over the data-parallel group and its experts over the expert-data-parallel
    group — so clipping and the non-finite check see the whole model, as one optimizer's
    ``step()`` would. They must share ``norm_group`` (the ranks every part lives on).
    Returns whether the step was taken."""
    first = optimizers[0]
    if any(o.norm_group is not first.norm_group for o in optimizers):
        raise InputError("step_together: the optimizers' norm_group differ; allowed: one "
                         "norm_group over every rank that holds a part of the model")
    for o in optimizers:  # each step() then checks its parameters, as alone
        if o._reduced_norm is None:
            o._finish_reduce_scatters()
    local = sum(o.local_grad_sumsq() for o in optimizers)
    norm = global_grad_norm(local, first.norm_group)
    for o in optimizers:
        o._take_norm(norm)
    return all([o.step() for o in optimizers])


def skips_nonfinite(norm: float, nonfinite: str, where: str) -> bool:
    """Whether a step with gradient norm ``norm`` is skipped (logged): a non-finite norm
    with ``nonfinite="skip"``; with ``"raise"`` it raises :class:`NonFiniteGradientError`."""
    if math.isfinite(norm):
        return False
    if nonfinite == "raise":
        raise NonFiniteGradientError(
            f"{where}: the global gradient norm is {norm} (a gradient holds NaN or Inf on "
            "some rank); the weights were not changed")
    log.warning("%s: non-finite gradient norm %s, step skipped", where, norm)
    return True


def finish_step(front: Any, norm: float, max_grad_norm: float | None, what: str,
                masters: Callable[[], list[tuple[nn.Parameter, torch.Tensor]]],
                gather: Callable[[], object]) -> bool:
    """What follows the global gradient norm in every sharded step, real or played: a
    non-finite ``norm`` skips the step (logged) or raises; else the gradients are clipped
    to ``max_grad_norm``, the inner optimizer steps the fp32 ``masters`` and ``gather``
    sends the new weights to every replica. ``front`` counts the step either way."""
    stepped = not skips_nonfinite(norm, front.nonfinite, f"{what} {front.steps}")
    if stepped:
        clip_and_step(front.optimizer, masters(), norm, max_grad_norm)
        gather()
    front.steps += 1
    front.skipped_steps += not stepped
    return stepped


def clip_and_step(optimizer: torch.optim.Optimizer,
                  masters: list[tuple[nn.Parameter, torch.Tensor]], norm: float,
                  max_grad_norm: float | None) -> None:
    """Scale the gradients to ``max_grad_norm`` if the norm exceeds it, and step the inner
    optimizer on the master weights with them (elementwise: shards or whole, the same
    bits)."""
    if max_grad_norm is not None and norm > max_grad_norm:
        coef = max_grad_norm / (norm + 1e-6)
        for _, grad in masters:
            grad.mul_(coef)
    for master, grad in masters:
        master.grad = grad
    optimizer.step()
    for master, _ in masters:
        master.grad = None


def norm_of_parts(parts: torch.Tensor) -> float:
    """The gradient norm from the ranks' squared sums (1-D, rank order), added left to
    right — the same bits on every backend; NaN if any part is."""
    value = sum_rows(parts.view(-1, 1)).item()
    return math.sqrt(value) if value >= 0 else float("nan")


def parameter_groups(params: Any) -> tuple[nn.Module | None, list[tuple[str, nn.Parameter]],
                                           dict[str, int], list[dict[str, Any]]]:
    """The module (None when given parameters), the trained parameters by name, each name's
    parameter group and each group's optimizer options: a module's parameters by their
    names, one group; parameters or groups as torch optimizers take them, named
    ``group<g>.param<i>`` (no module: no buffers or frozen parameters to keep equal)."""
    if isinstance(params, nn.Module):
        return params, [(n, p) for n, p in params.named_parameters() if p.requires_grad], {}, [{}]
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    named, group_of, options, seen = [], {}, [], set()
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"ShardedOptimizer: parameter group {g} is not a dict with "
                            f"'params'; got {type(group).__name__}")
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        if "param_group" in group:
            raise InputError(f"ShardedOptimizer: parameter group {g} has a 'param_group' key; "
                             "allowed: any other (the optimizer's groups name their "
                             "parameter group's index with it)")
        options.append({k: v for k, v in group.items() if k != "params"})
        for i, p in enumerate(members):
            if not isinstance(p, nn.Parameter):
                raise TypeError(f"ShardedOptimizer: parameter group {g} item {i} is a "
                                f"{type(p).__name__}; allowed: torch.nn.Parameter")
            if id(p) in seen:
                raise InputError(f"ShardedOptimizer: parameter group {g} item {i} is in an "
                                 "earlier group too; allowed: each parameter in one group")
            seen.add(id(p))
            if p.requires_grad:
                named.append((f"group{g}.param{i}", p))
                group_of[f"group{g}.param{i}"] = g
    return None, named, group_of, options


def _check_arguments(model, optimizer_cls, policy, nonfinite: str, bucket_numel: int,
                     max_grad_norm: float | None, init_sync: str,
                     broadcast_buffers: bool) -> None:
    """Bad arguments get a message naming them, before anything is built."""
    if isinstance(model, torch.Tensor) or not isinstance(model, nn.Module | Iterable):
        raise TypeError(f"ShardedOptimizer: model must be a torch.nn.Module, or an iterable "
                        f"of parameters or of parameter groups (dicts) as torch optimizers "
                        f"take; got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        # DDP would all-reduce every gradient in fp32 as well, on top of the codes
        raise InputError("ShardedOptimizer: model is wrapped in DistributedDataParallel, "
                         "which would all-reduce every gradient in fp32 beside commpress's "
                         "compressed reduce-scatter; allowed: the module itself (model.module)"
                         " — the sharded optimizer is the data parallelism")
    if optimizer_cls is not None and not (isinstance(optimizer_cls, type)
                                          and issubclass(optimizer_cls, torch.optim.Optimizer)):
        hint = (" (a policy name goes in the third argument or policy=...)"
                if isinstance(optimizer_cls, str) else
                " (pass the class, e.g. torch.optim.AdamW, and its options as keywords)")
        raise TypeError(f"ShardedOptimizer: optimizer_cls={optimizer_cls!r} is not allowed; "
                        f"allowed: a torch.optim.Optimizer subclass{hint}")
    if policy is not None and not isinstance(policy, str | dict | Policy):
        raise TypeError(f"ShardedOptimizer: policy={policy!r} is not allowed; allowed: a preset "
                        "name, a policy file path, a dict or a commpress.Policy")
    for name, value, choices in (("nonfinite", nonfinite, NONFINITE_CHOICES),
                                 ("init_sync", init_sync, INIT_SYNC_CHOICES)):
        if value not in choices:
            raise InputError(f"{name}={value!r} is not allowed; allowed: {', '.join(choices)}")
    check_int("bucket_numel", bucket_numel, ge=1)
    check_float("max_grad_norm", max_grad_norm, gt=0, optional=True)
    if not isinstance(broadcast_buffers, bool):
        raise InputError(f"broadcast_buffers={broadcast_buffers!r} is not allowed; allowed: "
                         "True, False")
