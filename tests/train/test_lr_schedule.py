"""The trainer's learning rate comes from torch's LambdaLR, stepped after each optimizer
step and recomputed on resume: the same bits as ``lr_at`` at every step."""

import pytest
import torch

from commpress.launch import spawn
from commpress.train.config import TrainConfig
from commpress.train.run import Run, lr_at

TINY = dict(model="gpt-tiny", steps=6, batch_size=8, seq_len=32, micro_batches=2, warmup=3,
            eval_every=0, max_data_bytes=300_000, progress=False, bucket_numel=20_000,
            lr=3e-3, min_lr_ratio=0.1)


def lrs_of_a_run(rank, world, engine, trained_steps):
    """The inner optimizer's lrs before each trained step, and those a run resumed at
    every later step would start from."""
    cfg = TrainConfig(policy="none", dp=1, tp=1, pp=1, engine=engine, out="unused",
                      **TINY).resolved(world)
    run = Run(cfg)
    inner = run.opts[0].optimizer
    (schedule,) = run.lr_schedules
    assert isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
    trained = []
    for step in range(trained_steps):
        trained.append({g["lr"] for g in inner.param_groups})
        run.train_step(step)
    resumed = []
    for step in range(trained_steps, cfg.steps):
        run.lr_schedules = run.lr_schedules_at(step)
        resumed.append({g["lr"] for g in inner.param_groups})
    return trained, resumed


@pytest.mark.parametrize("engine", ["sharded", "ddp"])
def test_lambda_lr_gives_lr_at_every_step_and_on_resume(engine):
    trained, resumed = spawn(lrs_of_a_run, 1, (engine, 2))[0]
    cfg = TrainConfig(**TINY)
    expected = [{lr_at(cfg, step)} for step in range(cfg.steps)]
    assert trained + resumed == expected
    # warm-up and decay both ran (the last warm-up step and the first decay step: lr)
    assert len({lr for s in expected for lr in s}) == cfg.steps - 1
