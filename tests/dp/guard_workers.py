"""Ranks training gpt-tiny with a guarded ShardedOptimizer (module level: picklable)."""

import logging

import torch

import commpress
from tests.frontends.workers import _data, _hash_params, _local_batch, _model


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _optimizer(model, policy, guard, bucket_numel):
    return commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, guard=guard, lr=3e-3,
                                      bucket_numel=bucket_numel)


def guarded(rank, world, policy, guard, steps, resume_at=None, bucket_numel=40_000):
    """``steps`` steps; per step the weights' hash, the guard's signals and the codecs of
    every bucket. ``resume_at=k``: the run saves at step k, a new model and optimizer load
    that state and go on (the rest as one run)."""
    torch.set_num_threads(1)
    said = _Said()
    logging.getLogger("commpress").addHandler(said)
    data = _data()
    model = _model()
    opt = _optimizer(model, policy, guard, bucket_numel)
    out = {"hashes": [], "signals": [], "codecs": [], "losses": []}
    for step in range(steps):
        if step == resume_at:
            saved = {"model": model.state_dict(), "opt": opt.state_dict()}
            opt.remove()
            model = _model(seed=1)  # other weights: the load must bring them all back
            opt = _optimizer(model, policy, guard, bucket_numel)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        x, y = _local_batch(data, step, rank, world)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["hashes"].append(_hash_params(model))
        out["losses"].append(loss.item())
        out["signals"].append(list(opt.guard.signals) if opt.guard else [])
        out["codecs"].append([b.dp.grad.describe() if hasattr(b.dp.grad, "describe")
                              else repr(b.dp.policy.rules.get("dp.grad"))
                              for b in opt.buckets])
    out["events"] = opt.guard.events if opt.guard else []
    out["said"] = [line for line in said.lines if "guard" in line]
    out["buckets"] = len(opt.buckets)
    return out


def differing_guards(rank, world):
    """Rank 0 guards with budget 0.3, rank 1 with 0.4: refused at construction."""
    try:
        _optimizer(_model(), "tlq", 0.3 if rank == 0 else 0.4, 40_000)
    except commpress.CollectiveMismatchError as e:
        return str(e)
    return None
