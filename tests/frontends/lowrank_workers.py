"""Per-rank DDP runs of the low-rank hook (module level: picklable)."""

import copy
import hashlib

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.codecs import codec as build_codec
from commpress.collectives import chunks
from commpress.frontends.ddp_lowrank import LABEL, lowrank_hook
from tests.frontends import workers

HOOK = {"rank": 2, "factor_codec": "int8", "start_iter": 1, "bucket_numel": 25_000}


def _build(options):
    model = workers._model()
    ddp = DDP(model, bucket_cap_mb=0.1)
    state, hook = lowrank_hook(ddp, **{**HOOK, **options})
    ddp.register_comm_hook(state, hook)
    return model, ddp, state, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _grad_hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.grad.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _steps(model, ddp, opt, data, rank, world, start, count, nan_at=None):
    """Train; per step: parameter hash, gradient hash, whether every gradient is finite."""
    out = []
    for step in range(start, start + count):
        x, y = workers._local_batch(data, step, rank, world)
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if nan_at == (step, rank):
            loss = loss * float("nan")
        loss.backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        grads = _grad_hash(model)
        if finite:
            opt.step()
        opt.zero_grad()
        out.append({"params": workers._hash_params(model), "grads": grads, "finite": finite,
                    "loss": workers._global_loss(loss, world)})
    return out


def train(rank, world, steps, options=None, nan_at=None):
    data = workers._data()
    model, ddp, state, opt = _build(options or {})
    return _steps(model, ddp, opt, data, rank, world, 0, steps, nan_at)


def wire_bytes(rank, world, options=None, warm=0):
    """Bytes this rank counted in one compressed step (after ``warm`` compressed steps),
    and what the formula gives."""
    data = workers._data()
    options = {**HOOK, **(options or {})}
    model, ddp, state, opt = _build(options)
    start = options["start_iter"] + warm
    _steps(model, ddp, opt, data, rank, world, 0, start)
    codec = build_codec(options["factor_codec"])
    expected = sum(codec.wire_bytes(chunks.padded_chunk(codec, k))
                   for hb in state.buckets for k in hb.dp.grad.wire_elements())
    elements = state.wire_elements()
    commpress.reset_stats()
    _steps(model, ddp, opt, data, rank, world, start, 1)
    counted = sum(s["wire_bytes"] for label, s in commpress.stats().items()
                  if label.startswith(LABEL))
    numel = sum(p.numel() for p in model.parameters())
    return {"counted": counted, "expected": expected, "numel": numel, "elements": elements}


def resume(rank, world, options=None):
    """3 steps, a snapshot, 2 more steps; then a new DDP and hook from the snapshot runs
    the same 2 steps. Also loads the snapshot into a hook of another rank."""
    data = workers._data()
    model, ddp, state, opt = _build(options or {})
    _steps(model, ddp, opt, data, rank, world, 0, 3)
    snapshot = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                              "hook": state.state_dict()})
    straight = _steps(model, ddp, opt, data, rank, world, 3, 2)
    model2, ddp2, state2, opt2 = _build(options or {})
    model2.load_state_dict(snapshot["model"])
    opt2.load_state_dict(snapshot["opt"])
    state2.load_state_dict(snapshot["hook"])
    resumed = _steps(model2, ddp2, opt2, data, rank, world, 3, 2)
    _, _, other, _ = _build({**(options or {}), "rank": 3})
    try:
        other.load_state_dict(snapshot["hook"])
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"straight": straight, "resumed": resumed, "refused": refused}


def approximation_error(rank, world, factor_codec, steps=6, decades=None):
    """Warm-started power steps of one hook bucket on a fixed matrix (the same on every
    rank, the memory cleared each step): ``‖M − P Qᵀ‖ / ‖M‖`` after each step, and how
    much of each of its top ``r`` left singular directions the last ``P`` spans (1: all).
    The singular values fall from 1 to 1e-3 over 32 directions; with ``decades``, by
    that many decades over the first 30."""
    import torch.distributed as dist

    from commpress.collectives import Topology
    from commpress.frontends.ddp_lowrank import LowRankConfig, LowRankReducer

    g = torch.Generator().manual_seed(0)
    n, m, r = 768, 256, 16
    u = torch.linalg.qr(torch.randn(n, m, generator=g)).Q
    v = torch.linalg.qr(torch.randn(m, m, generator=g)).Q
    if decades is None:
        s = torch.cat([2.0 ** (-torch.arange(32) / 3), torch.full((m - 32,), 1e-3)])
    else:
        s = (10.0 ** (-decades * torch.arange(m) / 30)).clamp(min=10.0 ** -decades)
    matrix = (u * s) @ v.t()
    config = LowRankConfig(rank=r, factor_codec=factor_codec, start_iter=0)
    topology = Topology(1)
    topology.resolve(dist.group.WORLD)
    reducer = LowRankReducer([matrix.shape], [0], matrix.numel(), config, topology, 0)
    errors = []
    for _ in range(steps):
        reducer.error = None
        flat = matrix.reshape(-1).clone()
        reducer.all_reduce(flat, dist.group.WORLD)
        errors.append(float((matrix - flat.view(n, m)).norm() / matrix.norm()))
    captured = (reducer.ps[0].t() @ u[:, :r]).pow(2).sum(0)
    return {"errors": errors, "captured": captured.tolist()}


