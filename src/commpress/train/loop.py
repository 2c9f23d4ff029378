"""The reference trainer: a GPT trained with dp × tp × pp parallelism and a policy.

``train(cfg)`` runs a whole job: on CPU it spawns its ranks (Gloo); under ``torchrun``
it is one of the launcher's ranks (NCCL on GPUs). Each rank, top to bottom:

1. build the mesh (TP innermost, then PP, then DP) and the same full model from the
   seed everywhere;
2. keep this rank's pipeline stage and split its blocks across the TP group;
3. wrap the stage's parameters in a :class:`~commpress.ShardedOptimizer` over the DP
   group (gradient norm over the world, replicated TP parameters counted once);
4. per step: the global batch is a function of (seed, step); this DP rank takes its
   rows; the GPipe schedule runs forward and backward; the optimizer steps;
5. evaluate, log, checkpoint; rank 0 writes metrics.jsonl, summary.json, loss.png.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from commpress.collectives import reset_stats, stats
from commpress.collectives.topology import Topology
from commpress.integrations.sharded_optimizer import ShardedOptimizer
from commpress.model.gpt import GPT, config_from_preset
from commpress.parallel.mesh import MeshShape, build_mesh
from commpress.parallel.pipeline import GPipe, Stage
from commpress.parallel.tensor import (
    apply_tp,
    codec_states,
    load_codec_states,
    tp_norm_weights,
)
from commpress.policy import Policy
from commpress.train import checkpoint, run_lock
from commpress.train.config import TrainConfig
from commpress.train.data import TextData, load_tokens
from commpress.train.ddp_engine import DDPEngine
from commpress.train.errors import RunFailedError
from commpress.train.memory import check_fits, train_needs

# one-level collectives report under the axis label, two-level ones under label.intra/.inter
AXIS_LABELS = ("dp.grad", "dp.grad.intra", "dp.grad.inter", "dp.grad.gather",
               "dp.grad.gather.intra", "dp.grad.gather.inter", "dp.param", "dp.param.intra",
               "dp.param.inter", "tp.act", "tp.act_grad", "pp.act", "pp.act_grad")
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


def summed_counters(counters: dict[str, dict[str, float]],
                    device: torch.device) -> dict[str, dict[str, float]]:
    """Per-label wire/raw bytes and elements of ``counters`` (this rank's), summed over
    all ranks."""
    s = counters
    vec = torch.tensor([float(s.get(label, {}).get(c, 0)) for label in AXIS_LABELS
                        for c in COUNTERS], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    vals = vec.view(len(AXIS_LABELS), len(COUNTERS)).tolist()
    return {label: dict(zip(COUNTERS, row)) for label, row in zip(AXIS_LABELS, vals)
            if row[0] > 0}


class _Run:
    """Everything one rank holds during a run."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.policy = Policy.resolve(cfg.policy)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if cfg.device == "cuda" else torch.device("cpu"))
        # Step 1: mesh and the full model from the seed
        self.mesh = build_mesh(MeshShape(cfg.dp, cfg.tp, cfg.pp))
        self.data = TextData(load_tokens(cfg.data, cfg.max_data_bytes))
        self.data.check_seq_len(cfg.seq_len)
        mcfg = config_from_preset(cfg.model, vocab_size=max(256, self.data.vocab_size))
        torch.manual_seed(cfg.seed)
        model = GPT(mcfg)
        # Step 2: this rank's stage, its blocks split across TP
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        self.stage = Stage(model, self.mesh.pp_idx, cfg.pp).to(self.device, dtype)
        del model
        apply_tp(self.stage.blocks, self.mesh.tp_group, self.policy)
        # Step 3: the sharded optimizer over DP
        rpn = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.ranks_per_node = rpn
        dp_per_node = max(1, rpn // (cfg.tp * cfg.pp))
        weights = tp_norm_weights(self.stage, cfg.tp)
        if cfg.engine == "ddp":
            self.ddp = DDPEngine(self.stage, self.mesh.dp_group, self.policy, cfg.ddp_hook,
                                 Topology(dp_per_node), cfg.lr, cfg.weight_decay,
                                 cfg.max_grad_norm, cfg.nonfinite)
            self.opt = self.ddp
        else:
            self.ddp = None
            self.opt = ShardedOptimizer(
                self.stage, torch.optim.AdamW, self.policy, group=self.mesh.dp_group,
                topology=Topology(dp_per_node), bucket_numel=cfg.bucket_numel,
                max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite,
                norm_group=dist.group.WORLD, norm_weights=weights, init_sync="verify",
                lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.schedule = GPipe(self.stage, self.mesh, self.policy, cfg.micro_batches)
        self.start_step = 0
        self.lr_schedule = self.lr_schedule_at(0)
        self.history: list[dict[str, Any]] = []

    @property
    def skipped_steps(self) -> int:
        return self.opt.skipped_steps

    # -- data ------------------------------------------------------------------------
    def local_batch(self, split: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = self.data.batch(split, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        per = cfg.batch_size // cfg.dp
        sl = slice(self.mesh.dp_idx * per, (self.mesh.dp_idx + 1) * per)
        return x[sl].to(self.device), y[sl].to(self.device)

    def _dp_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.mesh.dp_group is not None:
            dist.all_reduce(t, group=self.mesh.dp_group)
        return t.item() / self.cfg.dp

    # -- steps -----------------------------------------------------------------------
    def lr_schedule_at(self, step: int) -> LambdaLR:
        """torch's ``LambdaLR`` over :func:`lr_factor`, at ``step``: a resumed run
        recomputes it from the step (nothing of it needs a checkpoint)."""
        opt = self.ddp.opt if self.ddp is not None else self.opt
        for g in opt.param_groups:
            g["initial_lr"] = self.cfg.lr
        return LambdaLR(opt, lambda i: lr_factor(self.cfg, i), last_epoch=step - 1)

    def train_step(self, step: int) -> float:
        x, y = self.local_batch("train", step)
        if self.ddp is not None:
            loss = self.ddp.forward_backward(x, y, self.cfg.micro_batches)
            self.ddp.step()
        else:
            loss = self.schedule.step(x, y, sync_ctx=self.opt.no_sync, train=True)
            self.opt.step()
            self.opt.zero_grad()
        self.lr_schedule.step()
        return self._dp_mean(loss)

    @torch.no_grad()
    def evaluate(self) -> float:
        # evaluation sends activations through the same codecs: it must not move their
        # state (stochastic counters, error-feedback memory), or the training run would
        # depend on when it was evaluated
        kept = copy.deepcopy(self.codec_state())
        self.stage.eval()
        try:
            losses = [self.schedule.step(*self.local_batch("val", i), train=False)
                      for i in range(self.cfg.eval_batches)]
        finally:
            self.stage.train()
            self.load_codec_state(kept)
        return self._dp_mean(sum(losses) / len(losses))

    def codec_state(self) -> dict[str, Any]:
        """The tensor- and pipeline-parallel codecs' state (the sharded optimizer keeps
        the data-parallel ones)."""
        return {"tp_codecs": codec_states(self.stage),
                "pp_codecs": {"act": self.schedule.act_codec.state_dict(),
                              "act_grad": self.schedule.grad_codec.state_dict()}}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        load_codec_states(self.stage, state["tp_codecs"])
        self.schedule.act_codec.load_state_dict(state["pp_codecs"]["act"])
        self.schedule.grad_codec.load_state_dict(state["pp_codecs"]["act_grad"])

    # -- checkpoints -------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it."""
        return run_identity(self.cfg, self.policy, self.data, self.world, self.ranks_per_node)

    def save(self, step: int) -> None:
        state = {"format": checkpoint.FORMAT, "step": step, "rank": self.rank,
                 "config": self.cfg.to_dict(), "model": self.stage.state_dict(),
                 "optimizer": self.opt.state_dict(), **self.codec_state(),
                 "history": self.history}
        checkpoint.save_step(self.cfg.out, step, self.rank, state, self.identity(),
                             dist.group.WORLD)

    def load(self, path: str) -> None:
        """Resume from ``path``; every rank verifies its file, and all refuse together."""
        state = checkpoint.load_agreed(path, self.identity(), self.rank, dist.group.WORLD)
        self.stage.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.load_codec_state(state)
        self.start_step = state["step"]
        self.lr_schedule = self.lr_schedule_at(self.start_step)
        self.history = list(state["history"])


def run_identity(cfg: TrainConfig, policy: Policy, data: TextData, world: int,
                 ranks_per_node: int) -> dict[str, Any]:
    """What a checkpoint of ``world`` processes must share with a run to be resumed by it."""
    return {"world": world, "model": cfg.model, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
            "policy": policy.to_dict(), "dtype": cfg.dtype, "ranks_per_node": ranks_per_node,
            "seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "micro_batches": cfg.micro_batches, "bucket_numel": cfg.bucket_numel,
            "engine": cfg.engine, "ddp_hook": cfg.ddp_hook, "data": data.fingerprint()}


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """Train on this rank (process group already initialized); rank 0 returns the summary."""
    cfg = TrainConfig(**cfg_dict)
    run = _Run(cfg)
    if rank == 0:  # before anyone saves: a killed run's half-written files go
        checkpoint.remove_stale_temporaries(cfg.out)
    if cfg.resume:
        run.load(cfg.resume)
    reset_stats()
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump({"train": cfg.to_dict(), "policy": run.policy.to_dict()}, f, indent=1)
    progress = progress_bar(cfg) if rank == 0 and cfg.progress else None
    wall0 = time.perf_counter() - (run.history[-1]["wall_s"] if run.history else 0.0)
    try:
        for step in range(run.start_step, cfg.steps):
            before = {k: v.get("wire_bytes", 0) for k, v in stats().items()}
            t0 = time.perf_counter()
            loss = run.train_step(step)
            record = step_record(cfg, step, loss, time.perf_counter() - t0,
                                 time.perf_counter() - wall0, run.skipped_steps,
                                 {k: v["wire_bytes"] - before.get(k, 0)
                                  for k, v in stats().items()})
            last = step + 1 == cfg.steps
            if evaluates_at(cfg, step):
                record["val_loss"] = run.evaluate()
            run.history.append(record)
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or last):
                run.save(step + 1)
            if progress is not None:
                progress.update(record)
    finally:
        if progress is not None:
            progress.close()
    totals = summed_counters(stats(), run.device)
    if rank != 0:
        return None
    return write_outputs(cfg, run, totals)


def step_record(cfg: TrainConfig, step: int, loss: float, seconds: float, wall_s: float,
                skipped: int, wire_bytes: dict[str, float]) -> dict[str, Any]:
    """One line of ``metrics.jsonl``."""
    return {"step": step + 1, "loss": loss, "lr": lr_at(cfg, step), "step_time_s": seconds,
            "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds, "wall_s": wall_s,
            "wire_bytes_rank0": wire_bytes, "skipped": skipped}


def evaluates_at(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (0-based) ends with a validation evaluation."""
    return bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps


def write_outputs(cfg: TrainConfig, run: _Run, totals: dict) -> dict[str, Any]:
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
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot_loss(hist, os.path.join(cfg.out, "loss.png"), title=f"{name} "
              f"dp{cfg.dp}×tp{cfg.tp}×pp{cfg.pp}")
    return summary


def progress_bar(cfg: TrainConfig):
    from commpress.train.report import TrainProgress

    return TrainProgress(cfg.steps)


def train(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run a whole training job; returns rank 0's summary (None on other ranks under
    torchrun). Raises :class:`RunFailedError` if every step it ran was skipped."""
    if launched():  # under torchrun / SLURM: this process is one rank
        world = int(os.environ["WORLD_SIZE"])
        cfg = cfg.resolved(world)
        check_resume_steps(cfg)
        check_train_fits(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        with launched_group(cfg), _agreed_hold(cfg.out):
            summary = run_rank(dist.get_rank(), world, cfg.to_dict())
        check_progress(summary)
        return summary
    from commpress.launch import spawn

    cfg = cfg.resolved()
    if cfg.backend == "nccl" and cfg.nproc > torch.cuda.device_count():
        raise ValueError(f"backend=nccl runs one rank per GPU: nproc={cfg.nproc} > "
                         f"{torch.cuda.device_count()} visible GPUs; allowed: --backend gloo "
                         "(ranks share GPUs) or fewer ranks")
    check_resume_steps(cfg)
    check_train_fits(cfg, cfg.nproc)
    with run_lock.hold(cfg.out):
        results = spawn(run_rank, cfg.nproc, (cfg.to_dict(),),
                        ranks_per_node=cfg.ranks_per_node, backend=cfg.backend,
                        device=cfg.device,
                        timeout=max(600.0, 30.0 * cfg.steps), pg_timeout_s=cfg.timeout_s)
    check_progress(results[0])
    return results[0]


def launched() -> bool:
    """Whether a launcher (torchrun, or SLURM with the variables set) started this
    process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextmanager
def launched_group(cfg: TrainConfig) -> Iterator[None]:
    """Under a launcher, the default process group for the block: created here once
    (rendezvous and collectives bounded by ``cfg.timeout_s``) unless the process has
    one, destroyed after it. Runs one after another (``compare``'s policies) share it:
    a second default group on the same launcher store did not connect (under torchrun
    the second policy's first collective timed out), and torch cannot make one again
    once sub-groups were carved from the first. Without a launcher, or with a group
    already made, nothing happens."""
    if not launched() or dist.is_initialized():
        yield
        return
    cfg = cfg.resolved(int(os.environ["WORLD_SIZE"]))
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    try:
        yield
    finally:  # a clean shutdown: Gloo's threads must not outlive the process
        dist.destroy_process_group()


def check_resume_steps(cfg: TrainConfig) -> None:
    """Refuse to resume a checkpoint at or past ``cfg.steps``: nothing would be trained."""
    if not cfg.resume:
        return
    directory, _ = checkpoint.find(cfg.resume)
    step = checkpoint.read_manifest(directory)["step"]
    if step >= cfg.steps:
        raise ValueError(f"--steps {cfg.steps} does not go past the checkpoint's step {step} "
                         f"({directory}): nothing would be trained; allowed: --steps > {step}")


def check_train_fits(cfg: TrainConfig, local_ranks: int) -> None:
    """Refuse sizes whose ``local_ranks`` ranks on this machine (on CUDA: per GPU)
    cannot fit in its memory, before any of them allocates."""
    if cfg.device == "cuda":
        local_ranks = -(-local_ranks // torch.cuda.device_count())
    check_fits(train_needs(cfg, local_ranks), cfg.device,
               f"train: {local_ranks} ranks here × --batch-size {cfg.batch_size} × --seq-len "
               f"{cfg.seq_len} × --model {cfg.model} (dp{cfg.dp}×tp{cfg.tp}×pp{cfg.pp}, "
               f"--bucket-numel {cfg.bucket_numel})")


def check_progress(summary: dict[str, Any] | None) -> None:
    """Raise :class:`RunFailedError` if every step this run trained was skipped
    (non-finite gradients: NaN weights or data, a diverged model); None passes."""
    if summary is None:
        return
    ran = summary["steps"] - summary["resumed_at_step"]
    if ran and summary["skipped_steps_this_run"] == ran:
        raise RunFailedError(f"policy {summary['policy']}: all {ran} steps this run were "
                             "skipped (a non-finite gradient norm each time); nothing was "
                             f"trained; metrics in {summary['out']}", summary)


@contextmanager
def _agreed_hold(run_dir: str) -> Iterator[None]:
    """Under torchrun: rank 0 holds the run directory; every rank learns if it cannot."""
    with ExitStack() as stack:
        problem = None
        if dist.get_rank() == 0:
            try:
                stack.enter_context(run_lock.hold(run_dir))
            except run_lock.RunDirectoryBusy as e:
                problem = str(e)
        message = [problem]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None:
            raise run_lock.RunDirectoryBusy(message[0])
        yield
