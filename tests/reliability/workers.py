"""Rank functions for the reliability tests."""

import torch
import torch.distributed as dist

import commpress
from tests.frontends.workers import _data, _hash_params, _local_batch, _model
from tests.reliability.killing import Killer


def killed_mid_step(rank, world, victim):
    """Train; the victim SIGKILLs itself inside a step. Survivors report how they ended."""
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "sdp4bit", lr=1e-3,
                                     bucket_numel=20_000)
    killer = Killer(rank, victim, at_step=3)

    def loop():
        for step in range(1000):
            x, y = _local_batch(data, step, rank, world)
            _, loss = model(x, y)
            loss.backward()
            killer.mid_step(step)
            opt.step()
            opt.zero_grad()

    return killer.survive(loop)


def nonfinite_gradient(rank, world, mode):
    """One rank's gradient gets a NaN at step 2: every rank must skip (or raise) alike."""
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "sdp4bit", lr=1e-3,
                                     bucket_numel=20_000, nonfinite=mode)
    hashes, outcome = [], "ok"
    for step in range(4):
        x, y = _local_batch(data, step, rank, world)
        _, loss = model(x, y)
        if step == 2 and rank == 1:
            loss = loss * float("nan")  # every gradient of this rank becomes NaN
        loss.backward()
        try:
            stepped = opt.step()
        except commpress.NonFiniteGradientError as e:
            outcome = f"raised: {e}"
            break
        opt.zero_grad()
        hashes.append((stepped, _hash_params(model)))
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    masters = all(torch.isfinite(b.master).all() for b in opt.buckets)
    return {"hashes": hashes, "outcome": outcome, "finite": finite and masters,
            "skipped": opt.skipped_steps}


def long_run_replicas(rank, world, steps):
    """Replica weights after every step of a long small run, as hashes."""
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "sdp4bit", lr=1e-3,
                                     bucket_numel=40_000)
    digests = []
    for step in range(steps):
        x, y = _local_batch(data, step, rank, world)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        digests.append(_hash_params(model)[:16])
    return digests


def fuzz_collectives(rank, world, cases):
    """Each case: (numel, dtype name, codec spec, special values). Returns per-case checks."""
    out = []
    for i, (numel, dtype_name, spec, specials) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = (torch.randn(numel, generator=g) * 3).to(dtype)
        for j, v in enumerate(specials):
            if numel:
                x[(j * 7919 + rank) % numel] = v
        full = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(full, x)
        exact = torch.stack([f.double() for f in full]).sum(0)
        y = x.clone()
        commpress.all_reduce(y, spec, op="sum", label=f"fuzz{i}")
        bad = ~torch.isfinite(exact)
        check = {
            "shape": y.shape == x.shape and y.dtype == x.dtype,
            # a non-finite input element never comes back finite
            "nonfinite_kept": bool((~torch.isfinite(y[bad])).all()) if bad.any() else True,
            "digest": _hash_params_tensor(y),
        }
        out.append(check)
    return out


def _hash_params_tensor(t):
    import hashlib

    raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def mismatched_dtype(rank, world):
    x = torch.randn(64, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    try:
        commpress.reduce_scatter(torch.empty(64 // world, dtype=x.dtype), x, "int8")
    except commpress.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def raises(rank, world, kind):
    """Rank 1 raises ``kind`` ("input": an InputError, "bug": a plain ValueError)."""
    if rank == 1:
        raise commpress.InputError("batch_size=3 is not allowed") if kind == "input" else \
            ValueError("an internal invariant broke")
    return rank


def killed_in_a_guard_decision(rank, world, victim):
    """A guarded optimizer (int2 without Hadamard, budget 0.3, deciding every step); the
    victim SIGKILLs itself as step 0's decision starts — the one that would promote every
    bucket (int2's error is over 0.7) — the others then in its gather.
    Survivors report how they ended and each bucket's gradient codec after."""
    data = _data()
    model = _model()
    policy = {"name": "naive-int2", "dp": {"grad": "int2:hadamard=0"}}
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, lr=1e-3,
                                     bucket_numel=20_000,
                                     guard={"max_rel_error": 0.3, "window": 1, "every": 1})
    killer = Killer(rank, victim, at_step=0)
    decide = opt.guard.decide

    def dying(step, group, **kwargs):
        killer.mid_step(step)  # the victim dies here at step 0; the others go on into it
        return decide(step, group, **kwargs)

    opt.guard.decide = dying

    def loop():
        for step in range(1000):
            x, y = _local_batch(data, step, rank, world)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    outcome = killer.survive(loop)
    outcome["codecs"] = [b.dp.policy.rules["dp.grad"].codec for b in opt.buckets]
    outcome["events"] = [(e["step"], e["bucket"]) for e in opt.guard.events]
    return outcome
