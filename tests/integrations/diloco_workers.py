"""Per-rank runs of the DiLoCo outer synchronizer (module level: picklable).

Each rank is a site (or, with ``ranks_per_node=2``, half of one) that draws its own
batches; the ranks start from different weights, so the synchronizer's first broadcast
matters."""

import copy
import hashlib

import torch
import torch.distributed as dist

import commpress
from commpress.collectives import Topology
from tests.integrations import workers

H = 4


def _hash(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _build(rank, options, inner="adamw"):
    model = workers._model(seed=rank)
    if inner == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = commpress.DiLoCo(model, opt, **{"sync_every": H, **options})
    return model, opt, sync


def _steps(model, opt, sync, data, rank, world, start, count, nan_at=None):
    """Inner steps; per step the hashes of θ_global and of the local weights, the global
    loss, and how many syncs have been applied."""
    out = []
    for step in range(start, start + count):
        x, y = workers._local_batch(data, step, rank, world)
        _, loss = model(x, y)
        loss.backward()
        if nan_at == (step, rank):  # this site diverged: a weight is NaN before the sync
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        opt.step()  # the synchronizer's hook counts the step
        opt.zero_grad()
        out.append({"global": _hash(sync.global_weights()), "local": _hash(model.parameters()),
                    "loss": workers._global_loss(loss, world),
                    "syncs": sync.syncs, "skipped": sync.skipped})
    return out


def train(rank, world, runs, steps):
    """One training per ``(name, options)`` of ``runs``; returns each one's steps and the
    bytes each label carried."""
    data = workers._data()
    out = {}
    for name, options in runs:
        options = dict(options)
        rpn = options.pop("ranks_per_site", 1)
        model, opt, sync = _build(rank, {**options, "topology": Topology(rpn)})
        commpress.reset_stats()
        record = _steps(model, opt, sync, data, rank, world, 0, steps)
        out[name] = {"steps": record, "stats": commpress.stats(),
                     "outer step": (sync.config.outer_lr, sync.config.outer_momentum)}
        sync.remove()
    return out


def averaged_sgd(rank, world, steps):
    """H = 1, exact, outer SGD with lr 1 and no momentum over inner SGD: each sync averages
    the sites' SGD steps, which is SGD on the average gradient. The weights after each
    step (flat)."""
    data = workers._data()
    model, opt, sync = _build(rank, {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
                                     "nesterov": False, "topology": Topology(1)}, inner="sgd")
    weights = []
    for step in range(steps):
        x, y = workers._local_batch(data, step, rank, world)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    sync.remove()
    return weights


def single_process_sgd(steps, world):
    """SGD on the batches of all ``world`` ranks at once, from rank 0's weights."""
    data = workers._data()
    model = workers._model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = []
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            x, y = workers._local_batch(data, step, rank, world)
            (model(x, y)[1] / world).backward()
        opt.step()
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    return weights


def resume(rank, world, options, steps, split):
    """``steps`` uninterrupted; then a new model, optimizer and synchronizer from the
    state after ``split`` steps run the rest. Also: the state refused by a synchronizer
    of another schedule."""
    data = workers._data()
    model, opt, sync = _build(rank, options)
    _steps(model, opt, sync, data, rank, world, 0, split)
    snapshot = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                              "sync": sync.state_dict()})
    straight = _steps(model, opt, sync, data, rank, world, split, steps - split)
    sync.remove()
    model2, opt2, sync2 = _build(rank, options)
    model2.load_state_dict(snapshot["model"])
    opt2.load_state_dict(snapshot["opt"])
    sync2.load_state_dict(snapshot["sync"])
    resumed = _steps(model2, opt2, sync2, data, rank, world, split, steps - split)
    sync2.remove()
    _, _, other = _build(rank, {**options, "sync_every": 2 * H})
    try:
        other.load_state_dict(snapshot["sync"])
        refused = None
    except ValueError as e:
        refused = str(e)
    other.remove()
    return {"straight": straight, "resumed": resumed, "refused": refused,
            "pending": len(snapshot["sync"]["pending"])}


def faults(rank, world):
    """Sites that disagree on H (refused at construction), and a NaN on one site before a
    sync (the outer step skipped on every rank, training goes on)."""
    data = workers._data()
    out = {}
    try:
        _build(rank, {"sync_every": H if rank == 0 else 2 * H})
        out["disagree"] = None
    except commpress.CollectiveMismatchError as e:
        out["disagree"] = str(e)
    model, opt, sync = _build(rank, {"policy": "diloco-int4", "topology": Topology(1)})
    out["nan"] = _steps(model, opt, sync, data, rank, world, 0, 3 * H, nan_at=(H - 1, 1))
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    sync.remove()
    dist.barrier()
    return out