def memory_after_fixed_differences(rank, world, factor_codec, steps=12):
    """One hook bucket (a 64 × 32 matrix and a 40-element vector) for ``steps`` steps in
    which the ranks' gradients differ from their average by a fixed ``± D`` (10× the
    average): the vector part of the last memory, the share of the matrix part's norm
    inside the subspace ``P`` that was just sent, and how far the vector's averages
    summed over the steps are from ``steps`` × its true average, in int8 steps of a
    rank's input."""
    import torch.distributed as dist

    from commpress.collectives import Topology
    from commpress.frontends.ddp_lowrank import LowRankConfig, LowRankReducer

    g = torch.Generator().manual_seed(0)
    n, m, k = 64, 32, 40
    average = torch.randn(n * m + k, generator=g)
    difference = 10 * torch.randn(n * m + k, generator=g)
    config = LowRankConfig(rank=4, factor_codec=factor_codec, start_iter=0)
    topology = Topology(1)
    topology.resolve(dist.group.WORLD)
    reducer = LowRankReducer([torch.Size((n, m)), torch.Size((k,))], [0, n * m],
                             n * m + k, config, topology, 0)
    total = torch.zeros(k)
    for _ in range(steps):
        flat = average + (1 if rank == 0 else -1) * difference
        reducer.all_reduce(flat, dist.group.WORLD)
        total += flat[n * m:]
    memory = reducer.error[:n * m].view(n, m)
    inside = float((reducer.ps[0].t() @ memory).norm() / memory.norm())
    int8_step = (average + difference)[n * m:].abs().max() / 127
    drift = (total - steps * average[n * m:]).abs().max() / int8_step
    return {"vector": reducer.error[n * m:].abs().max().item(), "inside": inside,
            "drift": float(drift)}


def _error_of(run):
    """What ``run()`` raised, as ``"Type: message"`` (None if it returned)."""
    try:
        run()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def disagreeing_states(rank, world, hook):
    """Ranks whose hook state disagrees, each case on fresh DDP modules; returns the error
    each case gave on this rank (None: trained on).

    ``"seed"``: ``seed=rank`` with ``alternate``. ``"steps"``: rank 1 resumes from a state
    two steps older than rank 0's. ``"swapped"``: each rank loads the other's state.
    ``hook``: ``"lowrank"`` (alternate) or ``"int2ef"`` (``ddp_hook``)."""
    import torch.distributed as dist

    data = workers._data()

    def build(options=None):
        if hook == "lowrank":
            return _build({"alternate": True, **(options or {})})
        model = workers._model()
        ddp = DDP(model, bucket_cap_mb=0.1)
        state, fn = commpress.ddp_hook(ddp, "int2ef", bucket_numel=25_000)
        ddp.register_comm_hook(state, fn)
        return model, ddp, state, torch.optim.AdamW(model.parameters(), lr=3e-3)

    out = {}
    if hook == "lowrank":
        model, ddp, _, opt = build({"seed": rank})
        out["seed"] = _error_of(lambda: _steps(model, ddp, opt, data, rank, world, 0, 3))
    model, ddp, state, opt = build()
    _steps(model, ddp, opt, data, rank, world, 0, 2)
    older = copy.deepcopy(state.state_dict())
    _steps(model, ddp, opt, data, rank, world, 2, 2)
    newer = copy.deepcopy(state.state_dict())
    everyone = [None] * world
    dist.all_gather_object(everyone, newer)

    def resume_from(saved):
        model2, ddp2, state2, opt2 = build()
        model2.load_state_dict(model.state_dict())
        state2.load_state_dict(saved)
        _steps(model2, ddp2, opt2, data, rank, world, 4, 2)

    out["steps"] = _error_of(lambda: resume_from(older if rank == 1 else newer))
    out["swapped"] = _error_of(lambda: resume_from(everyone[(rank + 1) % world]))
    out["own"] = _error_of(lambda: resume_from(newer))
    return out
