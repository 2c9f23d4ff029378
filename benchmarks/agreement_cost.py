"""What the per-call agreement costs, and what a replayed call saves: on Gloo over
loopback, the exact (``none``) and ``int8`` all-reduce beside torch's own.

    python benchmarks/agreement_cost.py [--calls 200] [--ranks 2,4]

For each rank count: the median time of one agreement (32-byte all-gather), and of an
all-reduce of 1 Ki and 1 Mi fp32 elements three ways — torch's uncompressed
``all_reduce``; commpress's, agreed per call (a header each, as any direct call); and
commpress's as a front-end's bucket replays it after the first step (no header:
``GroupContext.allow_replay``). The calls of one size alternate, so machine load hits
them alike. Writes benchmarks/results/agreement_cost.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _common import write_markdown

import commpress
from commpress.collectives.agreement import allow_replay
from commpress.collectives.group_context import context, replayable
from commpress.launch import spawn

SIZES = (1 << 10, 1 << 20)
WAYS = ("torch", "agreed", "replayed")


def measure(rank: int, world: int, calls: int, codecs: list[str]) -> dict:
    torch.set_num_threads(1)
    ctx = context(dist.group.WORLD)
    times = {"agree": []}
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        ctx.agree("probe", label="cost", numel=1)
        times["agree"].append(time.perf_counter() - t0)
    replaying = {}  # a front-end's group per codec: its step is [start, bucket]
    for codec in codecs:
        replaying[codec] = dist.new_group(list(range(world)))
        allow_replay(replaying[codec])
    start = torch.zeros(1)
    for numel in SIZES:
        x = torch.randn(numel)
        for codec in codecs:
            for way in WAYS:
                times[f"{codec} {way} {numel}"] = []
        for _ in range(calls):
            for codec in codecs:
                for way in WAYS:
                    if way == "torch" and codec != "none":
                        continue
                    if way == "replayed":  # a step: its first call carries the header
                        with replayable("start"):
                            commpress.all_reduce(start, "none", group=replaying[codec])
                    dist.barrier()
                    t0 = time.perf_counter()
                    if way == "torch":
                        dist.all_reduce(x)
                    elif way == "agreed":
                        commpress.all_reduce(x, codec)
                    else:
                        with replayable(f"bucket {codec}"):
                            commpress.all_reduce(x, codec, group=replaying[codec])
                    times[f"{codec} {way} {numel}"].append(time.perf_counter() - t0)
                    x.div_(world)  # sums, kept in range
    assert all(context(g).replayed >= len(SIZES) * (calls - 1) for g in replaying.values())
    return {k: statistics.median(v) for k, v in times.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--codecs", default="none,int8")
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    lines = ["| ranks | elements | agreement µs | torch µs | "
             + " | ".join(f"{c} agreed µs | {c} replayed µs" for c in codecs)
             + " | none replayed / torch |",
             "|---|---|---|---|" + "---|---|" * len(codecs) + "---|"]
    for world in map(int, args.ranks.split(",")):
        r = spawn(measure, world, (args.calls, codecs), timeout=1800)[0]
        us = {k: 1e6 * v for k, v in r.items()}
        for numel in SIZES:
            cells = " | ".join(f"{us[f'{c} agreed {numel}']:.0f} | "
                               f"{us[f'{c} replayed {numel}']:.0f}" for c in codecs)
            ratio = us[f"none replayed {numel}"] / us[f"none torch {numel}"]
            lines.append(f"| {world} | {numel} | {us['agree']:.0f} | "
                         f"{us[f'none torch {numel}']:.0f} | {cells} | {ratio:.2f}x |")
            print(lines[-1], flush=True)
    write_markdown("agreement_cost.md", lines)


if __name__ == "__main__":
    main()
