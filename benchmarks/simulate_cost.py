"""What ``commpress simulate`` costs: tokens/s and peak memory, against plain training of
the same global batch in one process.

    python benchmarks/simulate_cost.py [--model gpt-1m] [--steps 12] [--device cpu]

Plays ``N`` = 1, 4, 16 ranks (nodes of 4) with ``none`` and ``sdp4bit``, each in a fresh
process; ``N = 1`` with ``none`` *is* single-process training of the global batch (no
collective, no codec). Peak memory: the process's maximum resident set on CPU,
``torch.cuda.max_memory_allocated`` on CUDA. Writes benchmarks/results/simulate_cost_<device>.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
from _common import TrainConfig, write_markdown

from commpress.launch import spawn


def measure(rank: int, world: int, cfg_dict: dict) -> dict:
    from commpress.train.run import Run

    cfg = TrainConfig(**cfg_dict).resolved()
    run = Run(cfg, played=True)
    times = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        run.train_step(step)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[2:])
    peak = (torch.cuda.max_memory_allocated() if cfg.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"tokens_per_s": cfg.batch_size * cfg.seq_len / median, "peak_MB": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--bucket-numel", type=int, default=1 << 20)
    args = ap.parse_args()
    lines = [f"{args.model}, {args.dtype}, global batch {args.batch_size} × 128 tokens, "
             f"{args.steps} steps (median of the last {args.steps - 2}), buckets of "
             f"{args.bucket_numel:,} elements, {args.device}:", "",
             "| ranks played | policy | tokens/s | vs single-process training | peak MB |",
             "|---|---|---|---|---|"]
    base = None
    for ranks in (1, 4, 16):
        for policy in ("none", "sdp4bit"):
            cfg = TrainConfig(model=args.model, steps=args.steps, nproc=ranks,
                              ranks_per_node=min(4, ranks), policy=policy, progress=False,
                              batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                              bucket_numel=args.bucket_numel,
                              out=f"runs/simulate_cost/{ranks}-{policy}")
            r = spawn(measure, 1, (cfg.to_dict(),), timeout=3600, device=args.device)[0]
            base = base or r["tokens_per_s"]
            lines.append(f"| {ranks} | {policy} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s'] / base:.0%} | {r['peak_MB']:,.0f} |")
            print(lines[-1], flush=True)
    write_markdown(f"simulate_cost_{args.device}_{args.model}_b{args.bucket_numel}.md", lines)


if __name__ == "__main__":
    main()
