"""Hybrid compression in 3D-parallel training: policies × layouts × 3 seeds on 4 ranks.

    python benchmarks/hybrid_compare.py [--steps 300] [--seeds 0,1,2] [--dtype fp32]
        [--policies none,naive,hybrid,ccgrid,sdp4bit,zeropp] [--layouts tp,pp]

Layouts dp2 × tp2 and dp2 × pp2 on 2 nodes × 2 ranks (TP or PP inside a node, DP across
nodes). Writes benchmarks/results/hybrid_compare_<model>_<steps>[_bf16].md.
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

POLICIES = "none,naive,hybrid,ccgrid,sdp4bit,zeropp"
LAYOUTS = {"tp": {"dp": 2, "tp": 2, "pp": 1}, "pp": {"dp": 2, "tp": 1, "pp": 2}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--layouts", default="tp,pp")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = args.policies.split(",")
    base = TrainConfig(model=args.model, steps=args.steps, nproc=4, ranks_per_node=2,
                       eval_every=0, eval_batches=16, dtype=args.dtype)
    name = f"hybrid_compare_{args.model}_{args.steps}" + (
        "" if args.dtype == "fp32" else f"_{args.dtype}")
    rows = run_grid(name, base, policies, seeds,
                    [LAYOUTS[k] for k in args.layouts.split(",")])
    agg = aggregate(rows)
    lines = []
    for layout in sorted({r["layout"] for r in rows}):
        none = agg[(layout, "none")]
        lines += ["", f"**{layout}** ({args.model}, {args.dtype}, {args.steps} steps, seeds "
                  f"{args.seeds}, 2 nodes × 2 ranks):", "",
                  "| policy | val loss (mean ± std) | vs none | paired Δ vs none "
                  "| step ms (loopback) | wire MB dp / tp / pp (all ranks) | bits/elem |",
                  "|---|---|---|---|---|---|---|"]
        for p in policies:
            a = agg[(layout, p)]
            axes = {ax: sum(v for k, v in a["wire"].items() if k.startswith(ax)) / 1e6
                    for ax in ("dp", "tp", "pp")}
            bits = ", ".join(f"{k} {v:.2f}" for k, v in sorted(a["bits"].items()))
            lines.append(f"| {p} | {loss_cells(a, none, paired_deltas(rows, p, layout))} | "
                         f"{a['step_ms']:.0f} | "
                         f"{axes['dp']:.0f} / {axes['tp']:.0f} / {axes['pp']:.0f} | {bits} |")
    write_markdown(f"{name}.md", lines)


if __name__ == "__main__":
    main()
