"""Rank functions for the agreement tests: ranks that disagree on any call."""

import hashlib
import time

import torch
import torch.distributed as dist

import commpress

CODECS = ["none", "int8", "int4:hadamard=32", "bf16"]
DTYPES = [torch.float32, torch.bfloat16]


def _data(rank, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _rel(a, b):
    den = b.double().norm().item()
    return (a.double() - b.double()).norm().item() / den if den else 0.0


def _exact_sum(x, world):
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x)
    return torch.stack([f.double() for f in full]).sum(0), full


def run_call(rank, world, collective, numel, dtype, spec, seed, topo):
    """One call of ``collective`` with this rank's arguments; returns (result, exact)."""
    x = _data(rank, numel * world, dtype, seed)
    label = f"fuzz.{collective}"
    if collective == "all_reduce":
        y = x.clone()
        commpress.all_reduce(y, spec, op="sum", label=label)
        return y, None
    if collective == "reduce_scatter":
        out = torch.empty(numel, dtype=dtype)
        commpress.reduce_scatter(out, x, spec, op="sum", label=label)
        return out, None
    if collective == "all_gather":
        shard = x[:numel]
        out = torch.empty(numel * world, dtype=dtype)
        commpress.all_gather(out, shard, spec, label=label)
        return out, None
    if collective == "hierarchical_all_reduce":
        y = x.clone()
        commpress.hierarchical_all_reduce(y, intra="none", inter=spec, topology=topo, op="sum",
                                          label=label)
        return y, None
    if collective == "hierarchical_reduce_scatter":
        out = torch.empty(numel, dtype=dtype)
        commpress.hierarchical_reduce_scatter(out, x, intra="int8", inter=spec, topology=topo,
                                              op="sum", label=label)
        return out, None
    raise AssertionError(collective)


def reference(rank, world, collective, numel, dtype, seed):
    """The exact result of an agreed call (fp64), computed with torch's collectives."""
    x = _data(rank, numel * world, dtype, seed)
    if collective in ("all_reduce", "hierarchical_all_reduce"):
        return _exact_sum(x, world)[0]
    if collective in ("reduce_scatter", "hierarchical_reduce_scatter"):
        return _exact_sum(x, world)[0].view(world, numel)[rank]
    shard = x[:numel]
    return torch.cat([f.double() for f in _exact_sum(shard, world)[1]])


def fuzz_calls(rank, world, calls):
    """Each call: (collective, numel, dtype index, codec index, per-rank deviation).

    A deviation (None, or ("numel"|"dtype"|"codec", value) for this rank) makes the
    ranks disagree. Returns, per call, what happened on this rank: ("mismatch", message)
    or ("ok", relative error, digest, codec round-trip error).
    """
    topo = commpress.Topology(2)
    out = []
    for i, (collective, numel, dt, cd, deviations) in enumerate(calls):
        dtype, spec = DTYPES[dt], CODECS[cd]
        mine = deviations[rank]
        n = numel + (mine[1] if mine and mine[0] == "numel" else 0)
        d = DTYPES[mine[1]] if mine and mine[0] == "dtype" else dtype
        s = CODECS[mine[1]] if mine and mine[0] == "codec" else spec
        try:
            result, _ = run_call(rank, world, collective, n, d, s, i, topo)
        except commpress.CollectiveMismatchError as e:
            out.append(("mismatch", str(e)))
            continue
        exact = reference(rank, world, collective, numel, dtype, i)
        c = commpress.codec(spec)
        x = _data(rank, numel * world, dtype, i)
        single = _rel(c.decode(c.encode(x)), x)
        digest = hashlib.sha256(result.double().numpy().tobytes()).hexdigest()
        out.append(("ok", _rel(result, exact), digest, single))
    return out


def later_calls_disagree(rank, world, cases):
    """For each (collective, field): two agreeing calls, then one where rank 1 deviates
    in ``field``. Returns the outcome of every call ("ok" or the error message); the
    group must keep working after each refused call."""
    topo = commpress.Topology(2)
    outcomes = []
    for collective, field in cases:
        for i in range(3):
            numel, dtype, spec = 256, torch.float32, "int8"
            if i == 2 and rank == 1:
                numel, dtype, spec = {"numel": (300, dtype, spec),
                                      "dtype": (numel, torch.bfloat16, spec),
                                      "codec": (numel, dtype, "int4")}[field]
            try:
                run_call(rank, world, collective, numel, dtype, spec, i, topo)
                outcomes.append("ok")
            except commpress.CollectiveMismatchError as e:
                outcomes.append(str(e))
    return outcomes


