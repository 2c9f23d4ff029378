"""Per-rank functions for the ShardedOptimizer setup tests (module level: picklable)."""

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

import commpress
from tests.frontends import workers


def _net_with_frozen_weight_and_batchnorm(seed: int) -> nn.Module:
    """A frozen first layer, a BatchNorm whose running statistics have seen one batch
    drawn from ``seed``, and a trainable head."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    net[0].weight.requires_grad_(False)
    net(torch.randn(32, 8))  # train mode: the running statistics move
    return net


def _state_hashes(net: nn.Module) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
                                 .tobytes())
            .hexdigest() for name, t in net.state_dict().items()}


def init_sync_cases(rank, world, cases):
    """For each ``(init_sync, differ)``: ranks build the net from the same seed (``differ``
    None) or from their own ("seed"), or change only the frozen weight ("frozen") or a
    running statistic ("buffer") on ranks other than 0; then build the optimizer."""
    results = []
    for init_sync, differ in cases:
        net = _net_with_frozen_weight_and_batchnorm(rank if differ == "seed" else 0)
        with torch.no_grad():
            if differ == "frozen" and rank > 0:
                net[0].weight.add_(1.0)
            if differ == "buffer" and rank > 0:
                net[1].running_var.add_(1.0)
        try:
            commpress.ShardedOptimizer(net, torch.optim.SGD, "none", lr=0.1,
                                       init_sync=init_sync)
        except commpress.CollectiveMismatchError as e:
            results.append({"error": str(e)})
            continue
        results.append({"error": None, "hashes": _state_hashes(net)})
    return results


def clip_method_and_max_grad_norm(rank, world, policy, steps, max_norm):
    """The same steps clipped by ``opt.clip_grad_norm_``, by ``max_grad_norm``, by
    ``torch.nn.utils.clip_grad_norm_(model.parameters())`` and by torch's function over
    the optimizer's ``param_groups`` (Lightning's call): weight hashes after each step,
    and the norms the calls returned."""
    from tests.frontends.workers import _data, _hash_params, _local_batch, _model

    data = _data()
    out = {}
    for how in ("method", "argument", "torch", "groups"):
        model = _model()
        opt = commpress.ShardedOptimizer(
            model, torch.optim.AdamW, policy, lr=3e-3, bucket_numel=30_000,
            max_grad_norm=max_norm if how == "argument" else None)
        hashes, norms = [], []
        for step in range(steps):
            x, y = _local_batch(data, step, rank, world)
            model(x, y)[1].backward()
            if how == "method":
                norms.append(opt.clip_grad_norm_(max_norm).item())
            elif how == "torch":  # nanoGPT's and accelerate's call
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                            max_norm).item())
            elif how == "groups":  # Lightning's: the optimizer's own parameters
                grouped = [p for g in opt.param_groups for p in g["params"]]
                norms.append(torch.nn.utils.clip_grad_norm_(grouped, max_norm).item())
            opt.step()
            opt.zero_grad()
            hashes.append(_hash_params(model))
        out[how] = {"hashes": hashes, "norms": norms}
    return out


def batchnorm_buffers_after_steps(rank, world, broadcast_buffers, steps):
    """A BatchNorm net trained with each rank fed its own data: per step, the hashes of
    the buffers (running statistics) and of the whole state."""
    net = _net_with_frozen_weight_and_batchnorm(0)
    opt = commpress.ShardedOptimizer(net, torch.optim.SGD, "none", lr=0.1,
                                     broadcast_buffers=broadcast_buffers)
    buffer_names = {name for name, _ in net.named_buffers()}
    out = []
    for step in range(steps):
        torch.manual_seed(1000 * rank + step)
        net(torch.randn(16, 8) + rank).square().mean().backward()  # rank-shifted statistics
        opt.step()
        opt.zero_grad()
        hashes = _state_hashes(net)
        out.append({"buffers": {k: v for k, v in hashes.items() if k in buffer_names},
                    "state": hashes})
    return out


def scheduled_adamw(rank, world, steps):
    """``ShardedOptimizer`` (policy none) driven by torch's StepLR over ``world`` ranks:
    the weights (flat) and the learning rate the inner optimizer held at each step."""
    from tests.frontends.workers import _data, _local_batch, _model

    data = _data()
    model = _model()
    if world > 1:
        opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "none", lr=3e-3,
                                         decay_1d=True, bucket_numel=30_000)
        inner_groups = opt.optimizer.param_groups
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        inner_groups = opt.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
    lrs = []
    for step in range(steps):
        x, y = _local_batch(data, step, rank, world)
        model(x, y)[1].backward()
        lrs.append(sorted({g["lr"] for g in inner_groups}))
        opt.step()
        opt.zero_grad()
        sched.step()
    return {"lrs": lrs,
            # numpy: a tensor would travel as shared memory the exiting rank takes along
            "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()}


def ddp_wrapped_refusal(rank, world):
    """What ShardedOptimizer says of a model still wrapped in DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.frontends.workers import _model

    try:
        commpress.ShardedOptimizer(DDP(_model()), torch.optim.AdamW, "sdp4bit", lr=1e-3)
    except ValueError as e:
        return str(e)
    return None


