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

It is the trainer's own run (:class:`~commpress.train.run.Run` with ``played=True``):
the same stages, batches, GPipe schedule, DDP micro-batches, learning-rate schedule,
evaluation, checkpoints and outputs (``metrics.jsonl``, ``summary.json``, ``loss.png``);
only the transport differs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from commpress.launch import rank_threads, spawn
from commpress.train import run_lock
from commpress.train.config import TrainConfig
from commpress.train.loop import check_progress, check_resume_steps
from commpress.train.memory import check_fits, simulate_needs
from commpress.train.run import Run, run_steps
from commpress.validate import InputError


def simulate(cfg: TrainConfig) -> dict[str, Any]:
    """Play a ``dp × pp`` run of ``dp · pp`` ranks in one process — with ``tp > 1``, in
    ``tp`` processes, one per tensor-parallel slice; returns the summary. Raises
    :class:`RunFailedError` if every step it ran was skipped."""
    refuse_launcher()
    if cfg.engine == "ddp" and cfg.ddp_hook != "commpress":
        raise InputError(f"simulate plays DDP with the commpress hook only; got "
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
                summary = run_steps(Run(cfg, played=True), writer=True)
        else:
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
        raise InputError(f"simulate plays all ranks in one process, but this is one of "
                         f"WORLD_SIZE={world} processes a launcher (torchrun?) started, whose "
                         "copies would collide on --out; allowed: run 'commpress simulate' "
                         "without a launcher (--ranks sets the ranks it plays)")


def play_slice(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """One tensor-parallel slice of :func:`simulate` (process group of the ``tp`` slices
    already initialized); slice 0 writes the outputs and returns the summary."""
    cfg = TrainConfig(**cfg_dict)
    return run_steps(Run(cfg, played=True, tp_group=dist.group.WORLD), writer=rank == 0)
