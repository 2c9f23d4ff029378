"""Functions that run on every rank of a multi-process test (module level: picklable)."""

import hashlib

import torch
import torch.distributed as dist

import commpress
from commpress.collectives.comm import all_gather_single, reduce_scatter_single

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _data(rank, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _digest(t):
    raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def none_matches_torch(rank, world):
    """codec='none' through every collective equals torch's own, bit for bit."""
    out = {}
    for dtype in DTYPES:
        for numel in (1, 37, 1000):
            x = _data(rank, numel * world, dtype)
            # all_reduce
            a, b = x.clone(), x.clone()
            commpress.all_reduce(a, "none", op="sum")
            dist.all_reduce(b)
            out[("ar", dtype, numel)] = torch.equal(a, b)
            # reduce_scatter
            o1, o2 = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            commpress.reduce_scatter(o1, x, "none", op="sum")
            reduce_scatter_single(o2, x, "sum", dist.group.WORLD)
            out[("rs", dtype, numel)] = torch.equal(o1, o2)
            # all_gather
            s = _data(rank, numel, dtype, seed=1)
            g1 = torch.empty(world * numel, dtype=dtype)
            g2 = torch.empty_like(g1)
            commpress.all_gather(g1, s, "none")
            all_gather_single(g2, s, dist.group.WORLD)
            out[("ag", dtype, numel)] = torch.equal(g1, g2)
    return out


def compressed_errors(rank, world, specs, numel):
    """Relative errors of compressed collectives against the exact fp64 result, next
    to the codec's single round-trip error on this rank's data; digests of results."""
    out = {}
    for spec in specs:
        for dtype in DTYPES:
            x = _data(rank, numel, dtype, seed=3)
            full = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(full, x)
            exact = torch.stack([f.double() for f in full]).sum(0)
            c = commpress.codec(spec)
            single = _rel(c.decode(c.encode(x)).double(), x.double())
            # all_reduce (sum)
            y = x.clone()
            commpress.all_reduce(y, spec, op="sum", label=f"ar.{spec}")
            out[("ar", spec, dtype)] = (_rel(y, exact), single, _digest(y))
            # reduce_scatter (avg), numel not divisible by world × group
            m = numel // world
            o = torch.empty(m, dtype=dtype)
            commpress.reduce_scatter(o, x[: m * world], spec, op="avg")
            ex_rs = torch.stack([f[: m * world].double() for f in full]).mean(0)
            out[("rs", spec, dtype)] = (_rel(o, ex_rs.view(world, m)[rank]), single, None)
            # all_gather
            gathered = torch.empty(world * numel, dtype=dtype)
            commpress.all_gather(gathered, x, spec)
            out[("ag", spec, dtype)] = (_rel(gathered, torch.cat(full).double()), single,
                                        _digest(gathered))
    return out


def hierarchical(rank, world, ranks_per_node, numel):
    x = _data(rank, numel * world, torch.float32, seed=5)
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x)
    exact = torch.stack([f.double() for f in full]).sum(0).view(world, numel)[rank]
    commpress.reset_stats()
    topo = commpress.Topology(ranks_per_node)
    out = torch.empty(numel)
    commpress.hierarchical_reduce_scatter(out, x, intra="int8:hadamard=128",
                                          inter="int4:hadamard=128",
                                          topology=topo, op="sum", label="dp.grad")
    c = commpress.codec("int4:hadamard=128")
    single = _rel(c.decode(c.encode(x)), x)
    # the generic path (an error-feedback wrapper is not fusable) gives a comparable result
    out_generic = torch.empty(numel)
    commpress.hierarchical_reduce_scatter(
        out_generic, x, intra="int8:hadamard=128", intra_memory=commpress.ErrorFeedback(),
        inter="int4:hadamard=128", topology=topo, op="sum", label="generic")
    return {"err": _rel(out, exact), "single": single, "stats": commpress.stats(),
            "err_generic": _rel(out_generic, exact)}


