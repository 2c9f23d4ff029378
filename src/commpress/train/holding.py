"""What one process holds in a training run, decided once by :func:`hold`.

A :class:`RealRank` is one pipeline stage of one data-parallel rank: its data-parallel
front-end (:class:`~commpress.ShardedOptimizer`, or torch DDP with a hook) runs on the
mesh's process groups, its pipeline moves tensors between processes. A
:class:`PlayedReplica` is every stage of every data-parallel rank of one tensor-parallel
slice — one replica, since the replicas are bitwise identical: it plays each rank's
collectives in-process (:class:`PlayedShardedOptimizer`, :class:`PlayedDDPHook`,
:class:`PlayedP2P`) and keeps each rank's own tensor-parallel codec state.

:class:`~commpress.train.run.Run` asks its holder for the parts that differ — the groups,
the front-ends (built once, as torchtitan's ``apply_dp`` does), a rank's pass, the update,
the checkpoint layout, the byte counters — and never asks which one it holds.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives import stats
from commpress.collectives.agreement import all_gather_objects
from commpress.collectives.byte_stats import Stats
from commpress.collectives.comm import all_gather_single, group_timeout
from commpress.collectives.group_context import release
from commpress.collectives.topology import Topology
from commpress.frontends.played.ddp import PlayedDDPHook
from commpress.frontends.played.sharded_optimizer import PlayedShardedOptimizer
from commpress.frontends.sharded_optimizer import ShardedOptimizer, norm_of_parts, step_together
from commpress.parallel.expert import split_experts
from commpress.parallel.mesh import MeshShape, build_mesh
from commpress.parallel.pipeline import GPipe, PlayedP2P, ProcessP2P, Stage
from commpress.parallel.tensor import codec_states, load_codec_states, tp_norm_weights
from commpress.policy import Policy
from commpress.train.config import TrainConfig
from commpress.train.ddp_engine import DDPEngine, PlayedSites
from commpress.validate import InputError

COUNTERS = ("wire_bytes", "raw_bytes", "elements")
FrontEnd = ShardedOptimizer | PlayedShardedOptimizer | DDPEngine | PlayedSites


def hold(cfg: TrainConfig, played: bool, tp_group: dist.ProcessGroup | None,
         dp_per_node: int) -> RealRank | PlayedReplica:
    """This process's holder: a played replica, or the real rank it is."""
    if played:
        return PlayedReplica(cfg, tp_group, dp_per_node)
    return RealRank(cfg, dp_per_node)