def skipped_call(rank, world):
    """Rank 2 skips the second call of label "a" and goes on to label "b"."""
    x = torch.ones(64)
    labels = ["a", "a", "b"] if rank != 2 else ["a", "b"]
    try:
        for label in labels:
            commpress.all_reduce(x, "int8", label=label)
    except commpress.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def long_labels(rank, world, length):
    """Labels equal in their first ``length`` characters, differing after."""
    label = "x" * length + str(rank % 2)
    try:
        commpress.all_reduce(torch.ones(16), "int8", label=label)
    except commpress.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def p2p_disagrees(rank, world, field):
    """Rank 0 sends, rank 1 receives something else; both must raise, rank 1's tensor
    stays as it was; then a matching transfer still works."""
    sent = torch.arange(128, dtype=torch.float32)
    spec, numel, dtype = "int8", 128, torch.float32
    result = {}
    if rank == 0:
        try:
            commpress.send(sent, 1, spec, label="act")
            result["first"] = "no error"
        except commpress.CollectiveMismatchError as e:
            result["first"] = str(e)
        commpress.send(sent, 1, "none", label="act")
        return result
    if field == "codec":
        spec = "int4"
    elif field == "numel":
        numel = 130
    elif field == "dtype":
        dtype = torch.bfloat16
    buf = torch.full((numel,), 7.0, dtype=dtype)
    try:
        commpress.recv(buf, 0, spec, label="act")
        result["first"] = "no error"
    except commpress.CollectiveMismatchError as e:
        result["first"] = str(e)
    result["untouched"] = bool((buf == 7.0).all())
    again = torch.empty(128)
    commpress.recv(again, 0, "none", label="act")
    result["second_equal"] = torch.equal(again, sent)
    return result


def one_rank_never_comes(rank, world):
    """Rank 2 never calls; the others must be told who is missing within the timeout."""
    if rank == 2:
        time.sleep(12)
        return "absent"
    t0 = time.monotonic()
    try:
        commpress.all_reduce(torch.ones(8), "int8", label="lonely")
    except commpress.CollectiveTimeoutError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test reports what else happened
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None}


def agreement_cost(rank, world, numel, calls):
    """Median seconds of one agreement exchange and of a small all-reduce, per call."""
    import statistics

    from commpress.collectives.group_context import context

    ctx = context(dist.group.WORLD)
    x = torch.randn(numel)
    agree, whole = [], []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        ctx.agree("probe", label="cost", numel=numel)
        agree.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        commpress.all_reduce(x, "int8", label="cost")
        whole.append(time.perf_counter() - t0)
    return {"agree_s": statistics.median(agree), "all_reduce_s": statistics.median(whole)}


def fuzz_p2p(rank, world, transfers):
    """A ring of transfers (rank r sends to r + 1); each: (numel, dtype index, codec
    index, per-rank receive deviation). Returns per transfer (send outcome, receive
    outcome, receiver untouched or equal to the sender's decoded values)."""
    out = []
    src, dst = (rank - 1) % world, (rank + 1) % world
    for i, (numel, dt, cd, deviations) in enumerate(transfers):
        dtype, spec = DTYPES[dt], CODECS[cd]
        sent = _data(rank, numel, dtype, 100 + i)
        mine = deviations[rank]
        n = numel + (mine[1] if mine and mine[0] == "numel" else 0)
        d = DTYPES[mine[1]] if mine and mine[0] == "dtype" else dtype
        s = CODECS[mine[1]] if mine and mine[0] == "codec" else spec
        buf = torch.full((n,), 7.0, dtype=d)
        recv_outcome = send_outcome = "ok"
        sending = commpress.isend(sent, dst, spec, label="ring")
        try:
            receiving = commpress.irecv(buf, src, s, label="ring")
        except commpress.CollectiveMismatchError:
            recv_outcome, receiving = "mismatch", None
        try:
            sending.wait()
        except commpress.CollectiveMismatchError:
            send_outcome = "mismatch"
        if receiving is not None:
            receiving.wait()
            c = commpress.codec(spec)
            theirs = _data(src, numel, dtype, 100 + i)
            good = torch.equal(buf, c.decode(c.encode(theirs)))
        else:
            good = bool((buf == 7.0).all())
        out.append((send_outcome, recv_outcome, good))
    return out


def mesh_disagreement(rank, world, shape, odd):
    """The ranks as a mesh of ``shape`` (row-major), a group along each axis; rank ``odd``
    alone agrees on another value, then all agree → this rank's two outcomes."""
    import itertools

    import numpy as np

    from commpress.collectives.agreement import agree_across

    grid = np.arange(world).reshape(shape)
    mine = []
    for axis in range(len(shape)):
        # every rank creates every group of the axis, in the same order
        for index in itertools.product(*(range(n) for i, n in enumerate(shape) if i != axis)):
            line = np.moveaxis(grid, axis, -1)[index].tolist()
            group = dist.new_group(line)
            if rank in line:
                mine.append((group, {"label": f"axis{axis}"}))
    out = []
    for value in ("b" if rank == odd else "a", "a"):
        try:
            agree_across("mesh", [(g, {**f, "value": value}) for g, f in mine])
            out.append("ok")
        except RuntimeError as e:
            out.append(str(e))
    return out
