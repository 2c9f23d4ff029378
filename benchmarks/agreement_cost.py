"""What the per-call agreement costs: one header exchange, next to the collectives it
guards, on Gloo over loopback.

    python benchmarks/agreement_cost.py [--calls 200]

For 2 and 4 ranks: the median time of one agreement (32-byte all-gather), of an
``int8`` all-reduce of 1 Ki and 1 Mi fp32 elements (each includes its own agreement),
and of torch's uncompressed all-reduce of the same size. Writes
benchmarks/results/agreement_cost.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _common import write_markdown

import commpress
from commpress.collectives.group_context import context
from commpress.launch import spawn


def _median(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rank: int, world: int, calls: int) -> dict:
    torch.set_num_threads(1)
    ctx = context(dist.group.WORLD)
    out = {"agree": _median(lambda: ctx.agree("probe", label="cost", numel=1), calls)}
    for numel in (1 << 10, 1 << 20):
        x = torch.randn(numel)
        out[f"int8 {numel}"] = _median(lambda x=x: commpress.all_reduce(x, "int8"), calls)
        out[f"torch {numel}"] = _median(lambda x=x: dist.all_reduce(x), calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    lines = ["| ranks | agreement µs | int8 all-reduce 1 Ki µs | torch all-reduce 1 Ki µs "
             "| int8 all-reduce 1 Mi µs | torch all-reduce 1 Mi µs |",
             "|---|---|---|---|---|---|"]
    for world in (2, 4):
        r = spawn(measure, world, (args.calls,), timeout=900)[0]
        us = {k: 1e6 * v for k, v in r.items()}
        lines.append(f"| {world} | {us['agree']:.0f} | {us['int8 1024']:.0f} | "
                     f"{us['torch 1024']:.0f} | {us['int8 1048576']:.0f} | "
                     f"{us['torch 1048576']:.0f} |")
    write_markdown("agreement_cost.md", lines)


if __name__ == "__main__":
    main()