class RealRank:
    """One stage of one data-parallel rank; collectives on the mesh's process groups."""

    mode = "train"  # the run directory's config.json key

    def __init__(self, cfg: TrainConfig, dp_per_node: int) -> None:
        self.cfg, self.dp_per_node = cfg, dp_per_node
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = build_mesh(MeshShape(cfg.dp, cfg.tp, cfg.pp, cfg.ep))
        self.tp_group, self.tp_idx = self.mesh.tp_group, self.mesh.tp_idx
        self.ep_group, self.topology = self.mesh.ep_group, Topology(dp_per_node)
        self.dp_ranks, self.stage_indices = [self.mesh.dp_idx], [self.mesh.pp_idx]
        self.dp_group, self.save_group = self.mesh.dp_group, dist.group.WORLD
        self.site_group = None  # --outer: DDP inside this rank's node, DiLoCo across nodes

    def front_ends(self, stages: list[Stage], policy: Policy) -> list[FrontEnd]:
        cfg, topology = self.cfg, self.topology
        if cfg.engine == "ddp":
            outer = outer_options(cfg, self.dp_per_node)
            if outer:
                self.site_group = site_group(self.dp_per_node)
            return [DDPEngine(stages[0], self.site_group or self.dp_group, policy,
                              cfg.ddp_hook, topology, cfg.lr, cfg.weight_decay,
                              cfg.max_grad_norm, cfg.nonfinite, outer=outer,
                              outer_group=self.dp_group)]
        options = dict(topology=topology, bucket_numel=cfg.bucket_numel,
                       max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite,
                       norm_group=dist.group.WORLD, init_sync="verify", decay_1d=False,
                       lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        if self.ep_group is None:
            return [ShardedOptimizer(stages[0], torch.optim.AdamW, policy, group=self.dp_group,
                                     norm_weights=tp_norm_weights(stages[0], cfg.tp),
                                     **options)]
        # expert parallelism: the dense weights over the data-parallel group, each rank's
        # experts over the ranks holding the same ones; one norm over both (step_together)
        dense, experts = split_experts(stages[0])
        return [ShardedOptimizer(dense, torch.optim.AdamW, policy, group=self.dp_group,
                                 **options),
                ShardedOptimizer(experts, torch.optim.AdamW, policy,
                                 group=self.mesh.edp_group, **options)]

    def p2p(self, policy: Policy, dp_rank: int) -> ProcessP2P:
        return ProcessP2P(self.mesh, policy)

    def pipeline_pass(self, pipeline: GPipe, opts: list[FrontEnd], x: torch.Tensor,
                      y: torch.Tensor) -> float:
        # the optimizers' gradient hooks reduce after the last micro-batch only
        return pipeline.step(x, y, sync_ctx=lambda: no_sync(opts))

    def hand_over(self, opts: list[FrontEnd], dp_rank: int) -> None:
        """A rank's gradients are in its front-end's hooks already."""

    def update(self, opts: list[FrontEnd]) -> None:
        if self.cfg.engine == "ddp":
            opts[0].step()
            return
        step_together(opts)
        for opt in opts:
            opt.zero_grad()

    def rank_codecs(self, i: int, stages: list[Stage]):
        return nullcontext()  # a real rank's layers hold its own codec state

    # -- checkpoint layout: one rank's values ---------------------------------------
    def layout(self, values: list) -> Any:
        return values[0]

    def unlayout(self, value: Any) -> list:
        return [value]

    def held_state(self, stages: list[dict], opts: list[dict]) -> dict[str, Any]:
        # with expert parallelism a second optimizer holds the experts
        return {"model": stages[0], "optimizer": opts[0],
                **({"expert_optimizer": opts[1]} if len(opts) > 1 else {})}

    def held_from(self, state: dict[str, Any]) -> tuple[list[dict], list[dict]]:
        return [state["model"]], [state["optimizer"], *(
            [state["expert_optimizer"]] if "expert_optimizer" in state else [])]

    def tp_codec_state(self, stages: list[Stage]) -> Any:
        return codec_states(stages[0])

    def load_tp_codec_state(self, stages: list[Stage], state: Any) -> None:
        load_codec_states(stages[0], state)

    def identity(self) -> dict[str, Any]:
        return {}

    # -- counters --------------------------------------------------------------------
    def wire_bytes(self) -> dict[str, float]:
        """This rank's bytes sent so far, by label."""
        return {k: v.get("wire_bytes", 0) for k, v in stats().items()}

    def totals(self) -> dict[str, dict[str, float]]:
        """Every rank's counters, summed (collective over the processes of a run)."""
        return summed_counters(stats())

    def release(self, opts: list[FrontEnd]) -> None:
        """The process groups and the DDP hook's thread, after the last collective
        (``compare`` runs one policy after another in one process)."""
        if self.cfg.engine == "ddp":
            opts[0].remove()
            if self.site_group is not None:
                release(self.site_group)
        else:  # the parameters' hooks would keep the optimizer and its dp group alive
            for opt in opts:
                opt.remove()
        self.mesh.release()


class PlayedReplica:
    """Every stage of every data-parallel rank of one tensor-parallel slice, played."""

    mode = "simulate"

    def __init__(self, cfg: TrainConfig, tp_group: dist.ProcessGroup | None,
                 dp_per_node: int) -> None:
        if cfg.tp > 1 and (tp_group is None or dist.get_world_size(tp_group) != cfg.tp):
            raise InputError(f"tp={cfg.tp} needs a process group of {cfg.tp} ranks, one "
                             "per tensor-parallel slice; allowed: as simulate() starts them")
        self.cfg, self.dp_per_node = cfg, dp_per_node
        self.tp_group = tp_group if cfg.tp > 1 else None
        self.tp_idx = dist.get_rank(tp_group) if cfg.tp > 1 else 0
        if cfg.policy_object().fallback != "off":
            raise InputError("fallback=measured times the collectives on the live links, and "
                             "simulate plays its ranks in one process; allowed in simulate: "
                             "fallback off (commpress train --fallback measured measures)")
        if cfg.policy_object().guard is not None:
            raise InputError("guard: the convergence guard sums every rank's signals over "
                             "real ranks, and simulate does not play it yet; allowed in "
                             "simulate: no guard (commpress train --guard …)")
        if cfg.ep > 1:
            raise InputError(f"ep={cfg.ep}: simulate plays the ranks one after another, and "
                             "expert parallelism exchanges tokens between ranks at once; "
                             "allowed: ep=1 in simulate (every expert on each played rank), "
                             "or commpress train --ep")
        self.dp_ranks, self.stage_indices = list(range(cfg.dp)), list(range(cfg.pp))
        self.dp_group = self.ep_group = None
        self.topology = None
        self.rank, self.world = self.tp_idx, cfg.tp  # one checkpoint file per slice
        self.save_group = self.tp_group
        self.stats = Stats()  # the bytes every played rank sends, summed over the ranks
        self.tp_states: list | None = None  # with tp > 1: each rank's tensor-parallel codecs
        self.sites: PlayedSites | None = None  # --outer: every site's weights, in turn

    def front_ends(self, stages: list[Stage], policy: Policy) -> list[FrontEnd]:
        cfg = self.cfg
        outer = outer_options(cfg, self.dp_per_node) if cfg.engine == "ddp" else None
        if outer:
            self.sites = PlayedSites(stages[0], policy, sites=cfg.dp // self.dp_per_node,
                                     ranks_per_site=self.dp_per_node, stats=self.stats,
                                     lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite,
                                     outer=outer)
            return [self.sites]
        if cfg.engine == "ddp":
            hook = PlayedDDPHook(stages[0], policy, ranks=cfg.dp,
                                 ranks_per_node=self.dp_per_node, stats=self.stats)
            fronts: list[FrontEnd] = [DDPEngine(
                stages[0], None, policy, cfg.ddp_hook, Topology(self.dp_per_node), cfg.lr,
                cfg.weight_decay, cfg.max_grad_norm, cfg.nonfinite, played=hook)]
        else:
            fronts = [PlayedShardedOptimizer(
                stage, torch.optim.AdamW, policy, ranks=cfg.dp,
                ranks_per_node=self.dp_per_node, bucket_numel=cfg.bucket_numel,
                max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite, stats=self.stats,
                norm_weights=tp_norm_weights(stage, cfg.tp), lr=cfg.lr, betas=(0.9, 0.95),
                weight_decay=cfg.weight_decay) for stage in stages]
        if cfg.tp > 1:
            self.tp_states = [[copy.deepcopy(codec_states(st)) for st in stages]
                              for _ in self.dp_ranks]
        return fronts

    def p2p(self, policy: Policy, dp_rank: int) -> PlayedP2P:
        return PlayedP2P(policy, MeshShape(self.cfg.dp, self.cfg.tp, self.cfg.pp), dp_rank,
                         self.tp_idx, self.stats)

    def pipeline_pass(self, pipeline: GPipe, opts: list[FrontEnd], x: torch.Tensor,
                      y: torch.Tensor) -> float:
        # the played optimizer's fp32 buffer adds micro-batches as the real one's
        # gradient hooks do
        return pipeline.step(x, y, after_backward=lambda j: opts[j].accumulate())

    def hand_over(self, opts: list[FrontEnd], dp_rank: int) -> None:
        """Rank ``dp_rank``'s gradients into the played collectives."""
        for opt in opts:
            opt.take(dp_rank)

    def update(self, opts: list[FrontEnd]) -> None:
        if self.cfg.engine == "ddp":
            opts[0].step()
            return
        # one gradient norm over every rank of every stage and tensor-parallel slice, parts
        # added in global rank order (as the real optimizers' norm over the world)
        cfg = self.cfg
        parts = torch.stack([torch.stack(opt.reduce()) for opt in opts])  # (pp, dp)
        every = parts[None]
        if cfg.tp > 1:
            every = parts.new_empty(cfg.tp * parts.numel())
            all_gather_single(every, parts.reshape(-1), self.tp_group)
            every = every.view(cfg.tp, *parts.shape)  # (tp, pp, dp)
        norm = norm_of_parts(torch.stack([every[t, s, d] for d in range(cfg.dp)
                                          for s in range(cfg.pp) for t in range(cfg.tp)]))
        for opt in opts:
            opt.update(norm)

    @contextmanager
    def rank_codecs(self, i: int, stages: list[Stage]) -> Iterator[None]:
        """With ``tp > 1``: the ``i``-th played rank's tensor-parallel codec states in the
        layers for the block (stochastic counters and error-feedback memory are each
        rank's own); with ``--outer``, the weights of the rank's site."""
        if self.sites is not None:
            with self.sites.held(self.sites.site_of(i)):
                yield
            return
        if self.tp_states is None:
            yield
            return
        for stage, states in zip(stages, self.tp_states[i]):
            load_codec_states(stage, states)
        yield
        self.tp_states[i] = [copy.deepcopy(codec_states(st)) for st in stages]

    # -- checkpoint layout: every played rank's values ------------------------------
    def layout(self, values: list) -> Any:
        return values

    def unlayout(self, value: Any) -> list:
        return value

    def held_state(self, stages: list[dict], opts: list[dict]) -> dict[str, Any]:
        return {"stages": stages, "optimizers": opts}

    def held_from(self, state: dict[str, Any]) -> tuple[list[dict], list[dict]]:
        return state["stages"], state["optimizers"]

    def tp_codec_state(self, stages: list[Stage]) -> Any:
        return self.tp_states

    def load_tp_codec_state(self, stages: list[Stage], state: Any) -> None:
        self.tp_states = state

    def identity(self) -> dict[str, Any]:
        return {"simulate": True}  # every rank's state, not one rank's: another run's

    # -- counters --------------------------------------------------------------------
    def wire_bytes(self) -> dict[str, float]:
        return {}  # a played run records no bytes per step

    def totals(self) -> dict[str, dict[str, float]]:
        if self.cfg.tp == 1:
            return self.stats.snapshot()
        # the slices' played bytes and their layers' real tensor-parallel all-reduces
        mine = Stats()
        mine.add(self.stats.snapshot())
        mine.add(stats())
        return summed_counters(mine.snapshot())

    def release(self, opts: list[FrontEnd]) -> None:
        """Nothing: a played replica holds no process group of its own."""


@contextmanager
def no_sync(opts: list[FrontEnd]) -> Iterator[None]:
    """Every front-end's ``no_sync`` for the block (micro-batches before the last)."""
    with ExitStack() as stack:
        for opt in opts:
            stack.enter_context(opt.no_sync())
        yield


def outer_options(cfg: TrainConfig, ranks_per_site: int) -> dict | None:
    """``--outer``'s DiLoCo arguments (None without it), for sites of ``ranks_per_site``
    data-parallel ranks: one node each."""
    if cfg.outer == "none":
        return None
    if cfg.dp // ranks_per_site < 2:
        raise InputError(
            f"outer={cfg.outer!r} runs DiLoCo across nodes, and the {cfg.dp} "
            f"data-parallel ranks here are one node of {ranks_per_site} "
            "(ranks_per_node, else the launcher's LOCAL_WORLD_SIZE): DDP keeps them "
            "identical, so DiLoCo would send the whole model between identical "
            "replicas; allowed: 2 or more nodes (ranks_per_node=1: one rank per site)")
    return cfg.diloco_options()


def site_group(ranks_per_site: int) -> dist.ProcessGroup:
    """This rank's site: the group of the ``ranks_per_site`` consecutive ranks of its node
    (collective: every rank makes every site's group, in order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, ranks_per_site):
        group = dist.new_group(list(range(start, start + ranks_per_site)),
                               timeout=group_timeout())
        if start <= rank < start + ranks_per_site:
            mine = group
    return mine


def summed_counters(counters: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per-label wire/raw bytes and elements of ``counters`` (this rank's), summed over
    all ranks in rank order: every label some rank sent bytes under, whichever it is."""
    mine = {label: {c: float(v.get(c, 0)) for c in COUNTERS} for label, v in counters.items()}
    total: dict[str, dict[str, float]] = {}
    for theirs in all_gather_objects(mine, None, "stats totals"):
        for label, values in theirs.items():
            row = total.setdefault(label, dict.fromkeys(COUNTERS, 0.0))
            for c in COUNTERS:
                row[c] += values[c]
    return {label: row for label, row in sorted(total.items()) if row["wire_bytes"] > 0}
