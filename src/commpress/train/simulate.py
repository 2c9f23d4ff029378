"""``commpress simulate``: one process plays an ``N``-rank data-parallel run.

"Will 4-bit communication hurt *my* model?" should have an answer before a cluster is
rented. A real run of ``N`` data-parallel ranks keeps ``N`` bitwise identical replicas;
here one replica is trained and, each step, the global batch is split into the ``N``
ranks' batches: each rank's gradient is computed in turn, handed to the sharded
optimizer's collectives as :class:`PlayedShardedOptimizer` plays them for ``N`` ranks in
``N / M`` nodes — the same chunking, codecs, random streams, sums, error-feedback and
qWD state — and the optimizer steps. With a compressed gradient path the weights equal,
bit for bit, those of a real ``N``-rank ``commpress train`` (tested for every such
preset); exact gradient reductions agree to the backend's fp32 summation order.

Covered: data parallelism with the sharded optimizer (ZeRO-1/2, one or two levels,
qWD), also with ``pp`` pipeline stages (``dp × pp`` ranks: each data-parallel rank's
GPipe step runs through every stage, activations and their gradients through the
policy's ``pp`` codecs with each rank's own codec objects, one optimizer per stage and
one gradient norm over all ranks); and torch DDP with :func:`commpress.ddp_hook`
(``--engine ddp``: the hook's buckets and all-reduces, one or two levels, played by
:class:`PlayedDDPHook`).

Tensor parallelism (``tp > 1``, sharded optimizer) is not played but run: its
collectives sit inside every layer, so ``tp`` real processes each hold one
tensor-parallel slice and play the data-parallel ranks and stages of that slice, in
the same order, their layers' all-reduces real. Each played data-parallel rank gets
its own state of the tensor-parallel codecs (swapped in around its pass), and the
gradient norm gathers every process's parts into global rank order. Not covered: DDP
with torch's own hooks, DDP with tensor parallelism, FSDP.

Outputs as ``commpress train``: ``metrics.jsonl``, ``summary.json``, ``loss.png``.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commpress.collectives import stats
from commpress.collectives.byte_stats import Stats
from commpress.collectives.comm import all_gather_single
from commpress.collectives.played import played_transfer
from commpress.integrations.played_ddp import PlayedDDPHook
from commpress.integrations.played_optimizer import PlayedShardedOptimizer
from commpress.integrations.sharded_optimizer import norm_of_parts
from commpress.launch import rank_threads
from commpress.model.gpt import GPT, config_from_preset
from commpress.parallel.mesh import MeshShape
from commpress.parallel.pipeline import Stage
from commpress.parallel.tensor import apply_tp, codec_states, load_codec_states, tp_norm_weights
from commpress.policy import Policy
from commpress.train import checkpoint, run_lock
from commpress.train.config import TrainConfig
from commpress.train.data import TextData, load_tokens
from commpress.train.ddp_engine import replica_optimizer, step_replica
from commpress.train.loop import (
    check_progress,
    check_resume_steps,
    evaluates_at,
    lr_at,
    progress_bar,
    run_identity,
    step_record,
    summed_counters,
    write_outputs,
)
from commpress.train.memory import check_fits, simulate_needs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlayedDDP:
    """What :class:`~commpress.train.ddp_engine.DDPEngine` does on every rank, played:
    the hook's all-reduce of the ranks' gradients, then the same clip and AdamW step."""

    def __init__(self, module: torch.nn.Module, policy: Policy, cfg: TrainConfig, ranks: int,
                 ranks_per_node: int, stats: Stats) -> None:
        self.module, self.cfg = module, cfg
        self.hook = PlayedDDPHook(module, policy, ranks=ranks, ranks_per_node=ranks_per_node,
                                  stats=stats)
        self.optimizer = replica_optimizer(module, cfg.lr, cfg.weight_decay)
        self.steps = self.skipped_steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def take(self, rank: int) -> None:
        self.hook.take(rank)

    def state_dict(self) -> dict[str, Any]:
        return {"hook": self.hook.state_dict(), "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hook.load_state_dict(state["hook"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.skipped_steps = state["steps"], state["skipped_steps"]

    def step(self) -> bool:
        self.hook.finish()
        stepped = step_replica(self.module, self.optimizer, self.cfg.max_grad_norm,
                               self.cfg.nonfinite, f"simulated DDP step {self.steps}")
        self.steps += 1
        self.skipped_steps += not stepped
        return stepped


class PlayedRun:
    """One replica of a ``dp × pp`` run (with ``tp_group``: this process's tensor-parallel
    slice of a ``dp × tp × pp`` run): its stages, one played optimizer per stage, and the
    pipeline's activation codecs of every rank."""

    def __init__(self, cfg: TrainConfig, tp_group: dist.ProcessGroup | None = None) -> None:
        self.cfg = cfg
        self.ranks, self.pp = cfg.dp, cfg.pp  # data-parallel ranks, pipeline stages
        self.tp, self.tp_group = cfg.tp, tp_group
        if cfg.tp > 1 and (tp_group is None or dist.get_world_size(tp_group) != cfg.tp):
            raise ValueError(f"tp={cfg.tp} needs a process group of {cfg.tp} ranks, one per "
                             "tensor-parallel slice; allowed: as simulate() starts them")
        self.tp_rank = dist.get_rank(tp_group) if cfg.tp > 1 else 0
        self.shape = MeshShape(cfg.dp, cfg.tp, cfg.pp)
        rpn = cfg.ranks_per_node or cfg.nproc
        # as `train` lays ranks out: tensor-parallel slices, then stages, innermost
        dp_per_node = max(1, rpn // (cfg.pp * cfg.tp))
        self.policy = Policy.resolve(cfg.policy)
        self.device = torch.device(cfg.device)
        self.data = TextData(load_tokens(cfg.data, cfg.max_data_bytes))
        self.data.check_seq_len(cfg.seq_len)
        mcfg = config_from_preset(cfg.model, vocab_size=max(256, self.data.vocab_size))
        torch.manual_seed(cfg.seed)  # the same initialization as every rank of `train`
        model = GPT(mcfg)
        self.stages = [Stage(model, s, cfg.pp).to(self.device, DTYPES[cfg.dtype])
                       for s in range(cfg.pp)]
        for stage in self.stages:
            apply_tp(stage.blocks, tp_group, self.policy)
        self.stage = self.stages[0]
        self.stats = Stats()  # bytes every rank sends, summed over the ranks
        if cfg.engine == "ddp":
            self.opts = [PlayedDDP(self.stage, self.policy, cfg, self.ranks, dp_per_node,
                                   self.stats)]
        else:
            self.opts = [PlayedShardedOptimizer(
                stage, torch.optim.AdamW, self.policy, ranks=self.ranks,
                ranks_per_node=dp_per_node, bucket_numel=cfg.bucket_numel,
                max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite, stats=self.stats,
                norm_weights=tp_norm_weights(stage, cfg.tp), lr=cfg.lr, betas=(0.9, 0.95),
                weight_decay=cfg.weight_decay)
                for stage in self.stages]
        # every data-parallel rank's own state of the tensor-parallel layers' codecs
        self.tp_states = ([[copy.deepcopy(codec_states(st)) for st in self.stages]
                           for _ in range(cfg.dp)] if cfg.tp > 1 else None)
        # every rank's pipeline codecs (their state: random streams, error feedback)
        self.act = [[self.policy.codec_for("pp", "act") for _ in range(cfg.pp)]
                    for _ in range(cfg.dp)]
        self.act_grad = [[self.policy.codec_for("pp", "act_grad") for _ in range(cfg.pp)]
                         for _ in range(cfg.dp)]
        self.history: list[dict[str, Any]] = []
        self.start_step = 0

    @property
    def skipped_steps(self) -> int:
        return self.opts[0].skipped_steps

    # -- checkpoints (one file per tensor-parallel slice, as `train` writes per rank) ------
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it (a `train`
        checkpoint is another run: its ranks hold other state)."""
        cfg = self.cfg
        return {**run_identity(cfg, self.policy, self.data, cfg.tp,
                               cfg.ranks_per_node or cfg.nproc), "simulate": True}

    def state_dict(self, step: int) -> dict[str, Any]:
        """Every played rank's state after ``step`` steps: weights, optimizers, codecs."""
        return {"format": checkpoint.FORMAT, "step": step, "rank": self.tp_rank,
                "config": self.cfg.to_dict(),
                "stages": [st.state_dict() for st in self.stages],
                "optimizers": [opt.state_dict() for opt in self.opts],
                **self.codec_state(), "history": self.history}

    def codec_state(self) -> dict[str, Any]:
        """Every played rank's pipeline- and tensor-parallel codec state."""
        return {"pp_codecs": {"act": [[c.state_dict() for c in row] for row in self.act],
                              "act_grad": [[c.state_dict() for c in row]
                                           for row in self.act_grad]},
                "tp_codecs": self.tp_states}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        for rows, saved in ((self.act, state["pp_codecs"]["act"]),
                            (self.act_grad, state["pp_codecs"]["act_grad"])):
            for row, states in zip(rows, saved, strict=True):
                for codec, s in zip(row, states, strict=True):
                    codec.load_state_dict(s)
        self.tp_states = state["tp_codecs"]

    def save(self, step: int) -> None:
        checkpoint.save_step(self.cfg.out, step, self.tp_rank, self.state_dict(step),
                             self.identity(), self.tp_group if self.tp > 1 else None)

    def load(self, path: str) -> None:
        """Resume from ``path``: every slice verifies its file; all refuse together."""
        state = checkpoint.load_agreed(path, self.identity(), self.tp_rank,
                                       self.tp_group if self.tp > 1 else None)
        for stage, s in zip(self.stages, state["stages"], strict=True):
            stage.load_state_dict(s)
        for opt, s in zip(self.opts, state["optimizers"], strict=True):
            opt.load_state_dict(s)
        self.load_codec_state(state)
        self.start_step = state["step"]
        self.history = list(state["history"])

    def rank_batch(self, split: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = self.data.batch(split, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        per = cfg.batch_size // self.ranks
        return (x[rank * per:(rank + 1) * per].to(self.device),
                y[rank * per:(rank + 1) * per].to(self.device))

    def _transfer(self, rank: int, src: int, dst: int, tensor: torch.Tensor,
                  kind: str) -> torch.Tensor:
        """Stage ``src`` of data-parallel rank ``rank`` sends ``tensor`` to stage ``dst``."""
        codecs = self.act if kind == "act" else self.act_grad
        label = f"pp.{kind}"
        return played_transfer(codecs[rank][src], codecs[rank][dst], tensor,
                               rng_stream=self.shape.rank_of(rank, src, self.tp_rank),
                               key=f"{label}->{dst}", stats=self.stats, label=label)

    @contextmanager
    def _tp_codecs_of(self, rank: int) -> Iterator[None]:
        """Data-parallel rank ``rank``'s tensor-parallel codec states in the layers for the
        block (stochastic counters and error-feedback memory are each rank's own)."""
        if self.tp_states is None:
            yield
            return
        for stage, states in zip(self.stages, self.tp_states[rank]):
            load_codec_states(stage, states)
        yield
        self.tp_states[rank] = [copy.deepcopy(codec_states(st)) for st in self.stages]

    def pipeline(self, rank: int, x: torch.Tensor, y: torch.Tensor, train: bool) -> float:
        """Rank ``rank``'s GPipe step over every stage: all micro-batches forward
        (activations through the ``pp.act`` codec), then backward in reverse order
        (activation gradients through ``pp.act_grad``); the batch's mean loss."""
        with self._tp_codecs_of(rank):
            return self._pipeline(rank, x, y, train)

    def _pipeline(self, rank: int, x: torch.Tensor, y: torch.Tensor, train: bool) -> float:
        micro, P = self.cfg.micro_batches, self.pp
        inputs = [[None] * micro for _ in range(P)]
        outputs = [[None] * micro for _ in range(P)]
        loss_sum = torch.zeros((), device=x.device)
        with torch.enable_grad() if train else torch.no_grad():
            for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                h = xm
                for s in range(P):
                    if s > 0:
                        h = self._transfer(rank, s - 1, s, h, "act")
                        h.requires_grad_(train)
                    inputs[s][i] = h
                    h = self.stages[s](h)
                    if s == P - 1:
                        loss = F.cross_entropy(h.reshape(-1, h.size(-1)), ym.reshape(-1))
                        loss_sum += loss.detach()
                        h = loss / micro
                    outputs[s][i] = h
        if train:
            for i in reversed(range(micro)):
                for s in reversed(range(P)):
                    if s == P - 1:
                        outputs[s][i].backward()
                    else:
                        g = self._transfer(rank, s + 1, s, inputs[s + 1][i].grad, "act_grad")
                        outputs[s][i].backward(g)
                    self.opts[s].accumulate()
        return float(loss_sum / micro)

    def ddp_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One DDP rank's micro-batches: each backward right after its forward (the
        gradients add up in ``p.grad`` in that order)."""
        micro, total = self.cfg.micro_batches, 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            out = self.stage(xm)
            loss = F.cross_entropy(out.reshape(-1, out.size(-1)), ym.reshape(-1))
            (loss / micro).backward()
            total += loss.item()
        return total / micro

    def train_step(self, step: int) -> float:
        for opt in self.opts:
            for g in opt.param_groups:
                g["lr"] = lr_at(self.cfg, step)
        losses = []
        for rank in range(self.ranks):
            x, y = self.rank_batch("train", step, rank)
            losses.append(self.ddp_backward(x, y) if self.cfg.engine == "ddp"
                          else self.pipeline(rank, x, y, train=True))
            for opt in self.opts:
                opt.take(rank)
        if self.cfg.engine == "ddp":
            self.opts[0].step()
        else:
            # one norm over every rank of every stage and tensor-parallel slice, parts
            # added in global rank order
            parts = torch.stack([torch.stack(opt.reduce()) for opt in self.opts])  # (pp, dp)
            every = parts[None]
            if self.tp > 1:
                every = parts.new_empty(self.tp * parts.numel())
                all_gather_single(every, parts.reshape(-1), self.tp_group)
                every = every.view(self.tp, *parts.shape)
            norm = norm_of_parts(torch.stack([every[t, s, d] for d in range(self.ranks)
                                              for s in range(self.pp)
                                              for t in range(self.tp)]))
            for opt in self.opts:
                opt.update(norm)
        return sum(losses) / self.ranks

    @torch.no_grad()
    def evaluate(self) -> float:
        # as `train` does: evaluation leaves every rank's codec state as it found it
        kept = copy.deepcopy(self.codec_state())
        for stage in self.stages:
            stage.eval()
        per_rank = []
        try:
            for rank in range(self.ranks):
                batches = [self.pipeline(rank, *self.rank_batch("val", i, rank), train=False)
                           for i in range(self.cfg.eval_batches)]
                per_rank.append(sum(batches) / len(batches))
        finally:
            for stage in self.stages:
                stage.train()
            self.load_codec_state(kept)
        return sum(per_rank) / self.ranks


def simulate(cfg: TrainConfig) -> dict[str, Any]:
    """Play a ``dp × pp`` run of ``dp · pp`` ranks in one process — with ``tp > 1``, in
    ``tp`` processes, one per tensor-parallel slice; returns the summary. Raises
    :class:`RunFailedError` if every step it ran was skipped."""
    refuse_launcher()
    if cfg.engine == "ddp" and cfg.ddp_hook != "commpress":
        raise ValueError(f"simulate plays DDP with the commpress hook only; got "
                         f"ddp_hook={cfg.ddp_hook!r}; allowed: commpress")
    cfg = cfg.resolved()
    check_resume_steps(cfg)
    check_fits(simulate_needs(cfg), cfg.device,
               f"simulate --ranks {cfg.dp} × --batch-size {cfg.batch_size} × --seq-len "
               f"{cfg.seq_len} × --model {cfg.model} (--pp {cfg.pp}, --tp {cfg.tp}, --policy "
               f"{cfg.policy}, --bucket-numel {cfg.bucket_numel})")
    with run_lock.hold(cfg.out):
        if cfg.tp == 1:
            with rank_threads():  # a spawned rank's kernels: its thread count fixes their bits
                summary = _play(cfg, PlayedRun(cfg), writer=True)
        else:
            from commpress.launch import spawn

            # NCCL needs a GPU per slice; fewer GPUs are shared over Gloo
            backend = ("nccl" if cfg.backend == "nccl" and cfg.tp <= torch.cuda.device_count()
                       else "gloo")
            summary = spawn(play_slice, cfg.tp, (cfg.to_dict(),), backend=backend,
                            device=cfg.device,
                            timeout=max(600.0, 30.0 * cfg.steps), pg_timeout_s=cfg.timeout_s)[0]
    check_progress(summary)
    return summary


def refuse_launcher() -> None:
    """Refuse to run as one of a launcher's ranks: ``simulate`` plays every rank in one
    process, so each of torchrun's copies would write the same run directory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"simulate plays all ranks in one process, but this is one of "
                         f"WORLD_SIZE={world} processes a launcher (torchrun?) started, whose "
                         "copies would collide on --out; allowed: run 'commpress simulate' "
                         "without a launcher (--ranks sets the ranks it plays)")


def play_slice(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """One tensor-parallel slice of :func:`simulate` (process group of the ``tp`` slices
    already initialized); slice 0 writes the outputs and returns the summary."""
    cfg = TrainConfig(**cfg_dict)
    return _play(cfg, PlayedRun(cfg, dist.group.WORLD), writer=rank == 0)


def _play(cfg: TrainConfig, run: PlayedRun, writer: bool) -> dict[str, Any] | None:
    """The steps, evaluations and checkpoints of ``run``; the ``writer`` writes the run
    directory."""
    if writer:  # before anyone saves: a killed run's half-written files go
        checkpoint.remove_stale_temporaries(cfg.out)
    if cfg.resume:
        run.load(cfg.resume)
    if writer:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump({"simulate": cfg.to_dict(), "policy": run.policy.to_dict()}, f, indent=1)
    progress = progress_bar(cfg) if cfg.progress and writer else None
    wall0 = time.perf_counter() - (run.history[-1]["wall_s"] if run.history else 0.0)
    try:
        for step in range(run.start_step, cfg.steps):
            t0 = time.perf_counter()
            loss = run.train_step(step)
            record = step_record(cfg, step, loss, time.perf_counter() - t0,
                                 time.perf_counter() - wall0, run.skipped_steps, {})
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
    totals = run.stats.snapshot()
    if cfg.tp > 1:
        # the slices' played bytes and their layers' real tensor-parallel all-reduces
        mine = Stats()
        mine.add(totals)
        mine.add(stats())
        totals = summed_counters(mine.snapshot(), run.device)
    return write_outputs(cfg, run, totals) if writer else None
