"""How long ``commpress.launch.spawn`` takes to start ranks and get their results.

    python benchmarks/launch_cost.py [--repeats 3]

For 2 and 4 ranks, the wall time of a launch whose ranks join the process group, pass
one barrier and return: with the function in an imported module (the ranks fork from
the server that imported torch once; the first launch starts that server) and with the
function in the launching script itself (fresh interpreters, ``spawn``, each importing
torch). Writes benchmarks/results/launch_cost.md.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch.distributed as dist
from _common import write_markdown

from commpress.launch import spawn


def barrier(rank: int, world: int) -> int:
    dist.barrier()
    return rank


def _timed(fn, ranks: int) -> float:
    t0 = time.perf_counter()
    spawn(fn, ranks)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    imported = importlib.import_module("launch_cost").barrier  # this file, as a module
    rows = [["first launch (starts the fork server), 2 ranks", f"{_timed(imported, 2):.2f}"]]
    for ranks in (2, 4):
        for name, fn in (("forked from the server", imported),
                         ("fresh interpreters (function in __main__)", barrier)):
            t = statistics.median(_timed(fn, ranks) for _ in range(args.repeats))
            rows.append([f"{name}, {ranks} ranks", f"{t:.2f}"])
    write_markdown("launch_cost.md", ["| launch | wall s (median) |", "|---|---|",
                                      *(f"| {a} | {b} |" for a, b in rows)])


if __name__ == "__main__":
    main()
