"""Per-rank training functions for the integration tests (module level: picklable)."""

import hashlib

import torch
import torch.distributed as dist

import commpress
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens

SEQ, BATCH = 32, 8


def _data():
    return TextData(load_tokens(max_bytes=200_000))


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return GPT(config_from_preset("gpt-tiny", block_size=SEQ)).to(dtype)


def _local_batch(data, step, rank, world, seed=0):
    x, y = data.batch("train", BATCH, SEQ, seed, step)
    per = BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _hash_params(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _global_loss(loss, world):
    t = loss.detach().clone()
    if world > 1:
        dist.all_reduce(t)
    return (t / world).item()


def train_steps(model, opt, data, rank, world, start, steps, hashes=None):
    losses = []
    for step in range(start, start + steps):
        x, y = _local_batch(data, step, rank, world)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
        if hashes is not None:
            hashes.append(_hash_params(model))
    return losses


def every_policy_bitwise_identical(rank, world, policies, steps, dtype_name):
    dtype = getattr(torch, dtype_name)
    data = _data()
    out = {}
    for policy in policies:
        model = _model(dtype=dtype)
        opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, lr=3e-3,
                                         bucket_numel=40_000)
        hashes = []
        commpress.reset_stats()
        losses = train_steps(model, opt, data, rank, world, 0, steps, hashes)
        out[policy] = {"hashes": hashes, "losses": losses, "stats": commpress.stats()}
    return out


def none_policy_losses(rank, world, steps):
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "none", lr=3e-3,
                                     bucket_numel=30_000, decay_1d=False, weight_decay=0.1)
    return train_steps(model, opt, data, rank, world, 0, steps)


def single_process_losses(steps):
    """The reference: one process, plain torch AdamW, same global batch and init."""
    data = _data()
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    return train_steps(model, opt, data, 0, 1, 0, steps)


RESUME_POLICY = {"name": "resume-test",
                 "dp": {"grad": {"codec": "int4:rounding=stochastic,seed=1",
                                 "error_feedback": True},
                        "param": {"codec": "int4:group=2048", "delta": True}}}


def resume_run(rank, world, total, split, ckpt_dir):
    """``split`` None: run ``total`` steps. Else run ``split`` steps and save, or (if the
    checkpoint exists) load it and run the rest."""
    import os

    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, RESUME_POLICY, lr=3e-3,
                                     bucket_numel=30_000)
    path = os.path.join(ckpt_dir, f"rank{rank}.pt") if ckpt_dir else None
    if split is None:
        return train_steps(model, opt, data, rank, world, 0, total)
    if not os.path.exists(path):
        losses = train_steps(model, opt, data, rank, world, 0, split)
        torch.save({"optimizer": opt.state_dict()}, path)
        return losses
    state = torch.load(path, weights_only=True)
    opt.load_state_dict(state["optimizer"])
    return train_steps(model, opt, data, rank, world, split, total - split)


def ddp_hook_training(rank, world, policy, steps, overlap=True):
    from torch.nn.parallel import DistributedDataParallel as DDP

    data = _data()
    model = DDP(_model(), bucket_cap_mb=0.1)
    state = None
    if policy is not None:
        state, hook = commpress.ddp_hook(model, policy, overlap=overlap, bucket_numel=25_000)
        model.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hashes = []
    losses = train_steps(model.module if False else model, opt, data, rank, world, 0, steps,
                         hashes)
    return {"losses": losses, "hashes": hashes,
            "layout": [b.names for b in state.buckets] if state is not None else []}


def fsdp_training(rank, world, policy, steps):
    from torch.distributed.fsdp import fully_shard

    data = _data()
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if policy is not None:
        commpress.fsdp.compress(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    commpress.reset_stats()
    losses = train_steps(model, opt, data, rank, world, 0, steps)
    return {"losses": losses, "stats": commpress.stats()}


def different_initial_weights(rank, world, init_sync):
    """Each rank initializes from its own seed: broadcast makes the replicas equal (and
    qWD keeps them so); verify refuses."""
    data = _data()
    model = _model(seed=rank)
    try:
        opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "qwd", lr=1e-3,
                                         bucket_numel=20_000, init_sync=init_sync)
    except commpress.CollectiveMismatchError as e:
        return {"error": str(e)}
    hashes = [_hash_params(model)]
    masters_equal_weights = all(
        torch.equal(b.master, b.param_buffer[b.shard(opt.rank, opt.world)].float())
        for b in opt.buckets)
    train_steps(model, opt, data, rank, world, 0, 3, hashes)
    return {"error": None, "hashes": hashes, "masters": masters_equal_weights}


def stepped_together(rank, world, split, poison_step):
    """gpt-tiny over 2 ranks, clipped hard (every step clips): one ShardedOptimizer, or
    two over the blocks and the rest stepped with one norm (``step_together``). At
    ``poison_step`` rank 1's last block gets a NaN gradient. The weights per step and
    each optimizer's skipped steps and last norm."""
    from commpress.frontends.sharded_optimizer import ShardedOptimizer, step_together

    data, model = _data(), _model()
    options = dict(max_grad_norm=0.05, bucket_numel=5_000, lr=1e-2)
    if split:
        blocks = list(model.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in model.parameters() if id(p) not in ids]
        opts = [ShardedOptimizer(rest, torch.optim.AdamW, "none", **options),
                ShardedOptimizer(blocks, torch.optim.AdamW, "none", **options)]
    else:
        opts = [ShardedOptimizer(model, torch.optim.AdamW, "none", **options)]
    weights = []
    for step in range(3):
        x, y = _local_batch(data, step, rank, world)
        _, loss = model(x, y)
        poison = (model.blocks[-1].mlp.out.weight.register_hook(lambda g: g * float("nan"))
                  if step == poison_step and rank == 1 else None)
        loss.backward()
        if poison is not None:
            poison.remove()
        step_together(opts) if split else opts[0].step()
        for opt in opts:
            opt.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights, [(o.skipped_steps, o.last_grad_norm) for o in opts]