def hierarchical_gather(rank, world, ranks_per_node, numel):
    """Two-level all-gather: each shard decoded once from the same bytes everywhere."""
    x = _data(rank, numel, torch.float32, seed=6)
    commpress.reset_stats()
    out = torch.empty(world * numel)
    commpress.hierarchical_all_gather(out, x, inter="int4",
                                      topology=commpress.Topology(ranks_per_node), label="g")
    # what a flat compressed all-gather decodes from the same codes
    flat = torch.empty(world * numel)
    commpress.all_gather(flat, x, "int4", label="flat")
    exact = torch.empty(world * numel)
    all_gather_single(exact, x, None)
    handle = commpress.hierarchical_all_gather(torch.empty(world * numel), x, inter="int4",
                                               topology=commpress.Topology(ranks_per_node),
                                               label="g_async", async_op=True)
    return {"digest": _digest(out), "equal_flat": torch.equal(out, flat),
            "err": _rel(out, exact), "stats": commpress.stats(),
            "async_equal": torch.equal(handle.wait(), out)}


def hierarchical_all_reduce(rank, world, ranks_per_node, numel, inter):
    x = _data(rank, numel, torch.float32, seed=7)
    exact = x.double().clone()
    dist.all_reduce(exact)
    commpress.reset_stats()
    out = x.clone()
    commpress.hierarchical_all_reduce(out, intra="none", inter=inter,
                                      topology=commpress.Topology(ranks_per_node), op="sum",
                                      label="h")
    c = commpress.codec(inter)
    return {"digest": _digest(out), "err": _rel(out, exact), "stats": commpress.stats(),
            "single": _rel(c.decode(c.encode(x)), x)}


def mismatched_shapes(rank, world, two_level=False):
    x = torch.randn(100 + rank)  # every rank a different size
    try:
        if two_level:  # ranks 0 and 1 share a node: their all-to-all would break first
            commpress.hierarchical_all_reduce(x, intra="none", inter="int4",
                                              topology=commpress.Topology(2), label="grads")
        else:
            commpress.all_reduce(x, "int4", label="grads")
    except commpress.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def variable_rate(rank, world, spec):
    x = _data(rank, 3000, torch.float32, seed=7)
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x)
    exact = torch.stack(full).sum(0)
    y = x.clone()
    commpress.all_reduce(y, spec, op="sum")
    o = torch.empty(3000 // world)
    commpress.reduce_scatter(o, x, spec, op="sum")
    g = torch.empty(world * 3000)
    commpress.all_gather(g, x, spec)
    return {"ar": _rel(y, exact), "rs": _rel(o, exact.view(world, -1)[rank]),
            "ag": _rel(g, torch.cat(full)), "digest": _digest(y)}


def async_and_p2p(rank, world):
    out = {}
    x = _data(rank, 5000, torch.float32, seed=9)
    y = x.clone()
    handle = commpress.all_reduce(y, "int8", async_op=True)
    z = x.clone()
    commpress.all_reduce(z, "int8")
    handle.wait()
    out["async_equals_sync"] = torch.equal(y, z)
    # ring of sends with every codec kind (fixed and variable rate)
    for spec in ("none", "bf16", "int4:hadamard=64", "topk:ratio=0.1", "zfp:rate=16"):
        send_t = _data(rank, 777, torch.bfloat16, seed=11)
        recv_t = torch.empty(777, dtype=torch.bfloat16)
        ops = [commpress.P2POp("send", send_t, (rank + 1) % world, spec),
               commpress.P2POp("recv", recv_t, (rank - 1) % world, spec)]
        for h in commpress.batch_isend_irecv(ops):
            h.wait()
        expected = _data((rank - 1) % world, 777, torch.bfloat16, seed=11)
        c = commpress.codec(spec)
        out[spec] = torch.equal(recv_t, c.decode(c.encode(expected)))
    return out


def error_feedback_all_reduce(rank, world):
    """An ErrorFeedback memory beside all_reduce's codec: the time-average converges to the
    mean."""
    ef = commpress.ErrorFeedback()
    x = _data(rank, 4096, torch.float32, seed=13)
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x)
    exact = torch.stack(full).mean(0)
    acc = torch.zeros_like(x)
    steps = 30
    for _ in range(steps):
        y = x.clone()
        commpress.all_reduce(y, "int2", memory=ef, label="ef")
        acc += y
    plain = x.clone()
    commpress.all_reduce(plain, "int2", label="plain")
    return {"ef": _rel(acc / steps, exact), "plain": _rel(plain, exact), "digest": _digest(acc)}


