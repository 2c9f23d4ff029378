"""Per-rank functions for the FSDP2 checkpoint and ShardedOptimizer setup tests
(module level: picklable)."""

import hashlib
import os

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import commpress
from tests.frontends.workers import _data, _model, train_steps


def _full_params_hash(model: nn.Module) -> str:
    """The hash of the unsharded weights (every rank computes the same one)."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fsdp_model(policy):
    """gpt-tiny sharded block by block, compressed with ``policy`` (None: stock FSDP2)."""
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    compression = commpress.fsdp.compress(model, policy) if policy is not None else None
    return model, compression


class _TrainState:
    """Model and optimizer as one DCP ``Stateful`` (torch's recommended wrapper)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.opt)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def fsdp_resume_run(rank, world, policy, total, split, ckpt_dir, save_codecs=True):
    """Without a checkpoint in ``ckpt_dir``: run ``total`` steps uninterrupted, then, on
    a fresh model, ``split`` steps and save with torch.distributed.checkpoint. With one:
    load it and run the rest. Returns the losses and the final weights' hash of each."""
    data = _data()
    marker = os.path.join(ckpt_dir, ".metadata")
    out = {}
    if not os.path.exists(marker):
        model, _ = _fsdp_model(policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = train_steps(model, opt, data, rank, world, 0, total)
        out["full"] = {"losses": losses, "hash": _full_params_hash(model)}
    model, compression = _fsdp_model(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    app = {"train": _TrainState(model, opt)}
    if save_codecs:
        app["comm"] = compression
    if "full" in out:
        losses = train_steps(model, opt, data, rank, world, 0, split)
        dcp.save(app, checkpoint_id=ckpt_dir)
        out["first"] = {"losses": losses}
        return out
    dcp.load(app, checkpoint_id=ckpt_dir)
    losses = train_steps(model, opt, data, rank, world, split, total - split)
    out["second"] = {"losses": losses, "hash": _full_params_hash(model)}
    return out


def fsdp_codec_state_mismatch(rank, world, policy, other_policy):
    """A codec state refused by a model sharded another way, and by another policy."""
    _, compression = _fsdp_model(policy)
    state = compression.state_dict()
    other = _model()
    fully_shard(other)  # the root only: the block modules are missing
    errors = {}
    for case, target in (("modules", commpress.fsdp.compress(other, policy)),
                         ("policy", _fsdp_model(other_policy)[1])):
        try:
            target.load_state_dict(state)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    return {"modules": state["modules"], "errors": errors}


def fsdp_codec_state_swapped_or_truncated(rank, world, policy):
    """Each rank loads the other rank's codec state, its own with the other rank's entry
    under its key, then its own cut in half."""
    import torch.distributed as dist

    _, compression = _fsdp_model(policy)
    states = [None] * world
    dist.all_gather_object(states, compression.state_dict())
    own = states[rank]
    other = (rank + 1) % world
    entry_swapped = {**own, f"rank{rank}": states[other][f"rank{other}"]}
    truncated = {**own, f"rank{rank}": own[f"rank{rank}"][:len(own[f"rank{rank}"]) // 2]}
    errors = {}
    for case, state in (("swapped", states[other]), ("entry swapped", entry_swapped),
                        ("truncated", truncated)):
        try:
            compression.load_state_dict(state)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    compression.load_state_dict(own)  # its own state still loads
    return errors


def fsdp_model_of(world, policy):
    return _fsdp_model(policy)


def fsdp_elastic(rank, world, policy, ckpt_dir, phase, build=fsdp_model_of):
    """``phase="save"``: 2 steps, then a DCP checkpoint with the codec state. ``"load"``
    (on another number of ranks): the strict load's error; then the elastic load and 2
    steps; then, on a fresh model, the checkpoint without the codec state and the same 2
    steps. Returns the losses and weights' hashes, and what was logged. ``build(world,
    policy)`` makes the model and its compression (FSDP2 by default; HSDP's 2-D mesh)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    data = _data()
    model, compression = build(world, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    app = {"train": _TrainState(model, opt), "comm": compression}
    if phase == "save":
        train_steps(model, opt, data, rank, world, 0, 2)
        dcp.save(app, checkpoint_id=ckpt_dir)
        return {"hash": _full_params_hash(model)}
    out = {}
    try:
        dcp.load(app, checkpoint_id=ckpt_dir)
        out["strict"] = None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException, every rank's errors
        out["strict"] = str(e)
    dcp.load({**app, "comm": compression.elastic()}, checkpoint_id=ckpt_dir)
    out["loaded"] = _full_params_hash(model)
    out["elastic"] = train_steps(model, opt, data, rank, world, 2, 2), _full_params_hash(model)
    fresh, _ = build(world, policy)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    dcp.load({"train": _TrainState(fresh, fresh_opt)}, checkpoint_id=ckpt_dir)
    out["without codecs"] = (train_steps(fresh, fresh_opt, data, rank, world, 2, 2),
                             _full_params_hash(fresh))
    out["logged"] = [m for m in records if "start fresh" in m]
    return out


def fsdp_nan_on_one_rank(rank, world, policies, build=fsdp_model_of):
    """Per policy (None: stock FSDP2): rank 1's loss is NaN at the first step; whether
    each rank's gradient shards stayed finite at each of 2 steps, and its weights after
    (``build(world, policy)``: FSDP2 by default, or HSDP's 2-D mesh)."""
    from tests.frontends.workers import _local_batch

    data = _data()
    out = {}
    for policy in policies:
        model, _ = build(world, policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        finite = []
        for step in range(2):
            x, y = _local_batch(data, step, rank, world)
            _, loss = model(x, y)
            (loss * float("nan") if rank == 1 and step == 0 else loss).backward()
            finite.append(all(bool(torch.isfinite(p.grad.to_local()).all())
                              for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        weights = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
        out[str(policy)] = {"grads finite": finite, "weights finite": weights}
    return out


def fsdp_killed_mid_step(rank, world, victim):
    """FSDP2 with int2ef; the victim SIGKILLs itself after the forward pass of step 2."""
    from tests.frontends.workers import _local_batch
    from tests.reliability.killing import Killer

    data = _data()
    model, _ = _fsdp_model("int2ef")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    killer = Killer(rank, victim, at_step=2)

    def loop():
        for step in range(1000):
            x, y = _local_batch(data, step, rank, world)
            _, loss = model(x, y)
            killer.mid_step(step)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return killer.survive(loop)


def fsdp_disagreeing_ranks(rank, world, case, build=fsdp_model_of):
    """``case="one"``: rank 0 compresses, rank 1 trains stock FSDP2; ``"policy"``: the
    ranks compress with other policies; ``"replicas"`` (HSDP): the first half of the ranks
    — one replica — with one policy, the other replica with another. What each rank
    raised, and how soon."""
    import time

    data = _data()
    start = time.monotonic()
    first = rank == 0 if case != "replicas" else rank < world // 2
    try:
        model, _ = build(world, "int2ef" if first else "sdp4bit" if case != "one" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train_steps(model, opt, data, rank, world, 0, 1)
        error = None
    except Exception as e:  # noqa: BLE001 - what the rank saw, for the test
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - start}


def fsdp_fallback(rank, world, steps):
    """gpt-tiny under FSDP2 compressed with zeropp and ``fallback="measured"``: the tally
    of its modules' decisions after ``steps`` steps, each module's decisions, and the
    losses."""
    data = _data()
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    compression = commpress.fsdp.compress(model, "zeropp", fallback="measured")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train_steps(model, opt, data, rank, world, 0, steps)
    decisions = {name: {what: c.decision for what, c in scatter.dp.choices.items()}
                 for name, (_, scatter) in compression.modules.items()}
    return {"tally": compression.fallback_decisions(), "decisions": decisions,
            "losses": losses}
