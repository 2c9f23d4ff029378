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
qWD). Not covered yet: the DDP hook, tensor and pipeline parallelism (their activation
collectives are inside the model), FSDP.

Outputs as ``commpress train``: ``metrics.jsonl``, ``summary.json``, ``loss.png``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from commpress.integrations.played_optimizer import PlayedShardedOptimizer
from commpress.model.gpt import GPT, config_from_preset
from commpress.parallel.pipeline import Stage
from commpress.policy import Policy
from commpress.train import run_lock
from commpress.train.config import TrainConfig
from commpress.train.data import TextData, load_tokens
from commpress.train.loop import evaluates_at, lr_at, progress_bar, step_record, write_outputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlayedRun:
    """One replica and the played optimizer of an ``N``-rank data-parallel run."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.ranks = cfg.nproc
        self.ranks_per_node = cfg.ranks_per_node or cfg.nproc
        self.policy = Policy.resolve(cfg.policy)
        self.device = torch.device(cfg.device)
        self.data = TextData(load_tokens(cfg.data, cfg.max_data_bytes))
        self.data.check_seq_len(cfg.seq_len)
        mcfg = config_from_preset(cfg.model, vocab_size=max(256, self.data.vocab_size))
        torch.manual_seed(cfg.seed)  # the same initialization as every rank of `train`
        self.stage = Stage(GPT(mcfg), 0, 1).to(self.device, DTYPES[cfg.dtype])
        self.opt = PlayedShardedOptimizer(
            self.stage, torch.optim.AdamW, self.policy, ranks=self.ranks,
            ranks_per_node=self.ranks_per_node, bucket_numel=cfg.bucket_numel,
            max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite, lr=cfg.lr,
            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.history: list[dict[str, Any]] = []

    def rank_batch(self, split: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = self.data.batch(split, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        per = cfg.batch_size // self.ranks
        return (x[rank * per:(rank + 1) * per].to(self.device),
                y[rank * per:(rank + 1) * per].to(self.device))

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.stage(x)
        return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))

    def rank_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One rank's step of the GPipe schedule with one stage: every micro-batch
        forward, then backward in reverse order (the gradients add up in that order)."""
        micro = self.cfg.micro_batches
        losses = [self._loss(xm, ym) for xm, ym in zip(x.chunk(micro), y.chunk(micro))]
        for loss in reversed(losses):
            (loss / micro).backward()
            self.opt.accumulate()
        return float(sum(loss.detach() for loss in losses) / micro)

    def train_step(self, step: int) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.cfg, step)
        losses = []
        for rank in range(self.ranks):
            losses.append(self.rank_backward(*self.rank_batch("train", step, rank)))
            self.opt.take(rank)
        self.opt.step()
        return sum(losses) / self.ranks

    @torch.no_grad()
    def evaluate(self) -> float:
        self.stage.eval()
        per_rank = []
        for rank in range(self.ranks):
            batches = [float(self._loss(*self.rank_batch("val", i, rank)))
                       for i in range(self.cfg.eval_batches)]
            per_rank.append(sum(batches) / len(batches))
        self.stage.train()
        return sum(per_rank) / self.ranks


def simulate(cfg: TrainConfig) -> dict[str, Any]:
    """Play a data-parallel run of ``cfg.nproc`` ranks in one process; returns the summary."""
    if cfg.tp != 1 or cfg.pp != 1 or cfg.engine != "sharded":
        raise ValueError("simulate plays data parallelism with the sharded optimizer; allowed: "
                         "tp=1, pp=1, engine=sharded")
    if cfg.resume:
        raise ValueError("simulate does not resume; allowed: resume=None")
    cfg = cfg.resolved()
    with run_lock.hold(cfg.out):
        run = PlayedRun(cfg)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump({"simulate": cfg.to_dict(), "policy": run.policy.to_dict()}, f, indent=1)
        progress = progress_bar(cfg) if cfg.progress else None
        wall0 = time.perf_counter()
        try:
            for step in range(cfg.steps):
                t0 = time.perf_counter()
                loss = run.train_step(step)
                record = step_record(cfg, step, loss, time.perf_counter() - t0,
                                     time.perf_counter() - wall0, run.opt.skipped_steps, {})
                if evaluates_at(cfg, step):
                    record["val_loss"] = run.evaluate()
                run.history.append(record)
                if progress is not None:
                    progress.update(record)
        finally:
            if progress is not None:
                progress.close()
        return write_outputs(cfg, run, run.opt.stats.snapshot())
