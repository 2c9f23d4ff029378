"""What ``commpress simulate`` costs at another commit against this tree, interleaved.

    python benchmarks/simulate_before_after.py --before 100aa73 [--runs 3] [--steps 24]
        [--cases 4:sdp4bit,16:none] [--together] [--no-malloc-trim]

Checks ``--before`` out into a temporary git worktree, then ``--runs`` times plays the same
run at that commit and in this tree, one after the other (gpt-1m, global batch 16 × 128,
nodes of 4 ranks, 1 Mi buckets; a fresh process on one thread each). Reports each run's
median CPU time per step (``time.process_time``, from step 4 on) — which another process
on a shared machine disturbs less than the wall clock — its wall-clock median and its
median count of minor page faults per step.

``--together`` runs the two commits at the same time, each pinned to its own core (the
cores swapped from run to run), so both see the same moments of a noisy machine.
``--no-malloc-trim`` sets glibc's mmap and trim thresholds so high that freed memory is
never handed back to the kernel: then no step pays page faults for memory it allocates
again, which on its own moves a run's CPU time by up to ±20 % at random.
Writes benchmarks/results/simulate_before_after_<before>_<cases>[_together][_no_trim].md.
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
import json, os, resource, statistics, sys, time
import torch
torch.set_num_threads(1)
from commpress.train.config import TrainConfig
ranks, policy, steps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
if int(sys.argv[5]) >= 0:
    os.sched_setaffinity(0, {int(sys.argv[5])})
cfg = TrainConfig(model="gpt-1m", steps=steps, nproc=ranks, ranks_per_node=min(4, ranks),
                  policy=policy, progress=False, batch_size=16, bucket_numel=1 << 20,
                  out=out).resolved()
try:
    from commpress.train.run import Run
    run = Run(cfg, played=True)
except ImportError:
    from commpress.train.simulate import PlayedRun
    run = PlayedRun(cfg)
cpu, wall, faults = [], [], []
for step in range(steps):
    c0, w0 = time.process_time(), time.perf_counter()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run.train_step(step)
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - w0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"cpu_ms": 1e3 * statistics.median(cpu[4:]),
                  "wall_ms": 1e3 * statistics.median(wall[4:]),
                  "faults": statistics.median(faults[4:])}))
"""


# glibc keeps freed memory for reuse instead of unmapping it (4 GiB, 64 GiB)
NO_TRIM = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def start(src: str, ranks: int, policy: str, steps: int, out: str, core: int,
          env: dict[str, str]) -> subprocess.Popen:
    """One played run with the package at ``src``, on ``core`` (-1: any)."""
    return subprocess.Popen([sys.executable, "-c", CHILD, str(ranks), policy, str(steps), out,
                             str(core)], env=dict(os.environ, PYTHONPATH=src, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(child: subprocess.Popen, src: str) -> dict[str, float]:
    """A run's median CPU ms, wall ms and page faults per step."""
    stdout, stderr = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"the run at {src} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the commit to compare against")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cases", default="4:sdp4bit,16:none", help="ranks:policy,...")
    ap.add_argument("--together", action="store_true",
                    help="run both commits at once, each on its own core")
    ap.add_argument("--no-malloc-trim", action="store_true",
                    help="glibc never returns freed memory to the kernel (no page faults)")
    args = ap.parse_args()
    if args.together and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--together needs two cores; this process may use "
                         f"{len(os.sched_getaffinity(0))}")
    env = NO_TRIM if args.no_malloc_trim else {}
    if args.steps < 6:
        raise SystemExit(f"--steps {args.steps} is too few: steps 4 on are timed; allowed: >= 6")
    cases = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.cases.split(",")]
    how = ("at the same time on cores 0 and 1, swapped each run" if args.together
           else "one after the other")
    lines = [f"gpt-1m, global batch 16 × 128, {args.steps} steps, CPU and wall ms and minor "
             f"page faults per step (median from step 4), {args.before} against this tree, "
             f"{how}{'; glibc never trims' if args.no_malloc_trim else ''}:", "",
             "| ranks played | policy | run | before CPU ms | now CPU ms | before wall ms | "
             "now wall ms | before faults | now faults |", "|---|---|---|---|---|---|---|---|---|"]
    results: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", before, args.before],
                       check=True, capture_output=True)
        sides = [(os.path.join(before, "src"), os.path.join(tmp, "out-before")),
                 (os.path.join(REPO, "src"), os.path.join(tmp, "out-now"))]
        try:
            for run in range(args.runs):
                for ranks, policy in cases:
                    if args.together:
                        cores = (run % 2, 1 - run % 2)
                        children = [start(src, ranks, policy, args.steps, out, core, env)
                                    for (src, out), core in zip(sides, cores)]
                        old, new = [result(c, src) for c, (src, _) in zip(children, sides)]
                    else:
                        old, new = [result(start(src, ranks, policy, args.steps, out, -1, env),
                                           src) for src, out in sides]
                    results.setdefault((ranks, policy), []).append((old, new))
                    lines.append(f"| {ranks} | {policy} | {run + 1} | {old['cpu_ms']:.0f} | "
                                 f"{new['cpu_ms']:.0f} | {old['wall_ms']:.0f} | "
                                 f"{new['wall_ms']:.0f} | {old['faults']:.0f} | "
                                 f"{new['faults']:.0f} |")
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
    cases_name = "_".join(f"{ranks}{policy}" for ranks, policy in cases)
    write_markdown(f"simulate_before_after_{args.before}_{cases_name}"
                   + ("_together" if args.together else "")
                   + ("_no_trim" if args.no_malloc_trim else "") + ".md", lines)


if __name__ == "__main__":
    main()
