"""``commpress bench collectives``: compressed collectives beside torch's own, in the
style of nccl-tests.

For each size, collective and codec: the median time of one call (the device
synchronized), algorithm bandwidth ``size / time`` and bus bandwidth (``algbw · 2(n−1)/n``
for all-reduce, ``· (n−1)/n`` for reduce-scatter and all-gather — what the links carry),
and the encode, decode and communication seconds per call from :func:`commpress.stats`;
the row ``torch`` is torch's uncompressed collective in the same run. ``size`` is the
bytes of one rank's full tensor (all-reduce input, reduce-scatter input, all-gather
output), as nccl-tests counts.

Runs under ``torchrun`` (this process is one rank) or spawns ``nproc`` local ranks — on
CUDA, round-robin over the visible GPUs (several ranks share one GPU over Gloo; NCCL
needs one GPU per rank). Over loopback the network is not the bottleneck: this measures
codec and protocol cost; ``commpress testbed`` measures speedups on shaped links.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from commpress.files import write_json
from commpress.validate import check_int

DEFAULT_CODECS = ["none", "bf16", "int8", "int4", "int4:hadamard=128", "int2"]
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn()`` (after one warm-up call, whose stats are dropped)."""
    import commpress

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    commpress.reset_stats()
    times = []
    for _ in range(iters):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calls(collective: str, spec: str, x: torch.Tensor, world: int):
    """The call to time: ``spec == "torch"`` is torch's own collective."""
    import commpress
    from commpress.collectives.comm import all_gather_single, reduce_scatter_single

    m = x.numel() // world
    if collective == "all_reduce":
        if spec == "torch":
            return lambda: dist.all_reduce(x.clone())
        return lambda: commpress.all_reduce(x.clone(), spec, label="bench")
    if collective == "reduce_scatter":
        out = torch.empty(m, dtype=x.dtype, device=x.device)
        if spec == "torch":
            return lambda: reduce_scatter_single(out, x[: m * world], "sum", None)
        return lambda: commpress.reduce_scatter(out, x[: m * world], spec, label="bench")
    full = torch.empty(m * world, dtype=x.dtype, device=x.device)
    if spec == "torch":
        return lambda: all_gather_single(full, x[:m], None)
    return lambda: commpress.all_gather(full, x[:m], spec, label="bench")


def measure(rank: int, world: int, sizes: list[int], codecs: list[str], iters: int,
            dtype_name: str = "float32", device_type: str = "cpu") -> list[dict]:
    """Rows for every (size, collective, codec) on this rank (rank 0's are reported)."""
    import commpress

    device = (torch.device("cuda", torch.cuda.current_device())
              if device_type == "cuda" else torch.device("cpu"))
    dtype = getattr(torch, dtype_name)
    rows = []
    for numel in sizes:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(numel, generator=g).to(device=device, dtype=dtype)
        size = numel * x.element_size()
        for collective in COLLECTIVES:
            for spec in ["torch", *codecs]:
                seconds = _time(_calls(collective, spec, x, world), device, iters)
                s = commpress.stats().get("bench", {})
                calls = max(s.get("calls", 0), 1)
                algbw = size / seconds / 1e9
                rows.append({
                    "collective": collective, "codec": spec, "size_bytes": size,
                    "time_us": 1e6 * seconds, "algbw_GBps": algbw,
                    "busbw_GBps": algbw * BUS_FACTOR[collective](world),
                    "encode_us": 1e6 * s.get("encode_s", 0) / calls,
                    "decode_us": 1e6 * s.get("decode_s", 0) / calls,
                    "comm_us": 1e6 * s.get("comm_s", 0) / calls,
                    "bits_per_elem": (8 * s["wire_bytes"] / s["elements"]
                                      if s.get("elements") else 8 * x.element_size()),
                    "world": world, "device": device.type,
                    "backend": str(dist.get_backend())})
    return rows


def run_collectives_bench(nproc: int = 4, ranks_per_node: int | None = None,
                          sizes: list[int] | None = None, codecs: list[str] | None = None,
                          json_path: str | None = None, iters: int = 5,
                          device: str = "cpu", backend: str | None = None,
                          dtype: str = "float32") -> list[dict]:
    """Measure, print the table on rank 0, write ``json_path``; returns rank 0's rows."""
    from commpress.launch import spawn

    sizes = sizes or [1 << 10, 1 << 16, 1 << 20]
    check_int("nproc", nproc, ge=1)
    check_int("ranks_per_node", ranks_per_node, ge=1, optional=True)
    check_int("iters", iters, ge=1)
    for i, size in enumerate(sizes):
        check_int(f"sizes[{i}]", size, ge=1)
    codecs = codecs or DEFAULT_CODECS
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if "RANK" in os.environ and dist.is_initialized():  # under torchrun
        rows = measure(dist.get_rank(), dist.get_world_size(), sizes, codecs, iters, dtype,
                       device)
        if dist.get_rank() != 0:
            return rows
    else:
        rows = spawn(measure, nproc, (sizes, codecs, iters, dtype, device),
                     ranks_per_node=ranks_per_node, timeout=3600, backend=backend,
                     device=device)[0]
    print_table(rows)
    if json_path:
        write_json(json_path, rows)
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.table import Table

    from commpress.console import console

    r0 = rows[0]
    t = Table(title=f"collectives: {r0['world']} ranks, {r0['backend']} on {r0['device']} "
                    "(size: bytes of one rank's full tensor; busbw: what the links carry)")
    for col in ("size", "collective", "codec", "time µs", "algbw GB/s", "busbw GB/s",
                "vs torch", "encode µs", "decode µs", "comm µs", "bits/elem"):
        t.add_column(col, justify="left" if col in ("collective", "codec") else "right")
    base = {(r["size_bytes"], r["collective"]): r["time_us"] for r in rows
            if r["codec"] == "torch"}
    for r in rows:
        ref = base[(r["size_bytes"], r["collective"])]
        t.add_row(f"{r['size_bytes']:,}", r["collective"], r["codec"], f"{r['time_us']:,.0f}",
                  f"{r['algbw_GBps']:.2f}", f"{r['busbw_GBps']:.2f}",
                  f"{ref / r['time_us']:.2f}x", f"{r['encode_us']:,.0f}",
                  f"{r['decode_us']:,.0f}", f"{r['comm_us']:,.0f}", f"{r['bits_per_elem']:.2f}")
    console().print(t)
