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

Steps 1–5 are :class:`~commpress.train.run.Run` and :func:`~commpress.train.run.run_steps`,
which ``commpress simulate`` runs too; this module starts the ranks and checks the job.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commpress.train import checkpoint, run_lock
from commpress.train.config import TrainConfig
from commpress.train.errors import RunFailedError
from commpress.train.memory import check_fits, train_needs
from commpress.train.run import Run, run_steps
from commpress.validate import InputError


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """Train on this rank (process group already initialized); rank 0 returns the summary."""
    cfg = TrainConfig(**cfg_dict)
    run = Run(cfg, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    summary = run_steps(run, writer=rank == 0)
    run.release()
    # the run's objects hold each other (modules, hooks, optimizers): freed only by a
    # collection, and its destroyed groups' Gloo threads live until they are
    del run
    gc.collect()
    return summary


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
        raise InputError(f"backend=nccl runs one rank per GPU: nproc={cfg.nproc} > "
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
        raise InputError(f"--steps {cfg.steps} does not go past the checkpoint's step {step} "
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
