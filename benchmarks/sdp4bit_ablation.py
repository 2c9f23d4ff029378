"""SDP4Bit ablation: every policy over seeds, next to the paper's Table 1.

    python benchmarks/sdp4bit_ablation.py [--steps 300] [--seeds 0,1,2]
    python benchmarks/sdp4bit_ablation.py --simulate --model gpt-125m --ranks 16 \
        --ranks-per-node 8 --dtype bf16 --data DIR --steps 400 --seeds 0

Real ranks: 2 nodes × 2 (CPU, Gloo). ``--simulate``: one process plays ``--ranks`` ranks
(``commpress simulate``; on a GPU, the paper's scale of model). Writes
benchmarks/results/sdp4bit_ablation_<model>_<steps>[_sim<ranks>].md; each finished run is
saved as it ends, so an interrupted run keeps its rows.
"""

from __future__ import annotations

import argparse

from _common import (
    add_grid_args,
    aggregate,
    grid_config,
    loss_cells,
    paired_deltas,
    run_grid,
    train,
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
    add_grid_args(ap, ",".join(POLICIES))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = args.policies.split(",")
    base = grid_config(args, args.ranks, dp=args.ranks)
    name = f"sdp4bit_ablation_{args.model}_{args.steps}"
    if args.simulate:
        from commpress.train.simulate import simulate

        name += f"_sim{args.ranks}"
    rows = run_grid(name, base, policies, seeds,
                    runner=simulate if args.simulate else train)
    agg = aggregate(rows, by=("policy",))
    none = agg[("none",)]
    how = "played in one process" if args.simulate else "real ranks"
    lines = [f"{args.model}, {args.dtype}, {args.steps} steps, {args.ranks} ranks in nodes of "
             f"{args.ranks_per_node} ({how}), seeds {args.seeds}; validation loss over "
             f"{args.eval_batches} batches:", "",
             "| policy | val loss (mean ± std) | vs none | paired Δ vs none (mean ± std) | "
             "paper 125M | paper 350M | wire bits/elem |", "|---|---|---|---|---|---|---|"]
    for p in policies:
        a = agg[(p,)]
        bits = ", ".join(f"{k} {v:.2f}" for k, v in sorted(a["bits"].items()))
        paper = [f"{PAPER[size][p]:.4f}" if p in PAPER[size] else "-" for size in PAPER]
        lines.append(f"| {p} | {loss_cells(a, none, paired_deltas(rows, p))} | "
                     f"{' | '.join(paper)} | {bits} |")
    write_markdown(f"{name}.md", lines)


if __name__ == "__main__":
    main()
