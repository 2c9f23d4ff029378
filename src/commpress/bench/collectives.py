"""``commpress bench collectives``: compressed collectives next to torch's own.

Spawns ``nproc`` local Gloo ranks and times all-reduce, reduce-scatter, all-gather
and the two-level reduce-scatter for each codec, with the wire bytes that
:func:`commpress.stats` reports. On one machine over loopback the network is not the
bottleneck, so this measures the codec and protocol overhead; the testbed measures
speedups on shaped links.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

DEFAULT_CODECS = ["none", "bf16", "int8", "int4", "int4:hadamard=128", "int2"]


def _time(fn, iters: int) -> float:
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, numel: int, codecs: list[str], rpn: int | None,
            iters: int) -> list[dict]:
    import commpress

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g)
    m = numel // world
    rows = []
    for spec in codecs:
        cases = {
            "all_reduce": lambda spec=spec: commpress.all_reduce(x.clone(), spec, label="bench"),
            "reduce_scatter": lambda spec=spec: commpress.reduce_scatter(
                torch.empty(m), x[: m * world], spec, label="bench"),
            "all_gather": lambda spec=spec: commpress.all_gather(
                torch.empty(world * m), x[:m], spec, label="bench"),
        }
        for name, fn in cases.items():
            commpress.reset_stats()
            seconds = _time(fn, iters)
            s = commpress.stats()["bench"]
            rows.append({"collective": name, "codec": spec, "time_ms": 1e3 * seconds,
                         "wire_bytes_per_call": s["wire_bytes"] / s["calls"],
                         "bits_per_elem": 8 * s["wire_bytes"] / max(s["elements"], 1)})
    if rpn and 1 < rpn < world:
        topo = commpress.Topology(rpn)
        for intra, inter in [("none", "none"), ("int8:hadamard=128", "int4:hadamard=128"),
                             ("int8", "int4")]:
            commpress.reset_stats()
            seconds = _time(lambda intra=intra, inter=inter: commpress.hierarchical_reduce_scatter(
                torch.empty(m), x[: m * world], intra=intra, inter=inter, topology=topo,
                label="h"), iters)
            s = commpress.stats()
            wire = sum(v["wire_bytes"] for v in s.values()) / (iters + 1)
            rows.append({"collective": "two_level_reduce_scatter", "codec": f"{intra} / {inter}",
                         "time_ms": 1e3 * seconds, "wire_bytes_per_call": wire,
                         "bits_per_elem": {k: 8 * v["wire_bytes"] / max(v["elements"], 1)
                                           for k, v in s.items()}})
    return rows


def run_collectives_bench(nproc: int = 4, ranks_per_node: int | None = None,
                          numel: int = 1 << 20, codecs: list[str] | None = None,
                          json_path: str | None = None, iters: int = 5) -> list[dict]:
    from rich.table import Table

    from commpress.console import console
    from commpress.launch import spawn

    codecs = codecs or DEFAULT_CODECS
    with console(stderr=True).status(f"running collectives on {nproc} ranks"):
        rows = spawn(_worker, nproc, (numel, codecs, ranks_per_node, iters),
                     ranks_per_node=ranks_per_node, timeout=1800)[0]
    base = {r["collective"]: r["time_ms"] for r in rows if r["codec"] in ("none", "none / none")}
    t = Table(title=f"collectives: {nproc} Gloo ranks, {numel:,} fp32 elements per rank")
    for col in ("collective", "codec", "time ms", "vs none", "wire bytes/call", "bits/elem"):
        t.add_column(col, justify="left" if col in ("collective", "codec") else "right")
    for r in rows:
        bpe = r["bits_per_elem"]
        bpe_s = (", ".join(f"{k.split('.')[-1]} {v:.2f}" for k, v in bpe.items())
                 if isinstance(bpe, dict) else f"{bpe:.2f}")
        ref = base.get(r["collective"])
        t.add_row(r["collective"], r["codec"], f"{r['time_ms']:.1f}",
                  f"{ref / r['time_ms']:.2f}x" if ref else "-",
                  f"{r['wire_bytes_per_call']:,.0f}", bpe_s)
    console().print(t)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
