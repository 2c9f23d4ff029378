"""How long a new connection to torch's store server takes: what each parent group that
makes sub-groups pays once (``commpress.collectives.subgroups.store_client``).

    python benchmarks/store_connections.py [--ranks 1,4] [--connections 60,40]

For each number of ranks, each rank opens that many new clients of the default store one
after another (``Store.clone()``, as commpress does) and keeps them; the table gives the
median and the connections that took over 0.5 s. Writes
benchmarks/results/store_connections.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist
from _common import write_markdown

from commpress.launch import spawn


def connect(rank: int, world: int, count: int) -> list[float]:
    store = dist.distributed_c10d._world.pg_map[dist.distributed_c10d._get_default_group()][1]
    kept, seconds = [], []
    for _ in range(count):
        t0 = time.perf_counter()
        kept.append(store.clone())
        seconds.append(time.perf_counter() - t0)
    dist.barrier()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,4")
    ap.add_argument("--connections", default="60,40", help="per rank, one per --ranks")
    args = ap.parse_args()
    lines = ["| ranks | connections | median ms | over 0.5 s | their mean s |",
             "|---|---|---|---|---|"]
    for ranks, count in zip(map(int, args.ranks.split(",")),
                            map(int, args.connections.split(",")), strict=True):
        every = [s for r in spawn(connect, ranks, (count,), timeout=600) for s in r]
        slow = [s for s in every if s > 0.5]
        lines.append(f"| {ranks} | {len(every)} | {1000 * statistics.median(every):.2f} | "
                     f"{len(slow)} | {statistics.mean(slow) if slow else 0:.2f} |")
    write_markdown("store_connections.md", lines)


if __name__ == "__main__":
    main()
