"""The measured fallback message size by message size: never much slower than the better
of exact and the preset.

    python benchmarks/fallback_sizes.py [--preset sdp4bit] [--sizes 4Ki,...,64Mi]
        [--calls 5] [--ranks 4] [--ranks-per-node 2]

For each size, three data-parallel buckets (``DPBucket``) reduce-scatter the same fp32
gradients on Gloo over loopback: exact (policy ``none``), the preset, and the preset
with ``fallback: measured``. The measured one first runs until it decides; then the
three take turns, call by call, ``--calls`` times each, and the table gives the slowest
rank's median per way, what the fallback decided, and its time against the better of
exact and the preset. Writes benchmarks/results/fallback_sizes.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _common import RESULTS  # noqa: F401 - sets sys.path to this checkout's src

from commpress.collectives import Topology
from commpress.dp import DPBucket
from commpress.launch import spawn
from commpress.policy import Policy

WAYS = ("exact", "preset", "measured")


def _numel(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def measure(rank: int, world: int, preset: str, sizes: list[int], calls: int,
            rpn: int) -> list[dict]:
    torch.set_num_threads(1)
    topology = Topology(rpn)
    rows = []
    for numel in sizes:
        policy = Policy.preset(preset)
        buckets = {"exact": DPBucket(Policy.preset("none"), topology),
                   "preset": DPBucket(policy, topology),
                   "measured": DPBucket(policy.with_fallback("measured"), topology)}
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(numel, generator=g)
        out = torch.empty(numel // world)
        choice = buckets["measured"].choices["grad"]
        while choice.decision is None:
            buckets["measured"].reduce_scatter(out, x, None)
        times = {way: [] for way in WAYS}
        for _ in range(calls):
            for way in WAYS:
                dist.barrier()
                t0 = time.perf_counter()
                buckets[way].reduce_scatter(out, x, None)
                times[way].append(time.perf_counter() - t0)
        mine = [statistics.median(times[way]) for way in WAYS]
        every = [None] * world
        dist.all_gather_object(every, mine)
        worst = {way: max(t[i] for t in every) for i, way in enumerate(WAYS)}
        rows.append({"numel": numel, **worst, "decision": choice.decision})
        if rank == 0:
            best = min(worst["exact"], worst["preset"])
            print(f"{numel}: exact {1e3 * worst['exact']:.2f} ms, preset "
                  f"{1e3 * worst['preset']:.2f}, measured {1e3 * worst['measured']:.2f} "
                  f"({choice.decision}), {worst['measured'] / best:.2f}x of the better",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="sdp4bit")
    ap.add_argument("--sizes", default="4Ki,16Ki,64Ki,256Ki,1Mi,4Mi,16Mi,64Mi")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    args = ap.parse_args()
    sizes = [_numel(s) for s in args.sizes.split(",")]
    rows = spawn(measure, args.ranks, (args.preset, sizes, args.calls, args.ranks_per_node),
                 ranks_per_node=args.ranks_per_node, timeout=3600)[0]
    lines = [f"{args.ranks} ranks ({args.ranks_per_node} per node), Gloo over loopback, "
             f"reduce-scatter of fp32 gradients, preset `{args.preset}`; slowest rank's "
             f"median of {args.calls} calls per way, taken in turns.", "",
             "| elements | exact ms | preset ms | measured ms | decided | measured / better |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        best = min(r["exact"], r["preset"])
        lines.append(f"| {r['numel']} | {1e3 * r['exact']:.2f} | {1e3 * r['preset']:.2f} | "
                     f"{1e3 * r['measured']:.2f} | {r['decision']} | "
                     f"{r['measured'] / best:.2f}x |")
    with open(f"{RESULTS}/fallback_sizes.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