def awkward_inputs(rank, world):
    """Non-contiguous and requires-grad tensors in and out of every collective."""
    out = {}
    base = _data(rank, 8 * world * 6, torch.float32, seed=21).view(8 * world, 6)
    x = base.t()  # (6, 8·world), not contiguous
    exact = x.double().clone()
    dist.all_reduce(exact)
    for spec in ("none", "int8"):
        y = x.clone().t().contiguous().t()  # same values, non-contiguous again
        assert not y.is_contiguous()
        commpress.all_reduce(y, spec, op="sum", label=f"nc.{spec}")
        out[("all_reduce", spec)] = _rel(y, exact) < (1e-6 if spec == "none" else 0.05)
        leaf = x.contiguous().requires_grad_(True)
        commpress.all_reduce(leaf, spec, op="sum", label=f"rg.{spec}")
        out[("requires_grad", spec)] = (_rel(leaf.detach(), exact) <
                                        (1e-6 if spec == "none" else 0.05) and leaf.requires_grad)
        full = torch.empty(6, world * 6).t()  # (world·6, 6), not contiguous
        shard = x[:, :6]  # (6, 6), not contiguous
        commpress.all_gather(full, shard, spec, label=f"ag.{spec}")
        everyone = [torch.empty(36) for _ in range(world)]
        dist.all_gather(everyone, shard.reshape(-1).contiguous())
        err = _rel(full.reshape(-1), torch.cat(everyone))
        out[("all_gather", spec)] = err < (1e-7 if spec == "none" else 0.05)
        part = torch.empty(8, 6).t()  # (6, 8): this rank's piece, not contiguous
        commpress.reduce_scatter(part, x, spec, op="sum", label=f"rs.{spec}")
        mine = exact.reshape(-1).view(world, -1)[rank]
        out[("reduce_scatter", spec)] = _rel(part.reshape(-1), mine) < (
            1e-6 if spec == "none" else 0.05)
    return out


def async_inputs_reusable(rank, world, device="cpu"):
    """Every async collective: the caller overwrites and drops its input right after the
    call; the result must be that of the original input (on ``device``)."""
    out = {}
    for spec in ("none", "int8", "int4:hadamard=64"):
        x = _data(rank, 64 * world, torch.float32, seed=31).to(device)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        exact = torch.stack(everyone).double().sum(0)
        tol = {"none": 1e-6, "int8": 0.02}.get(spec, 0.3)  # int4 on 64 values: ~0.15
        # reduce_scatter
        inp = x.clone()
        part = torch.empty(64, device=device)
        h = commpress.reduce_scatter(part, inp, spec, op="sum", label="rs", async_op=True)
        inp.fill_(1e6)
        del inp
        h.wait()
        out[("reduce_scatter", spec)] = _rel(part, exact.view(world, 64)[rank]) < tol
        # all_gather
        shard = x[:64].clone()
        full = torch.empty(64 * world, device=device)
        h = commpress.all_gather(full, shard, spec, label="ag", async_op=True)
        shard.fill_(-1e6)
        del shard
        h.wait()
        expected = torch.cat([e[:64] for e in everyone])
        out[("all_gather", spec)] = _rel(full, expected) < tol
        # a send: the sender reuses its buffer at once
        if world >= 2:
            buf = x[:32].clone()
            dst, src = (rank + 1) % world, (rank - 1) % world
            sending = commpress.isend(buf, dst, spec, label="p2p")
            buf.fill_(7e5)
            got = torch.empty(32, device=device)
            commpress.recv(got, src, spec, label="p2p")
            sending.wait()
            out[("send", spec)] = _rel(got, everyone[src][:32]) < tol
    return out


