"""Host cost of the data-parallel path: how many commpress functions one DDP bucket
runs through, and the CPU time of a compressed all-reduce of a tiny tensor.

    python benchmarks/host_cost.py [--calls 200] [--out benchmarks/results/host_cost.md]

4 Gloo ranks over loopback, 2 nodes × 2 ranks. Per DDP bucket (one bucket: a
``Linear(32, 32)``, ``ddp_hook(model, "int4:hadamard=128")``, no overlap thread): the
calls into commpress's own functions on rank 0 and the switches between its files, counted
with ``sys.setprofile`` over one backward. Per call of ``commpress.all_reduce`` on 1 Ki
fp32 elements (``int4:hadamard=128`` and ``none``) and of torch's ``all_reduce``: the
median process CPU time and wall time of rank 0. Run it on two checkouts to compare
(``PYTHONPATH=<checkout>/src``): the commpress it imports is named in the output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.collectives import Topology
from commpress.launch import spawn

SPEC = "int4:hadamard=128"


def _count_bucket_calls() -> tuple[int, int, int]:
    """(calls, functions, file switches) inside commpress for one DDP bucket."""
    root = os.path.dirname(commpress.__file__)
    torch.manual_seed(0)
    model = DDP(nn.Linear(32, 32))
    state, hook = commpress.ddp_hook(model, SPEC, topology=Topology(2), overlap=False)
    model.register_comm_hook(state, hook)
    x = torch.randn(4, 32)
    model(x).sum().backward()  # warm: DDP re-buckets after its first step
    calls, functions, switches, last = 0, set(), 0, None

    def profile(frame, event, arg):
        nonlocal calls, switches, last
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        calls += 1
        functions.add((frame.f_code.co_filename, frame.f_code.co_name))
        if last is not None and frame.f_code.co_filename != last:
            switches += 1
        last = frame.f_code.co_filename

    model.zero_grad()
    sys.setprofile(profile)
    try:
        model(x).sum().backward()
    finally:
        sys.setprofile(None)
    state.remove()
    return calls, len(functions), switches


def _median_cpu_and_wall(fn, calls: int) -> tuple[float, float]:
    cpu, wall = [], []
    for _ in range(calls):
        dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def measure(rank: int, world: int, calls: int) -> dict:
    torch.set_num_threads(1)
    out = {"bucket": _count_bucket_calls()}
    x = torch.randn(1 << 10)
    for name, fn in (
            (SPEC, lambda: commpress.all_reduce(x, SPEC)),
            ("none", lambda: commpress.all_reduce(x, "none")),
            ("torch", lambda: dist.all_reduce(x))):
        for _ in range(10):  # warm
            fn()
        out[name] = _median_cpu_and_wall(fn, calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    r = spawn(measure, 4, (args.calls,), ranks_per_node=2, timeout=900)[0]
    calls, functions, switches = r["bucket"]
    lines = [f"commpress from {os.path.dirname(commpress.__file__)}", "",
             "| per DDP bucket (rank 0) | calls | functions | file switches |",
             "|---|---|---|---|",
             f"| ddp_hook {SPEC} | {calls} | {functions} | {switches} |", "",
             "| all-reduce of 1 Ki fp32, 4 ranks (rank 0) | CPU µs per call | wall µs per call |",
             "|---|---|---|"]
    for name in (SPEC, "none", "torch"):
        cpu, wall = r[name]
        what = "torch.distributed.all_reduce" if name == "torch" else f"commpress {name}"
        lines.append(f"| {what} | {1e6 * cpu:.0f} | {1e6 * wall:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
