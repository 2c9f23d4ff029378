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
from tests.frontends import workers

H = 4


def _hash(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
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
    """Sites that disagree on H or on a codec's options (refused at construction), and a
    NaN on one site before a sync (the outer step skipped on every rank, training goes on)."""
    data = workers._data()
    out = {}
    try:
        _build(rank, {"sync_every": H if rank == 0 else 2 * H})
        out["disagree"] = None
    except commpress.CollectiveMismatchError as e:
        out["disagree"] = str(e)
    try:  # sites on other options of one codec
        _build(rank, {"policy": {"name": "sparse", "outer": {"grad": {"intra": "none", "inter": {
            "codec": f"chunktopk:k={64 if rank == 0 else 32}", "error_feedback": True,
            "decay": 0.95}}}}})
        out["codec options"] = None
    except commpress.CollectiveMismatchError as e:
        out["codec options"] = str(e)
    model, opt, sync = _build(rank, {"policy": "diloco-int4", "topology": Topology(1)})
    out["nan"] = _steps(model, opt, sync, data, rank, world, 0, 3 * H, nan_at=(H - 1, 1))
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    sync.remove()
    dist.barrier()
    return out


class _Said:
    """The warnings commpress's DiLoCo and its site checks log on this rank, while inside."""

    def __enter__(self):
        import logging

        self.messages = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        self.logger = logging.getLogger("commpress.frontends")
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *_):
        self.logger.removeHandler(self.handler)


def nonfinite_site(rank, world, options, steps, nan_step):
    """Rank 1's gradient goes NaN once, after ``nan_step``'s backward: its AdamW moments and
    then all its weights go non-finite. The record of every step, whether the weights end
    finite, and what each rank logged."""
    data = workers._data()
    model, opt, sync = _build(rank, {**options, "topology": Topology(1)})
    record = []
    with _Said() as said:
        for step in range(steps):
            x, y = workers._local_batch(data, step, rank, world)
            model(x, y)[1].backward()
            if (step, rank) == (nan_step, 1):
                next(model.parameters()).grad.view(-1)[0] = float("nan")
            opt.step()
            opt.zero_grad()
            record.append({"global": _hash(sync.global_weights()), "syncs": sync.syncs,
                           "skipped": sync.skipped})
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    sync.remove()
    return {"steps": record, "finite": finite, "said": said.messages}


def _named(model, name):
    return dict(model.named_parameters())[name]


