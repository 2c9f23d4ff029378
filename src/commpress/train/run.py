"""One training run, real or played: the object both ``commpress train`` and
``commpress simulate`` step, evaluate, save and load, and the loop that drives it.

A real rank (``played=False``) holds one pipeline stage of one data-parallel rank; its
optimizer is :class:`~commpress.ShardedOptimizer` (or torch DDP) over the mesh's groups,
its pipeline moves tensors between processes. A played run (``played=True``) holds every
stage of every data-parallel rank of one tensor-parallel slice — one replica, since the
replicas are bitwise identical — and runs each rank's pass in turn, its collectives
played in-process by :class:`PlayedShardedOptimizer` or :class:`PlayedDDPHook`, its
pipeline transfers by :class:`~commpress.parallel.pipeline.PlayedP2P`. Everything else —
the model from the seed, the stages, the batches, the GPipe schedule, DDP's
micro-batches, the learning-rate schedule, evaluation, the step records, the outputs —
is this module's, once, for both.

Per step, for each data-parallel rank this process holds:

1. take the rank's rows of the global batch, a function of (seed, step);
2. run its forward and backward (GPipe over the stages held, or DDP's micro-batches);
3. played: hand its gradients to the played collectives;

then the optimizer steps (played: one gradient norm over every rank of every stage and
slice, parts in global rank order) and the learning-rate schedule moves on.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from commpress.collectives import reset_stats, stats
from commpress.collectives.agreement import all_gather_objects, release
from commpress.collectives.byte_stats import Stats
from commpress.collectives.comm import all_gather_single, group_timeout
from commpress.collectives.topology import Topology
from commpress.files import write_json
from commpress.integrations.played_ddp import PlayedDDPHook
from commpress.integrations.played_optimizer import PlayedShardedOptimizer
from commpress.integrations.sharded_optimizer import ShardedOptimizer, norm_of_parts
from commpress.model.gpt import GPT, config_from_preset
from commpress.parallel.mesh import MeshShape, build_mesh
from commpress.parallel.pipeline import GPipe, PlayedP2P, ProcessP2P, Stage
from commpress.parallel.tensor import (
    apply_tp,
    codec_states,
    load_codec_states,
    tp_norm_weights,
)
from commpress.policy import Policy
from commpress.train import checkpoint
from commpress.train.config import DTYPES, TrainConfig
from commpress.train.data import TextData, load_tokens
from commpress.train.ddp_engine import DDPEngine
from commpress.validate import InputError

COUNTERS = ("wire_bytes", "raw_bytes", "elements")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``lr · min_lr_ratio``: ``lr · lr_factor``, the
    same product (same bits) as the trainer's ``LambdaLR``."""
    return cfg.lr * lr_factor(cfg, step)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The multiplier of ``cfg.lr`` at ``step`` (0-based)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def build_stages(cfg: TrainConfig, vocab_size: int, indices: list[int],
                 tp_group: dist.ProcessGroup | None, policy: Policy,
                 device: torch.device) -> list[Stage]:
    """The pipeline stages ``indices`` of the model every rank builds from the seed, in
    the run's dtype on ``device``, their blocks split across ``tp_group``."""
    torch.manual_seed(cfg.seed)
    model = GPT(config_from_preset(cfg.model, vocab_size=max(256, vocab_size)))
    stages = [Stage(model, s, cfg.pp).to(device, DTYPES[cfg.dtype]) for s in indices]
    for stage in stages:
        apply_tp(stage.blocks, tp_group, policy)
    return stages