def recreated_groups(rank, world):
    """Destroy every group and make new ones in the same process: the two-level
    collectives get fresh sub-groups (not the dead ones of the old world)."""
    import os
    from datetime import timedelta

    x = torch.ones(256)
    commpress.hierarchical_all_reduce(x, intra="none", inter="int8",
                                      topology=commpress.Topology(2), op="sum")
    first = x.clone()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    y = torch.ones(256)
    commpress.hierarchical_all_reduce(y, intra="none", inter="int8",
                                      topology=commpress.Topology(2), op="sum")
    group = dist.new_group(list(range(world)))
    z = torch.ones(256)
    commpress.hierarchical_all_reduce(z, intra="none", inter="int8",
                                      topology=commpress.Topology(2), group=group, op="sum")
    return {"first": bool((first == world).all()), "after": bool((y == world).all()),
            "new_group": bool((z == world).all())}


# -- played collectives (commpress simulate) against the real ones ----------------------
def _grad_codecs(grad_rule):
    from commpress.policy import Policy

    policy = Policy.from_dict({"name": "t", "dp": {"grad": grad_rule}})
    if policy.two_level():
        return {lv: policy.codec_for("dp", "grad", lv) for lv in ("intra", "inter")}
    return {"single": policy.codec_for("dp", "grad")}


def played_inputs(rank, numel, dtype, calls):
    """Rank ``rank``'s inputs of ``calls`` successive calls (codec state carries over)."""
    return [_data(rank, numel, dtype, seed=10 + c) for c in range(calls)]


def real_all_reduces(rank, world, grad_rule, numel, dtype, calls, rpn):
    """Digests of ``calls`` successive all-reduces of this rank's inputs (one-level, or
    two-level with ``rpn`` ranks per node), op avg."""
    from commpress.collectives import Topology

    codecs = _grad_codecs(grad_rule)
    out = []
    for x in played_inputs(rank, numel, dtype, calls):
        if "single" in codecs:
            commpress.all_reduce(x, codecs["single"], op="avg", label="g")
        else:
            commpress.hierarchical_all_reduce(x, intra=codecs["intra"], inter=codecs["inter"],
                                              topology=Topology(rpn), op="avg", label="g")
        out.append(_digest(x))
    return out


def _played_calls(world, grad_rule, rpn, inputs, calls, steps_of, overwrite=False):
    """Each call's ``{rank: result}`` of ``calls`` collectives played over ``inputs[r][c]``
    with ``steps_of(x, codecs, used, peers, rank)``; when ``overwrite``, each input is
    handed over as a copy that is then filled with NaN."""
    from commpress.collectives.played import Played, played_peers
    from commpress.collectives.topology import levels_used

    per_rank = [_grad_codecs(grad_rule) for _ in range(world)]
    used = levels_used("single" not in per_rank[0], world, rpn)
    for c in range(calls):
        played = Played(world, lambda r, x: steps_of(x, per_rank[r], used,
                                                     played_peers(r, world, rpn), r))
        for r in reversed(range(world)):  # any order of arrival
            x = inputs[r][c].clone() if overwrite else inputs[r][c]
            played.add(r, x)
            if overwrite:
                x.fill_(float("nan"))
        yield played.finish()


def played_all_reduces(world, grad_rule, numel, dtype, calls, rpn):
    """The same calls played in this process for ``world`` ranks."""
    from commpress.collectives.byte_stats import Stats
    from commpress.collectives.hierarchical import all_reduce_levels_steps

    inputs = [played_inputs(r, numel, dtype, calls) for r in range(world)]
    out = []
    for results in _played_calls(world, grad_rule, rpn, inputs, calls, lambda x, codecs, used,
                                 peers, r: all_reduce_levels_steps(x, codecs, used, *peers,
                                                                   Stats(), "g", "avg")):
        assert all(torch.equal(results[r], results[0]) for r in range(world))
        out.append(_digest(results[0]))
    return out