def parameter_set_changes(rank, world, scenario, steps, at):
    """Change the trained parameters after inner step ``at``: ``unfreeze`` (the token
    embedding, frozen from the start), ``freeze`` (the last block's MLP weight), ``add`` (a
    new head attached to the model, random per rank, added to the optimizer). Per step:
    θ_global's and the local weights' hashes; the changed parameter's hash after each step
    and at the change."""
    data = workers._data()
    model = workers._model(seed=rank)
    name = {"unfreeze": "wte.weight", "freeze": "blocks.1.mlp.fc.weight",
            "add": "extra.weight"}[scenario]
    if scenario == "unfreeze":
        _named(model, name).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sync = commpress.DiLoCo(model, opt, sync_every=H, fragments=2, policy="diloco-int4",
                            topology=Topology(1))
    out = {"steps": [], "changed": []}
    with _Said() as said:
        for step in range(steps):
            x, y = workers._local_batch(data, step, rank, world)
            _, loss = model(x, y)
            if scenario == "add" and step > at:
                loss = loss + model.extra(model.wte.weight[:4]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == at:
                if scenario == "unfreeze":
                    _named(model, name).requires_grad_(True)
                elif scenario == "freeze":
                    _named(model, name).requires_grad_(False)
                else:
                    torch.manual_seed(1000 + rank)
                    model.extra = torch.nn.Linear(model.wte.weight.shape[1], 3,
                                                  bias=False)
                    opt.add_param_group({"params": list(model.extra.parameters())})
                out["at_change"] = _hash([_named(model, name)])
            out["steps"].append({"global": _hash(sync.global_weights()),
                                 "local": _hash(model.parameters()), "syncs": sync.syncs})
            out["changed"].append(_hash([_named(model, name)]) if step >= at else None)
    out["said"] = said.messages
    sync.remove()
    return out


def replaced_tensors(rank, world, rebuild):
    """``model.load_state_dict(..., assign=True)`` after 2 inner steps replaces every
    tensor. ``rebuild=False``: the optimizer still holds the old ones (the next sync
    refuses, on every rank). ``rebuild=True``: a new optimizer over the new tensors and
    ``sync.step()`` called by the loop; θ_global and the local weights after the sync."""
    data = workers._data()
    model = workers._model(seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sync = commpress.DiLoCo(model, None if rebuild else opt, sync_every=H,
                            policy="diloco", topology=Topology(1))
    try:
        for step in range(2 * H):
            x, y = workers._local_batch(data, step, rank, world)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            if rebuild:
                sync.step()
            if step == 1:
                model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
                if rebuild:
                    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    except commpress.InputError as e:
        sync.remove()
        return {"error": str(e)}
    result = {"error": None, "global": _hash(sync.global_weights()),
              "local": _hash(model.parameters()), "syncs": sync.syncs}
    sync.remove()
    return result


def rank0_checkpoint(rank, world, directory, how):
    """A nanoGPT-style loop: train H + 2 inner steps (off a sync boundary), checkpoint,
    then resume in a new model, optimizer and synchronizer and train on to 3 H.

    ``how``: ``"per-rank"`` — every rank saves and loads its own model, optimizer and
    DiLoCo state; ``"rank0-model"`` — rank 0's model and optimizer on every rank, each
    rank's own DiLoCo state; ``"rank0-all"`` — rank 0's everything on every rank;
    ``"rank0-elastic"`` — the same, loaded with ``elastic=True``."""
    data = workers._data()
    options = {"policy": "diloco-int2ef", "topology": Topology(1)}
    model, opt, sync = _build(rank, options)
    split = H + 2
    _steps(model, opt, sync, data, rank, world, 0, split)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sync": sync.state_dict()}
    torch.save(state, f"{directory}/rank{rank}.pt")  # the loop's own files, as nanoGPT's
    straight = _steps(model, opt, sync, data, rank, world, split, 3 * H - split)
    sync.remove()
    dist.barrier()
    mine = torch.load(f"{directory}/rank{rank}.pt", weights_only=False)
    first = torch.load(f"{directory}/rank0.pt", weights_only=False)
    source = {"per-rank": (mine, mine), "rank0-model": (first, mine)}.get(how, (first, first))
    model2, opt2, sync2 = _build(rank + 10, options)
    model2.load_state_dict(source[0]["model"])
    opt2.load_state_dict(source[0]["opt"])
    try:
        sync2.load_state_dict(source[1]["sync"], elastic=how == "rank0-elastic")
        resumed = _steps(model2, opt2, sync2, data, rank, world, split, 3 * H - split)
    except commpress.InputError as e:
        return {"error": str(e)}
    finally:
        sync2.remove()
    return {"error": None, "straight": straight, "resumed": resumed}


def ddp_and_sites(rank, world, layout):
    """DiLoCo beside DDP. ``world-ddp``: DDP over every rank, its wrapper given to DiLoCo
    with one rank per site (refused). ``world-ddp-inner``: the same, the wrapped module
    given (trains: a warning at the first sync). ``site-ddp``: DDP over each site's two
    ranks, sites of two ranks (trains)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    data = workers._data()
    model = workers._model(seed=rank)
    sites = [[0, 1], [2, 3]]
    site_groups = [dist.new_group(r) for r in sites]
    if layout == "site-ddp":
        ddp = DDP(model, process_group=site_groups[rank // 2])
        topology = Topology(2)
    else:
        ddp = DDP(model)
        topology = Topology(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with _Said() as said:
        try:
            sync = commpress.DiLoCo(model if layout == "world-ddp-inner" else ddp, opt,
                                    sync_every=H, policy="diloco-int4", topology=topology)
        except commpress.InputError as e:
            return {"error": str(e), "said": said.messages}
        for step in range(H):
            x, y = workers._local_batch(data, step, rank, world)
            ddp(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    sync.remove()
    return {"error": None, "said": said.messages, "local": _hash(model.parameters()),
            "global": _hash(sync.global_weights())}


def guarded(rank, world, options, steps):
    """``steps`` inner steps under a guarded synchronizer: per step the hashes and loss,
    the guard's events, its records and the warnings it said on this rank."""
    import logging

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    data = workers._data()
    model, opt, sync = _build(rank, options)
    records = []
    for step in range(steps):
        _steps(model, opt, sync, data, rank, world, step, 1)
        records.extend(sync.guard.take_records())
    sync.wait()
    records.extend(sync.guard.take_records())
    out = {"global": _hash(sync.global_weights()), "events": sync.guard.events,
           "records": records,
           "codecs": [repr(f.dp.policy.rules["outer.grad"]) for f in sync.fragments],
           "said": [line for line in said if "guard" in line]}
    sync.remove()
    return out
