"""Rank functions for the measured-fallback tests (module level: picklable)."""

import time

import torch
import torch.distributed as dist

import commpress
from commpress.dp.fallback import SAMPLES, WARMUP, MeasuredChoice
from tests.frontends import workers


def timed_choice(rank, world, compressed_ms, exact_ms):
    """A choice fed calls that sleep ``compressed_ms[rank]`` / ``exact_ms[rank]``: the
    calls it made (way, async_op, probe), its decision and state, then what a second run
    loaded with that state calls, and the error a state from another layout raises."""
    choice = MeasuredChoice("dp.grad")
    topology = commpress.Topology(world)
    ways = []

    def call(way, async_op, probe):
        ways.append((way, async_op, probe))
        time.sleep({"compressed": compressed_ms, "exact": exact_ms}[way][rank] / 1e3)
        return way

    while choice.decision is None:
        choice.run(call, None, topology, 100, async_op=True)
    state, measured = choice.state_dict(), len(ways)
    result = choice.run(call, None, topology, 100, async_op=True)
    # decided: the call itself, with the caller's async_op (result, whether run to its end)
    after = (result, not ways[-1][1])
    resumed = MeasuredChoice("dp.grad")
    resumed.load_state_dict(state)
    ran = len(ways)
    resumed.run(call, None, topology, 100, async_op=False)
    elsewhere = MeasuredChoice("dp.grad")  # the same state, resumed on another layout
    elsewhere.load_state_dict(state)
    try:
        elsewhere.run(call, None, commpress.Topology(1), 100, async_op=False)
        other = None
    except ValueError as e:
        other = str(e)
    return {"ways": ways[:measured], "after": after, "state": state,
            "resumed": ways[ran:], "other layout": other}


def sharded_with_fallback(rank, world, policy, steps, directory, resume):
    """gpt-tiny under a ShardedOptimizer with ``fallback="measured"``, its state saved to
    ``directory`` after ``steps`` steps (``resume``: loaded from there first): every
    bucket's choices (decision, the group's seconds, calls timed this run each way) and
    the weights' hash."""
    path = f"{directory}/rank{rank}.pt"
    data, model = workers._data(), workers._model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, fallback="measured",
                                     bucket_numel=20_000, lr=1e-3)
    if resume:
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    workers.train_steps(model, opt, data, rank, world, 0, steps)
    choices = [{what: (c.decision, c.agreed_seconds, [len(s) for s in c.seconds.values()])
                for what, c in b.dp.choices.items()} for b in opt.buckets]
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    return {"choices": choices, "hash": workers._hash_params(model)}


def ddp_with_fallback(rank, world, steps):
    """gpt-tiny under DDP with commpress's hook (int8, fallback measured): the hook
    buckets' decisions and the weights' hash after ``steps`` steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    data, model = workers._data(), workers._model()
    ddp = DDP(model, bucket_cap_mb=0.1)
    state, hook = commpress.ddp_hook(ddp, {"dp": {"grad": "int8"}}, fallback="measured",
                                     bucket_numel=20_000)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = workers._local_batch(data, step, rank, world)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    decisions = [hb.dp.choices["grad"].decision for hb in state.buckets]
    dist.barrier()
    return {"decisions": decisions, "hash": workers._hash_params(model),
            "measured": WARMUP + SAMPLES}


def diloco_with_fallback(rank, world, steps):
    """gpt-tiny, one rank per site, DiLoCo with int8 pseudo-gradients synced every 2
    steps, fallback measured: each fragment's decision and the global weights' hash."""
    from tests.frontends import diloco_workers

    model, opt, sync = diloco_workers._build(rank, {
        "sync_every": 2, "policy": "diloco-int8", "fallback": "measured",
        "topology": commpress.Topology(1)})
    data = workers._data()
    record = diloco_workers._steps(model, opt, sync, data, rank, world, 0, steps)
    decisions = [bucket.choices["grad"].decision for bucket in _fragment_buckets(sync)]
    sync.remove()
    return {"decisions": decisions, "global": record[-1]["global"], "syncs": record[-1]["syncs"]}


def _fragment_buckets(sync):
    return [fragment.dp for fragment in sync.fragments]


def measuring_is_the_preset(rank, world, policy, steps):
    """The weights' hash after each of ``steps`` steps of gpt-tiny under a
    ShardedOptimizer with ``policy``, without and with ``fallback="measured"``."""
    out = {}
    for fallback in (None, "measured"):
        data, model = workers._data(), workers._model()
        opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, fallback=fallback,
                                         bucket_numel=20_000, lr=1e-3)
        hashes = []
        workers.train_steps(model, opt, data, rank, world, 0, steps, hashes)
        out[fallback or "preset"] = hashes
        opt.remove()
    return out