def played_reduce_scatters(world, grad_rule, m, inputs, calls, rpn, overwrite):
    """Every rank's result of ``calls`` played reduce-scatters of ``inputs[r][c]`` (each
    ``world × m``); inputs overwritten once handed over when ``overwrite``."""
    from commpress.collectives.byte_stats import Stats
    from commpress.collectives.hierarchical import reduce_scatter_levels_steps

    return [results[r] for results in _played_calls(
        world, grad_rule, rpn, inputs, calls, lambda x, codecs, used, peers, r:
        reduce_scatter_levels_steps(x, m, codecs, used, *peers, Stats(), "g", "avg", r),
        overwrite) for r in range(world)]


def real_reduce_scatter_parts(rank, world, grad_rule, sizes, calls, rpn):
    """This rank's results of ``calls`` successive reduce-scatters of uneven parts
    (``sizes[r]`` elements for rank ``r``), op sum, as lists; then what a call whose
    lengths differ on rank 0 raised."""
    from commpress.collectives import Topology

    codecs = _grad_codecs(grad_rule)
    levels = ({"codec": codecs["single"]} if "single" in codecs else
              {"intra": codecs["intra"], "inter": codecs["inter"], "topology": Topology(rpn)})
    out = []
    for x in played_inputs(rank, sum(sizes), torch.float32, calls):
        out.append(commpress.reduce_scatter_parts(list(x.split(sizes)), op="sum", label="g",
                                                  **levels).tolist())
    try:
        commpress.reduce_scatter_parts([torch.zeros(n + (rank == 0)) for n in sizes],
                                       **levels)
    except commpress.CollectiveMismatchError as e:
        return out, str(e)
    return out, None


def played_reduce_scatter_parts(world, grad_rule, sizes, calls, rpn):
    """The same calls played in this process: every call's results, by rank, as lists."""
    from commpress.collectives.byte_stats import Stats
    from commpress.collectives.hierarchical import reduce_scatter_levels_steps

    inputs = [played_inputs(r, sum(sizes), torch.float32, calls) for r in range(world)]
    return [{r: t.tolist() for r, t in results.items()} for results in _played_calls(
        world, grad_rule, rpn, inputs, calls, lambda x, codecs, used, peers, r:
        reduce_scatter_levels_steps(x, sizes, codecs, used, *peers, Stats(), "g", "sum", r))]


def near_dtype_max(rank, world, specs):
    """bf16 ±max through every collective: which results are all finite."""
    top = torch.finfo(torch.bfloat16).max
    x = torch.full((256,), top, dtype=torch.bfloat16)
    x[1::2] = -top
    out = {}
    for spec in specs:
        full = torch.empty(256 * world, dtype=torch.bfloat16)
        commpress.all_gather(full, x, spec)
        y = x.clone()
        commpress.all_reduce(y, spec, op="avg")
        part = torch.empty(256 // world, dtype=torch.bfloat16)
        commpress.reduce_scatter(part, x, spec, op="avg")
        out[spec] = {"all_gather": bool(torch.isfinite(full).all()),
                     "all_reduce": bool(torch.isfinite(y).all()),
                     "reduce_scatter": bool(torch.isfinite(part).all())}
    return out


def error_feedback_decodes_once(rank, world):
    """An all-gather with memory: its codec decodes once per call (the residual takes this
    rank's row of the gathered values), and the residual is exactly what was sent minus
    what every rank decoded of it. Ranks that disagree on having a memory are told."""
    codec = commpress.codec("int4:hadamard=128")
    decode, calls = codec.decode, []

    def counted(*args, **kwargs):
        calls.append(1)
        return decode(*args, **kwargs)

    codec.decode = counted
    memory = commpress.ErrorFeedback()
    m = 1024
    x = _data(rank, m, torch.float32, seed=31)
    out = torch.empty(world * m)
    commpress.all_gather(out, x, codec, memory=memory, label="ag")
    mine = out[rank * m:(rank + 1) * m]
    exact_residual = torch.equal(memory.residuals["ag"], x - mine)
    try:
        commpress.all_reduce(x.clone(), "int4", memory=commpress.ErrorFeedback()
                             if rank == 0 else None, label="mixed")
        told = None
    except commpress.CollectiveMismatchError as e:
        told = str(e)
    return {"decodes": len(calls), "exact_residual": exact_residual, "told": told}
