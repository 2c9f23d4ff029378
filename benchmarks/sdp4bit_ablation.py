"""SDP4Bit ablation at small scale: every policy over 3 seeds on 2 nodes × 2 ranks.

    python benchmarks/sdp4bit_ablation.py [--steps 300] [--seeds 0,1,2]

Writes benchmarks/results/sdp4bit_ablation.md (the table that goes into BENCHMARKS.md)
next to the paper's numbers, and says which gaps exceed the seed spread.
"""

from __future__ import annotations

import argparse

from _common import (
    TrainConfig,
    aggregate,
    loss_cells,
    paired_deltas,
    run_grid,
    write_markdown,
)

PAPER = {  # final validation loss, GPT on the Pile (Jia et al., NeurIPS 2024, Table 2)
    "125M": {"none": 2.2939, "qw": 2.5731, "qwd": 2.2927, "tlq": 2.3048, "tlqhs": 2.2953,
             "sdp4bit": 2.2959},
    "350M": {"none": 2.0872, "qw": 2.2741, "qwd": 2.0873, "tlq": 2.0955, "tlqhs": 2.0891,
             "sdp4bit": 2.0896},
}
POLICIES = ["none", "qw", "qwd", "tlq", "tlqhs", "sdp4bit"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="gpt-1m")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    base = TrainConfig(model=args.model, steps=args.steps, nproc=4, ranks_per_node=2, dp=4,
                       eval_every=0, eval_batches=16)
    rows = run_grid(f"sdp4bit_ablation_{args.model}_{args.steps}", base, POLICIES, seeds)
    agg = aggregate(rows, by=("policy",))
    none = agg[("none",)]
    lines = [f"{args.model}, {args.steps} steps, 2 nodes × 2 ranks (dp 4), seeds {args.seeds}; "
             "validation loss over 16 batches:", "",
             "| policy | val loss (mean ± std) | vs none | paired Δ vs none (mean ± std) | "
             "paper 125M | paper 350M | wire bits/elem |", "|---|---|---|---|---|---|---|"]
    for p in POLICIES:
        a = agg[(p,)]
        bits = ", ".join(f"{k} {v:.2f}" for k, v in sorted(a["bits"].items()))
        lines.append(f"| {p} | {loss_cells(a, none, paired_deltas(rows, p))} | "
                     f"{PAPER['125M'][p]:.4f} | {PAPER['350M'][p]:.4f} | {bits} |")
    write_markdown(f"sdp4bit_ablation_{args.model}_{args.steps}.md", lines)


if __name__ == "__main__":
    main()