class Run:
    """Everything a process holds during a run: a real rank's, or a played replica's.

    Args:
        cfg: the resolved configuration.
        played: play every data-parallel rank and stage in this process.
        tp_group: played with ``tp > 1``: the group of the ``tp`` slices' processes.
        local_world: real, under a launcher: its LOCAL_WORLD_SIZE (the node size
            unless ``cfg.ranks_per_node`` says otherwise).
    """

    def __init__(self, cfg: TrainConfig, played: bool = False,
                 tp_group: dist.ProcessGroup | None = None,
                 local_world: int | None = None) -> None:
        self.cfg, self.played = cfg, played
        self.policy = Policy.resolve(cfg.policy)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if cfg.device == "cuda" else torch.device("cpu"))
        self.data = TextData(load_tokens(cfg.data, cfg.max_data_bytes))
        self.data.check_seq_len(cfg.seq_len)
        self.ranks_per_node = cfg.node_size(local_world)
        dp_per_node = cfg.dp_ranks_per_node(local_world)
        self.shape = MeshShape(cfg.dp, cfg.tp, cfg.pp)
        # Step 1: which ranks this process is (or plays), and its groups
        if played:
            if cfg.tp > 1 and (tp_group is None or dist.get_world_size(tp_group) != cfg.tp):
                raise InputError(f"tp={cfg.tp} needs a process group of {cfg.tp} ranks, one "
                                 "per tensor-parallel slice; allowed: as simulate() starts them")
            self.tp_group = tp_group if cfg.tp > 1 else None
            self.tp_idx = dist.get_rank(tp_group) if cfg.tp > 1 else 0
            self.dp_ranks, stage_indices = list(range(cfg.dp)), list(range(cfg.pp))
            self.dp_group = None
            self.rank, self.world = self.tp_idx, cfg.tp  # one checkpoint file per slice
            self.save_group = self.tp_group
        else:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.mesh = build_mesh(self.shape)
            self.tp_group, self.tp_idx = self.mesh.tp_group, self.mesh.tp_idx
            self.dp_ranks, stage_indices = [self.mesh.dp_idx], [self.mesh.pp_idx]
            self.dp_group, self.save_group = self.mesh.dp_group, dist.group.WORLD
        # Step 2: the stages held, their blocks split across TP
        self.stages = build_stages(cfg, self.data.vocab_size, stage_indices, self.tp_group,
                                   self.policy, self.device)
        self.stage = self.stages[0]
        # Step 3: the data-parallel optimizer of each stage held
        self.stats = Stats()  # played: the bytes every rank sends, summed over the ranks
        topology = Topology(dp_per_node)
        self.site_group = None  # --outer: DDP inside this rank's node, DiLoCo across nodes
        if cfg.engine == "ddp":
            hook = (PlayedDDPHook(self.stage, self.policy, ranks=cfg.dp,
                                  ranks_per_node=dp_per_node, stats=self.stats)
                    if played else None)
            outer = cfg.diloco_options() if cfg.outer != "none" else None
            if outer and played:
                raise InputError(f"outer={cfg.outer!r}: simulate does not play DiLoCo; "
                                 "allowed: commpress train --outer …")
            if outer:
                self.site_group = site_group(dp_per_node)
            self.opts: list[Any] = [DDPEngine(self.stage, self.site_group or self.dp_group,
                                              self.policy, cfg.ddp_hook, topology, cfg.lr,
                                              cfg.weight_decay, cfg.max_grad_norm,
                                              cfg.nonfinite, played=hook, outer=outer,
                                              outer_group=self.dp_group)]
        elif played:
            self.opts = [PlayedShardedOptimizer(
                stage, torch.optim.AdamW, self.policy, ranks=cfg.dp, ranks_per_node=dp_per_node,
                bucket_numel=cfg.bucket_numel, max_grad_norm=cfg.max_grad_norm,
                nonfinite=cfg.nonfinite, stats=self.stats,
                norm_weights=tp_norm_weights(stage, cfg.tp), lr=cfg.lr, betas=(0.9, 0.95),
                weight_decay=cfg.weight_decay) for stage in self.stages]
        else:
            self.opts = [ShardedOptimizer(
                self.stage, torch.optim.AdamW, self.policy, group=self.dp_group,
                topology=topology, bucket_numel=cfg.bucket_numel,
                max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite,
                norm_group=dist.group.WORLD, norm_weights=tp_norm_weights(self.stage, cfg.tp),
                init_sync="verify", decay_1d=False, lr=cfg.lr, betas=(0.9, 0.95),
                weight_decay=cfg.weight_decay)]
        # Step 4: each held data-parallel rank's pipeline (its own pp codecs) and, played
        # with tp > 1, its own state of the tensor-parallel codecs
        self.pipelines = [GPipe(self.stages, cfg.micro_batches,
                                PlayedP2P(self.policy, self.shape, r, self.tp_idx, self.stats)
                                if played else ProcessP2P(self.mesh, self.policy))
                          for r in self.dp_ranks]
        self.tp_states = ([[copy.deepcopy(codec_states(st)) for st in self.stages]
                           for _ in self.dp_ranks] if played and cfg.tp > 1 else None)
        self.start_step = 0
        self.lr_schedules = self.lr_schedules_at(0)
        self.history: list[dict[str, Any]] = []

    @property
    def skipped_steps(self) -> int:
        return self.opts[0].skipped_steps

    # -- data ------------------------------------------------------------------------
    def batch(self, split: str, step: int, dp_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Data-parallel rank ``dp_idx``'s rows of the global batch of ``step``."""
        cfg = self.cfg
        x, y = self.data.batch(split, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        per = cfg.batch_size // cfg.dp
        rows = slice(dp_idx * per, (dp_idx + 1) * per)
        return x[rows].to(self.device), y[rows].to(self.device)

    def dp_mean(self, total: float) -> float:
        """The mean over every data-parallel rank of values summing to ``total`` here."""
        t = torch.tensor([total], dtype=torch.float64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(t, group=self.dp_group)
        return t.item() / self.cfg.dp

    @contextmanager
    def rank_codecs(self, i: int) -> Iterator[None]:
        """Played with ``tp > 1``: the ``i``-th held rank's tensor-parallel codec states in
        the layers for the block (stochastic counters and error-feedback memory are each
        rank's own)."""
        if self.tp_states is None:
            yield
            return
        for stage, states in zip(self.stages, self.tp_states[i]):
            load_codec_states(stage, states)
        yield
        self.tp_states[i] = [copy.deepcopy(codec_states(st)) for st in self.stages]

    # -- steps -----------------------------------------------------------------------
    def lr_schedules_at(self, step: int) -> list[LambdaLR]:
        """torch's ``LambdaLR`` over :func:`lr_factor` of each held optimizer, at
        ``step``: a resumed run recomputes it from the step (it needs no checkpoint)."""
        out = []
        for opt in self.opts:
            inner = opt.opt if isinstance(opt, DDPEngine) else (
                opt.optimizer if self.played else opt)
            for g in inner.param_groups:
                g["initial_lr"] = self.cfg.lr
            out.append(LambdaLR(inner, lambda i: lr_factor(self.cfg, i), last_epoch=step - 1))
        return out

    def forward_backward(self, i: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """The ``i``-th held data-parallel rank's forward and backward; its loss."""
        opt = self.opts[0]
        if self.cfg.engine == "ddp":
            return opt.forward_backward(x, y, self.cfg.micro_batches)
        if self.played:  # the played optimizer's fp32 buffer adds micro-batches as the
            # real one's gradient hooks do
            return self.pipelines[i].step(x, y, after_backward=lambda j:
                                          self.opts[j].accumulate())
        return self.pipelines[i].step(x, y, sync_ctx=opt.no_sync)

    def train_step(self, step: int) -> float:
        total = 0.0
        for i, rank in enumerate(self.dp_ranks):
            x, y = self.batch("train", step, rank)
            with self.rank_codecs(i):
                total += self.forward_backward(i, x, y)
            if self.played:
                for opt in self.opts:
                    opt.take(rank)
        if self.played and self.cfg.engine != "ddp":
            self.played_update()
        else:
            self.opts[0].step()
            if self.cfg.engine != "ddp":
                self.opts[0].zero_grad()
        for schedule in self.lr_schedules:
            schedule.step()
        return self.dp_mean(total)

    def played_update(self) -> None:
        """The played optimizers' step: one gradient norm over every rank of every stage
        and tensor-parallel slice, parts added in global rank order (as the real
        optimizers' norm over the world)."""
        parts = torch.stack([torch.stack(opt.reduce()) for opt in self.opts])  # (pp, dp)
        every = parts[None]
        if self.cfg.tp > 1:
            every = parts.new_empty(self.cfg.tp * parts.numel())
            all_gather_single(every, parts.reshape(-1), self.tp_group)
            every = every.view(self.cfg.tp, *parts.shape)  # (tp, pp, dp)
        norm = norm_of_parts(torch.stack([every[t, s, d] for d in range(self.cfg.dp)
                                          for s in range(self.cfg.pp)
                                          for t in range(self.cfg.tp)]))
        for opt in self.opts:
            opt.update(norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        # evaluation sends activations through the same codecs: it must not move their
        # state (stochastic counters, error-feedback memory), or the training run would
        # depend on when it was evaluated
        kept = copy.deepcopy(self.codec_state())
        for stage in self.stages:
            stage.eval()
        total = 0.0
        try:
            for i, rank in enumerate(self.dp_ranks):
                with self.rank_codecs(i):
                    losses = [self.pipelines[i].step(*self.batch("val", b, rank), train=False)
                              for b in range(self.cfg.eval_batches)]
                total += sum(losses) / len(losses)
        finally:
            for stage in self.stages:
                stage.train()
            self.load_codec_state(kept)
        return self.dp_mean(total)

    # -- checkpoints -------------------------------------------------------------------
    def _held(self, values: list) -> Any:
        """A real rank's one value, a played run's list (their checkpoint layouts)."""
        return values if self.played else values[0]

    def codec_state(self) -> dict[str, Any]:
        """The tensor- and pipeline-parallel codecs' state of every held rank (the
        data-parallel ones are the optimizer's)."""
        pp = [p.p2p.state_dict() for p in self.pipelines]
        return {"tp_codecs": self.tp_states if self.played else codec_states(self.stage),
                "pp_codecs": {kind: self._held([s[kind] for s in pp])
                              for kind in ("act", "act_grad")}}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        saved = {kind: v if self.played else [v] for kind, v in state["pp_codecs"].items()}
        for i, p in enumerate(self.pipelines):
            p.p2p.load_state_dict({kind: saved[kind][i] for kind in ("act", "act_grad")})
        if self.played:
            self.tp_states = state["tp_codecs"]
        else:
            load_codec_states(self.stage, state["tp_codecs"])

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it (a played
        checkpoint holds every rank's state, a real one one rank's: other runs)."""
        cfg = self.cfg
        return {"world": self.world, "model": cfg.model, "dp": cfg.dp, "tp": cfg.tp,
                "pp": cfg.pp, "policy": self.policy.to_dict(), "dtype": cfg.dtype,
                "ranks_per_node": self.ranks_per_node, "seed": cfg.seed,
                "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                "micro_batches": cfg.micro_batches, "bucket_numel": cfg.bucket_numel,
                "engine": cfg.engine, "ddp_hook": cfg.ddp_hook, "data": self.data.fingerprint(),
                **({"outer": cfg.diloco_options()} if cfg.outer != "none" else {}),
                **({"simulate": True} if self.played else {})}

    def state_dict(self, step: int) -> dict[str, Any]:
        stages = [st.state_dict() for st in self.stages]
        opts = [opt.state_dict() for opt in self.opts]
        held = ({"stages": stages, "optimizers": opts} if self.played
                else {"model": stages[0], "optimizer": opts[0]})
        return {"format": checkpoint.FORMAT, "step": step, "rank": self.rank,
                "config": self.cfg.to_dict(), **held, **self.codec_state(),
                "history": self.history}

    def save(self, step: int) -> None:
        checkpoint.save_step(self.cfg.out, step, self.rank, self.state_dict(step),
                             self.identity(), self.save_group)

    def load(self, path: str) -> None:
        """Resume from ``path``; every process verifies its file, and all refuse together."""
        state = checkpoint.load_agreed(path, self.identity(), self.rank, self.save_group)
        stages = state["stages"] if self.played else [state["model"]]
        opts = state["optimizers"] if self.played else [state["optimizer"]]
        for stage, s in zip(self.stages, stages, strict=True):
            stage.load_state_dict(s)
        for opt, s in zip(self.opts, opts, strict=True):
            opt.load_state_dict(s)
        self.load_codec_state(state)
        self.start_step = state["step"]
        self.lr_schedules = self.lr_schedules_at(self.start_step)
        self.history = list(state["history"])

    def release(self) -> None:
        """A real run's process groups and the DDP hook's thread, after its last
        collective (``compare`` runs one policy after another in one process)."""
        if self.played:
            return
        if self.cfg.engine == "ddp":
            self.opts[0].release()
            if self.site_group is not None:
                release(self.site_group)
        else:  # the parameters' hooks would keep the optimizer and its dp group alive
            for opt in self.opts:
                opt.remove_hooks()
        self.mesh.release()

    # -- counters ----------------------------------------------------------------------
    def wire_bytes(self) -> dict[str, float]:
        """This rank's bytes sent so far, by label (a played run records none per step)."""
        return {} if self.played else {k: v.get("wire_bytes", 0) for k, v in stats().items()}

    def totals(self) -> dict[str, dict[str, float]]:
        """Every rank's counters, summed (collective over the processes of a run)."""
        if not self.played:
            return summed_counters(stats())
        if self.cfg.tp == 1:
            return self.stats.snapshot()
        # the slices' played bytes and their layers' real tensor-parallel all-reduces
        mine = Stats()
        mine.add(self.stats.snapshot())
        mine.add(stats())
        return summed_counters(mine.snapshot())


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


def run_steps(run: Run, writer: bool) -> dict[str, Any] | None:
    """The steps, evaluations and checkpoints of ``run`` from its start (or checkpoint);
    the ``writer`` writes the run directory and returns the summary."""
    from commpress.train.report import TrainProgress

    cfg = run.cfg
    if writer:  # before anyone saves: a killed run's half-written files go
        checkpoint.remove_stale_temporaries(cfg.out)
    if cfg.resume:
        run.load(cfg.resume)
    if not run.played:
        reset_stats()
    if writer:
        os.makedirs(cfg.out, exist_ok=True)
        write_json(os.path.join(cfg.out, "config.json"),
                   {"simulate" if run.played else "train": cfg.to_dict(),
                    "policy": run.policy.to_dict()})
    progress = TrainProgress(cfg.steps) if writer and cfg.progress else None
    wall0 = time.perf_counter() - (run.history[-1]["wall_s"] if run.history else 0.0)
    try:
        for step in range(run.start_step, cfg.steps):
            before = run.wire_bytes()
            t0 = time.perf_counter()
            loss = run.train_step(step)
            record = step_record(cfg, step, loss, time.perf_counter() - t0,
                                 time.perf_counter() - wall0, run.skipped_steps,
                                 {k: v - before.get(k, 0) for k, v in run.wire_bytes().items()})
            if evaluates_at(cfg, step):
                record["val_loss"] = run.evaluate()
            run.history.append(record)
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0
                                         or step + 1 == cfg.steps):
                run.save(step + 1)
            if progress is not None:
                progress.update(record)
    finally:
        if progress is not None:
            progress.close()
    totals = run.totals()
    return write_outputs(cfg, run, totals) if writer else None


def step_record(cfg: TrainConfig, step: int, loss: float, seconds: float, wall_s: float,
                skipped: int, wire_bytes: dict[str, float]) -> dict[str, Any]:
    """One line of ``metrics.jsonl``."""
    return {"step": step + 1, "loss": loss, "lr": lr_at(cfg, step), "step_time_s": seconds,
            "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds, "wall_s": wall_s,
            "wire_bytes_rank0": wire_bytes, "skipped": skipped}


def evaluates_at(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (0-based) ends with a validation evaluation."""
    return bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps


def write_outputs(cfg: TrainConfig, run: Run, totals: dict) -> dict[str, Any]:
    """``metrics.jsonl``, ``summary.json`` and ``loss.png`` of ``run``; the summary."""
    from commpress.train.report import plot_loss

    hist = run.history
    with open(os.path.join(cfg.out, "metrics.jsonl"), "w") as f:
        for r in hist:
            f.write(json.dumps(r) + "\n")
    # the first steps include warm-up of allocators and codecs: time the rest
    timed = [r["step_time_s"] for r in hist[min(3, len(hist) - 1):]] or [0.0]
    val = [r for r in hist if "val_loss" in r]
    name = run.policy.name
    if cfg.engine == "ddp":
        name = f"ddp-{cfg.ddp_hook}" + (f"-{name}" if cfg.ddp_hook == "commpress" else "")
    if cfg.outer != "none":
        name = f"{name}+{os.path.splitext(os.path.basename(cfg.outer))[0]}-H{cfg.sync_every}"
    summary = {
        "policy": name, "engine": cfg.engine, "ddp_hook": cfg.ddp_hook,
        "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
        "model": cfg.model, "params": sum(p.numel() for p in run.stage.parameters()),
        "steps": cfg.steps, "seed": cfg.seed,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "final_train_loss": hist[-1]["loss"] if hist else None,
        "unigram_entropy": run.data.unigram_entropy(),
        "step_time_s_median": statistics.median(timed),
        "tokens_per_s": cfg.batch_size * cfg.seq_len / statistics.median(timed)
        if timed[0] else None,
        "wall_s": hist[-1]["wall_s"] if hist else 0.0,
        "skipped_steps": run.skipped_steps,
        "resumed_at_step": run.start_step,
        # the history's cumulative count where this run took over
        "skipped_steps_this_run": run.skipped_steps - (hist[run.start_step - 1]["skipped"]
                                                       if run.start_step else 0),
        "wire_bytes": {k: v["wire_bytes"] for k, v in totals.items()},
        "raw_bytes": {k: v["raw_bytes"] for k, v in totals.items()},
        "bits_per_elem": {k: 8 * v["wire_bytes"] / v["elements"] for k, v in totals.items()
                          if v["elements"]},
        "out": cfg.out,
    }
    write_json(os.path.join(cfg.out, "summary.json"), summary)
    plot_loss(hist, os.path.join(cfg.out, "loss.png"), title=f"{name} "
              f"dp{cfg.dp}×tp{cfg.tp}×pp{cfg.pp}")
    return summary