def consolidated_refusals(rank, opt, saved):
    """What every rank says when one rank's consolidated state is broken, when the ranks
    load different ones, and when they consolidate to different ranks."""
    import copy

    out = {}
    broken = copy.deepcopy(saved)
    broken["buckets"][0]["master"] = broken["buckets"][0]["master"][:-1]
    other_step = {**saved, "steps": saved["steps"] + 1}
    for case, mine in (("broken", broken if rank == 1 else saved),
                       ("malformed", {**saved, "buckets": None} if rank == 1 else saved),
                       ("different", other_step if rank == 1 else saved)):
        try:
            opt.load_state_dict(mine, elastic=True)
            out[case] = None
        except commpress.InputError as e:
            out[case] = str(e)
    try:
        opt.consolidate_state_dict(to=rank)
        out["to"] = None
    except RuntimeError as e:
        out["to"] = str(e)
    return out


def consolidated_resume(rank, world, policy, path, first, then, load):
    """Train ``first`` steps (when ``load`` is False: then consolidate to rank 0 and save
    it to ``path``), or load ``path`` elastically and train ``then`` steps: per step the
    weight hash and the global loss."""
    from tests.frontends.workers import _data, _global_loss, _hash_params, _local_batch, _model

    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, lr=3e-3,
                                     bucket_numel=30_000)
    steps = range(first) if not load else range(first, first + then)
    out = {"hashes": [], "losses": []}
    if load:
        saved = torch.load(path, weights_only=False)
        if world == 2:
            out["refused"] = consolidated_refusals(rank, opt, saved)
        opt.load_state_dict(saved, elastic=True)
    for step in steps:
        x, y = _local_batch(data, step, rank, world)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["hashes"].append(_hash_params(model))
        out["losses"].append(_global_loss(loss, world))
    if not load:
        state = opt.consolidate_state_dict(to=0)
        assert (state is None) == (rank != 0)
        if rank == 0:
            torch.save(state, path)
        out["steps"] = opt.steps
    return out


def rank0_state_everywhere(rank, world, directory):
    """A loop that checkpoints on rank 0 alone (nanoGPT's) and loads rank 0's optimizer
    state on every rank: what each rank's ``load_state_dict`` raises."""
    data = workers._data()
    model = workers._model(seed=rank)
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "sdp4bit", lr=3e-3,
                                     bucket_numel=30_000)
    workers.train_steps(model, opt, data, rank, world, 0, 2)
    if rank == 0:
        torch.save(opt.state_dict(), f"{directory}/ckpt.pt")
    dist.barrier()
    try:
        opt.load_state_dict(torch.load(f"{directory}/ckpt.pt", weights_only=False))
    except commpress.InputError as e:
        return str(e)
    return None


def headers_per_step(rank, world, policy, steps):
    """Train ``steps`` steps over several buckets: how many calls of each step carried a
    header (the rest replayed), the bucket count, and the weights' hash after each step."""
    from commpress.collectives.group_context import context
    from tests.frontends.workers import _data, _hash_params, _local_batch, _model

    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, policy, lr=3e-3,
                                     bucket_numel=30_000)
    ctx = context(dist.group.WORLD)
    headers, hashes = [], []
    for step in range(steps):
        seq, replayed = ctx._seq, ctx.replayed
        x, y = _local_batch(data, step, rank, world)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        headers.append((ctx._seq - seq) - (ctx.replayed - replayed))
        hashes.append(_hash_params(model))
    return {"headers": headers, "buckets": len(opt.buckets), "hashes": hashes}
