"""What ``commpress simulate`` costs at another commit against this tree, interleaved.

    python benchmarks/simulate_before_after.py --before 100aa73 [--runs 3] [--steps 24]
        [--cases 4:sdp4bit,16:none]

Checks ``--before`` out into a temporary git worktree, then ``--runs`` times plays the same
run at that commit and in this tree, one after the other (gpt-1m, global batch 16 × 128,
nodes of 4 ranks, 1 Mi buckets; a fresh process on one thread each). Reports each run's
median CPU time per step (``time.process_time``, from step 4 on) — which another process
on a shared machine disturbs less than the wall clock — and its wall-clock median.
Writes benchmarks/results/simulate_before_after.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# One played run, timed; written against both training APIs, since the commit compared
# may predate the one run object (``Run``) and have ``PlayedRun`` instead.
CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from commpress.train.config import TrainConfig
ranks, policy, steps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
cfg = TrainConfig(model="gpt-1m", steps=steps, nproc=ranks, ranks_per_node=min(4, ranks),
                  policy=policy, progress=False, batch_size=16, bucket_numel=1 << 20,
                  out=out).resolved()
try:
    from commpress.train.run import Run
    run = Run(cfg, played=True)
except ImportError:
    from commpress.train.simulate import PlayedRun
    run = PlayedRun(cfg)
cpu, wall = [], []
for step in range(steps):
    c0, w0 = time.process_time(), time.perf_counter()
    run.train_step(step)
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - w0)
print(json.dumps({"cpu_ms": 1e3 * statistics.median(cpu[4:]),
                  "wall_ms": 1e3 * statistics.median(wall[4:])}))
"""


def play(src: str, ranks: int, policy: str, steps: int, out: str) -> dict[str, float]:
    """One played run with the package at ``src``: its median CPU and wall ms per step."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(ranks), policy, str(steps), out],
                          env=dict(os.environ, PYTHONPATH=src), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run at {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the commit to compare against")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cases", default="4:sdp4bit,16:none", help="ranks:policy,...")
    args = ap.parse_args()
    if args.steps < 6:
        raise SystemExit(f"--steps {args.steps} is too few: steps 4 on are timed; allowed: >= 6")
    cases = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.cases.split(",")]
    lines = [f"gpt-1m, global batch 16 × 128, {args.steps} steps, CPU and wall ms per step "
             f"(median from step 4), {args.before} against this tree, interleaved:", "",
             "| ranks played | policy | run | before CPU ms | now CPU ms | before wall ms | "
             "now wall ms |", "|---|---|---|---|---|---|---|"]
    results: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", before, args.before],
                       check=True, capture_output=True)
        try:
            for run in range(args.runs):
                for ranks, policy in cases:
                    old = play(os.path.join(before, "src"), ranks, policy, args.steps,
                               os.path.join(tmp, "out-before"))
                    new = play(os.path.join(REPO, "src"), ranks, policy, args.steps,
                               os.path.join(tmp, "out-now"))
                    results.setdefault((ranks, policy), []).append((old, new))
                    lines.append(f"| {ranks} | {policy} | {run + 1} | {old['cpu_ms']:.0f} | "
                                 f"{new['cpu_ms']:.0f} | {old['wall_ms']:.0f} | "
                                 f"{new['wall_ms']:.0f} |")
                    print(lines[-1], flush=True)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", before],
                           check=False, capture_output=True)
    lines += ["", "| ranks played | policy | median CPU ms before | now | now / before |",
              "|---|---|---|---|---|"]
    for (ranks, policy), pairs in results.items():
        old = statistics.median(o["cpu_ms"] for o, _ in pairs)
        new = statistics.median(n["cpu_ms"] for _, n in pairs)
        lines.append(f"| {ranks} | {policy} | {old:.0f} | {new:.0f} | {new / old:.2f} |")
        print(lines[-1], flush=True)
    write_markdown("simulate_before_after.md", lines)


if __name__ == "__main__":
    main()
