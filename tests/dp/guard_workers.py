"""Ranks training gpt-tiny with a guarded ShardedOptimizer (module level: picklable)."""

import logging

import torch

import commpress
from tests.frontends.workers import _data, _local_batch, _model, train_steps


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
    out = {"hashes": [], "signals": [], "codecs": [], "losses": [], "records": []}
    for step in range(steps):
        if step == resume_at:
            saved = {"model": model.state_dict(), "opt": opt.state_dict()}
            opt.remove()
            model = _model(seed=1)  # other weights: the load must bring them all back
            opt = _optimizer(model, policy, guard, bucket_numel)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        out["losses"] += train_steps(model, opt, data, rank, world, step, 1,
                                     out["hashes"])
        out["signals"].append([g["plain_rel_error"] for g in opt.guard.signals]
                              if opt.guard else [])
        taken = opt.guard.take_records() if opt.guard else []
        out["records"].append(taken[0] if taken else None)  # one decision a step at most
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


def hooked(rank, world, policy, guard, steps, resume_at=None, overlap=True):
    """The same run under DDP with commpress's hook (``bucket_numel`` 40 000): per step the
    weights' hash, the guard's record (None: not sampled) and each hook bucket's codec;
    ``resume_at=k``: the hook's, the model's and the optimizer's state saved at step k and
    loaded into a new DDP module, hook and optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    said = _Said()
    logging.getLogger("commpress").addHandler(said)
    data = _data()

    def build(seed):
        model = DDP(_model(seed=seed), bucket_cap_mb=0.1)
        state, hook = commpress.ddp_hook(model, policy, guard=guard, overlap=overlap,
                                         bucket_numel=40_000)
        model.register_comm_hook(state, hook)
        return model, state, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, state, opt = build(0)
    out = {"hashes": [], "sampled": [], "codecs": []}
    for step in range(steps):
        if step == resume_at:
            saved = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "hook": state.state_dict()}
            state.remove()
            model, state, opt = build(1)  # other weights: the load brings them all back
            model.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["hook"])
        train_steps(model, opt, data, rank, world, step, 1, out["hashes"])
        taken = state.guard.take_records()
        out["sampled"].append(taken[0] if taken else None)  # one decision a step at most
        out["codecs"].append([repr(b.dp.policy.rules.get("dp.grad")) for b in state.buckets])
    out["events"] = state.guard.events
    out["said"] = [line for line in said.lines if "guard" in line]
    state.remove()
    return out


def hooked_with_differing_guards(rank, world):
    """Rank 0's hook guards with budget 0.3, rank 1's with 0.4: refused at construction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        commpress.ddp_hook(DDP(_model()), "int4", guard=0.3 if rank == 0 else 0.4)
    except commpress.CollectiveMismatchError as e:
        return str(e)
    return None


def consolidated(rank, world, policy, guard, steps):
    """``steps`` guarded steps, the optimizer consolidated to rank 0 and loaded elastic
    into a new one on every rank: each bucket's codecs before and after the load."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    data = _data()
    model = _model()
    opt = _optimizer(model, policy, guard, 40_000)
    train_steps(model, opt, data, rank, world, 0, steps)
    state = [opt.consolidate_state_dict(to=0)]
    dist.broadcast_object_list(state, src=0)
    before = [repr(b.dp.policy.rules) for b in opt.buckets]
    opt.remove()
    fresh = _optimizer(_model(seed=1), policy, guard, 40_000)
    fresh.load_state_dict(state[0], elastic=True)
    return {"before": before, "after": [repr(b.dp.policy.rules) for b in fresh.buckets],
            "events": fresh.guard.events}


def hooked_with_a_corrupt_guard_state(rank, world):
    """Two guarded steps under the DDP hook; its state saved, rank 1's guard counts
    corrupted, and each rank's loaded back: what each rank raises."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    data = _data()
    model = DDP(_model(), bucket_cap_mb=0.1)
    state, hook = commpress.ddp_hook(model, "int4", guard=0.3, bucket_numel=40_000)
    model.register_comm_hook(state, hook)
    for step in range(2):
        x, y = _local_batch(data, step, rank, world)
        _, loss = model(x, y)
        loss.backward()
    saved = state.state_dict()
    if rank == 1:
        saved["guard"]["since"] = ["x"] * len(saved["guard"]["since"])
    try:
        state.load_state_dict(saved)
        return None
    except commpress.InputError as e:
        return str(e)
    finally:
        state.remove(drain=False)
