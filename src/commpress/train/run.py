"""One training run, real or played: the object both ``commpress train`` and
``commpress simulate`` step, evaluate, save and load, and the loop that drives it.

What differs between a real rank and a played replica — groups, data-parallel
front-ends, a rank's pass, the update, the checkpoint layout, the byte counters — is the
holder's (:mod:`commpress.train.holding`), decided once. Everything else — the model from
the seed, the stages, the batches, the GPipe schedule, DDP's micro-batches, the
learning-rate schedule, evaluation, the step records, the outputs — is this module's,
once, for both.

Per step, for each data-parallel rank this process holds:

1. take the rank's rows of the global batch, a function of (seed, step);
2. run its forward and backward (GPipe over the stages held, or DDP's micro-batches);
3. hand its gradients over (played: to the played collectives);

then the front-ends update and the learning-rate schedule moves on.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from commpress.collectives import reset_stats
from commpress.collectives.topology import Topology
from commpress.files import write_json
from commpress.model.gpt import GPT, config_from_preset
from commpress.parallel.expert import apply_ep
from commpress.parallel.pipeline import GPipe, Stage
from commpress.parallel.tensor import apply_tp
from commpress.policy import Policy
from commpress.train import checkpoint
from commpress.train.config import DTYPES, TrainConfig
from commpress.train.data import TextData, load_tokens
from commpress.train.holding import hold


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
                 device: torch.device, ep_group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None) -> list[Stage]:
    """The pipeline stages ``indices`` of the model every rank builds from the seed, in
    the run's dtype on ``device``, their blocks split across ``tp_group`` and their
    experts across ``ep_group``."""
    torch.manual_seed(cfg.seed)
    model = GPT(config_from_preset(cfg.model, vocab_size=max(256, vocab_size)))
    stages = [Stage(model, s, cfg.pp).to(device, DTYPES[cfg.dtype]) for s in indices]
    for stage in stages:
        apply_tp(stage.blocks, tp_group, policy)
        if ep_group is not None:
            apply_ep(stage.blocks, ep_group, policy, topology)
    return stages


class Run:
    """Everything a process holds during a run, real or played: the model's stages, the
    data, the pipelines, the learning-rate schedule, the history; the parts that differ
    are its holder's (:mod:`commpress.train.holding`).

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
        self.cfg = cfg
        self.policy = cfg.policy_object()
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if cfg.device == "cuda" else torch.device("cpu"))
        self.data = TextData(load_tokens(cfg.data, cfg.max_data_bytes))
        self.data.check_seq_len(cfg.seq_len)
        self.ranks_per_node = cfg.node_size(local_world)
        # Step 1: which ranks this process is (or plays), and its groups
        self.held = hold(cfg, played, tp_group, cfg.dp_ranks_per_node(local_world))
        # Step 2: the stages held, their blocks split across TP
        self.stages = build_stages(cfg, self.data.vocab_size, self.held.stage_indices,
                                   self.held.tp_group, self.policy, self.device,
                                   self.held.ep_group, self.held.topology)
        self.stage = self.stages[0]
        # Step 3: the data-parallel front-end of each stage held
        self.opts = self.held.front_ends(self.stages, self.policy)
        # Step 4: each held data-parallel rank's pipeline (its own pp codecs)
        self.pipelines = [GPipe(self.stages, cfg.micro_batches, self.held.p2p(self.policy, r))
                          for r in self.held.dp_ranks]
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
        if self.held.dp_group is not None:
            dist.all_reduce(t, group=self.held.dp_group)
        return t.item() / self.cfg.dp

    # -- steps -----------------------------------------------------------------------
    def lr_schedules_at(self, step: int) -> list[LambdaLR]:
        """torch's ``LambdaLR`` over :func:`lr_factor` of each front-end's optimizer, at
        ``step``: a resumed run recomputes it from the step (it needs no checkpoint)."""
        out = []
        for opt in self.opts:
            for g in opt.optimizer.param_groups:
                g["initial_lr"] = self.cfg.lr
            out.append(LambdaLR(opt.optimizer, lambda i: lr_factor(self.cfg, i),
                                last_epoch=step - 1))
        return out

    def forward_backward(self, i: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """The ``i``-th held data-parallel rank's forward and backward; its loss."""
        if self.cfg.engine == "ddp":
            return self.opts[0].forward_backward(x, y, self.cfg.micro_batches)
        return self.held.pipeline_pass(self.pipelines[i], self.opts, x, y)

    def train_step(self, step: int) -> float:
        total = 0.0
        for i, rank in enumerate(self.held.dp_ranks):
            x, y = self.batch("train", step, rank)
            with self.held.rank_codecs(i, self.stages):
                total += self.forward_backward(i, x, y)
            self.held.hand_over(self.opts, rank)
        self.held.update(self.opts)
        for schedule in self.lr_schedules:
            schedule.step()
        return self.dp_mean(total)

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
            for i, rank in enumerate(self.held.dp_ranks):
                with self.held.rank_codecs(i, self.stages):
                    losses = [self.pipelines[i].step(*self.batch("val", b, rank), train=False)
                              for b in range(self.cfg.eval_batches)]
                total += sum(losses) / len(losses)
        finally:
            for stage in self.stages:
                stage.train()
            self.load_codec_state(kept)
        return self.dp_mean(total)

    # -- checkpoints -------------------------------------------------------------------
    def codec_state(self) -> dict[str, Any]:
        """The tensor- and pipeline-parallel codecs' state of every held rank (the
        data-parallel ones are the front-ends')."""
        pp = [p.p2p.state_dict() for p in self.pipelines]
        return {"tp_codecs": self.held.tp_codec_state(self.stages),
                "pp_codecs": {kind: self.held.layout([s[kind] for s in pp])
                              for kind in ("act", "act_grad")}}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        saved = {kind: self.held.unlayout(v) for kind, v in state["pp_codecs"].items()}
        for i, p in enumerate(self.pipelines):
            p.p2p.load_state_dict({kind: saved[kind][i] for kind in ("act", "act_grad")})
        self.held.load_tp_codec_state(self.stages, state["tp_codecs"])

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it."""
        cfg = self.cfg
        return {"world": self.held.world, "model": cfg.model, "dp": cfg.dp, "tp": cfg.tp,
                "pp": cfg.pp, **({"ep": cfg.ep} if cfg.ep > 1 else {}),
                "policy": self.policy.to_dict(), "dtype": cfg.dtype,
                "ranks_per_node": self.ranks_per_node, "seed": cfg.seed,
                "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                "micro_batches": cfg.micro_batches, "bucket_numel": cfg.bucket_numel,
                "engine": cfg.engine, "ddp_hook": cfg.ddp_hook, "data": self.data.fingerprint(),
                **({"outer": cfg.diloco_options()} if cfg.outer != "none" else {}),
                **self.held.identity()}

    def state_dict(self, step: int) -> dict[str, Any]:
        held = self.held.held_state([st.state_dict() for st in self.stages],
                                    [opt.state_dict() for opt in self.opts])
        return {"format": checkpoint.FORMAT, "step": step, "rank": self.held.rank,
                "config": self.cfg.to_dict(), **held, **self.codec_state(),
                "history": self.history}

    def save(self, step: int) -> None:
        checkpoint.save_step(self.cfg.out, step, self.held.rank, self.state_dict(step),
                             self.identity(), self.held.save_group)

    def load(self, path: str) -> None:
        """Resume from ``path``; every process verifies its file, and all refuse together."""
        state = checkpoint.load_agreed(path, self.identity(), self.held.rank,
                                       self.held.save_group)
        stages, opts = self.held.held_from(state)
        for stage, s in zip(self.stages, stages, strict=True):
            stage.load_state_dict(s)
        for opt, s in zip(self.opts, opts, strict=True):
            opt.load_state_dict(s)
        self.load_codec_state(state)
        self.start_step = state["step"]
        self.lr_schedules = self.lr_schedules_at(self.start_step)
        self.history = list(state["history"])

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """With a measured fallback: the buckets of this process's front-ends by the way
        each collective went (played front-ends measure nothing: empty)."""
        out: dict[str, dict[str, int]] = {}
        for opt in self.opts:
            for what, row in opt.fallback_decisions().items():
                total = out.setdefault(what, dict.fromkeys(row, 0))
                for way, n in row.items():
                    total[way] += n
        return out

    def release(self) -> None:
        """The process groups and hooks a real run holds, after its last collective."""
        self.held.release(self.opts)


def run_steps(run: Run, writer: bool) -> dict[str, Any] | None:
    """The steps, evaluations and checkpoints of ``run`` from its start (or checkpoint);
    the ``writer`` writes the run directory and returns the summary."""
    from commpress.train.report import TensorBoardLog, TrainProgress

    cfg = run.cfg
    if writer:  # before anyone saves: a killed run's half-written files go
        checkpoint.remove_stale_temporaries(cfg.out)
    if cfg.resume:
        run.load(cfg.resume)
    reset_stats()  # a run counts its own bytes (compare runs several in one process)
    if writer:
        os.makedirs(cfg.out, exist_ok=True)
        write_json(os.path.join(cfg.out, "config.json"),
                   {run.held.mode: cfg.to_dict(),
                    "policy": run.policy.to_dict()})
    progress = TrainProgress(cfg.steps) if writer and cfg.progress else None
    board = (TensorBoardLog(os.path.join(cfg.out, "tensorboard"), run.start_step + 1)
             if writer and cfg.tensorboard else None)
    wall0 = time.perf_counter() - (run.history[-1]["wall_s"] if run.history else 0.0)
    try:
        for step in range(run.start_step, cfg.steps):
            before = run.held.wire_bytes()
            t0 = time.perf_counter()
            loss = run.train_step(step)
            record = step_record(cfg, step, loss, time.perf_counter() - t0,
                                 time.perf_counter() - wall0, run.skipped_steps,
                                 {k: v - before.get(k, 0)
                                  for k, v in run.held.wire_bytes().items()})
            sampled = [r for opt in run.opts for g in guards(opt) for r in g.take_records()]
            if sampled:  # the convergence guard's signals and promotions of this step
                record["guard"] = sampled
            if evaluates_at(cfg, step):
                record["val_loss"] = run.evaluate()
            run.history.append(record)
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0
                                         or step + 1 == cfg.steps):
                run.save(step + 1)
            if progress is not None:
                progress.update(record)
            if board is not None:
                board.write(record)
    finally:
        if progress is not None:
            progress.close()
        if board is not None:
            board.close()
    totals = run.held.totals()
    return write_outputs(cfg, run, totals) if writer else None


def step_record(cfg: TrainConfig, step: int, loss: float, seconds: float, wall_s: float,
                skipped: int, wire_bytes: dict[str, float]) -> dict[str, Any]:
    """One line of ``metrics.jsonl``."""
    return {"step": step + 1, "loss": loss, "lr": lr_at(cfg, step), "step_time_s": seconds,
            "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds, "wall_s": wall_s,
            "wire_bytes_rank0": wire_bytes, "skipped": skipped}


def guards(front_end: Any) -> list[Any]:
    """The convergence guards a front-end holds: its ``guards`` (the DDP engine: its
    hook's and DiLoCo's), else its ``guard`` (the sharded optimizer's), if on."""
    held = getattr(front_end, "guards", None)
    if held is not None:
        return list(held)
    guard = getattr(front_end, "guard", None)
    return [] if guard is None else [guard]


def evaluates_at(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (0-based) ends with a validation evaluation."""
    return bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps


def write_outputs(cfg: TrainConfig, run: Run, totals: dict) -> dict[str, Any]:
    """``metrics.jsonl``, ``summary.json``, ``loss.png`` and, with the convergence guard,
    ``guard.png`` of ``run``; the summary."""
    from commpress.train.report import plot_guard, plot_loss

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
        "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "ep": cfg.ep,
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
        # fallback: measured — this rank's buckets by the way each collective went
        "fallback": run.fallback_decisions(),
        # the convergence guard's promotions, all front-ends (each in metrics.jsonl)
        "guard_promotions": sum(len(g["promoted"]) for r in hist for g in r.get("guard", [])),
        "out": cfg.out,
    }
    write_json(os.path.join(cfg.out, "summary.json"), summary)
    plot_loss(hist, os.path.join(cfg.out, "loss.png"), title=f"{name} "
              f"dp{cfg.dp}×tp{cfg.tp}×pp{cfg.pp}")
    guard = run.policy.guard
    plot_guard(hist, os.path.join(cfg.out, "guard.png"), title=name, budgets=None if guard is
               None else {"rel_error": guard.max_rel_error,
                          "memory_ratio": guard.max_memory_ratio,
                          "weight_gap": guard.max_weight_gap})
    return summary
