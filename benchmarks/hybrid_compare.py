"""Hybrid compression in 3D-parallel training: policies × layouts × 3 seeds on 4 ranks.

    python benchmarks/hybrid_compare.py [--steps 300] [--seeds 0,1,2] [--dtype fp32]
        [--policies none,naive,hybrid,ccgrid,sdp4bit,zeropp] [--layouts tp,pp]
    python benchmarks/hybrid_compare.py --simulate --dp 8 --ranks-per-node 8 \
        --model gpt-125m --dtype bf16 --data <folder> --seq-len 1024 --batch-size 64

Layouts dp2 × tp2 and dp2 × pp2 on 2 nodes × 2 ranks (TP or PP inside a node, DP across
nodes). ``--simulate`` plays the data-parallel ranks (``commpress simulate``: the pp
layout in one process, the tp layout in one process per tensor-parallel slice), at any
``--dp``. Writes
benchmarks/results/hybrid_compare_<model>_<steps>[_bf16][_sim<dp>].md.
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

POLICIES = "none,naive,hybrid,ccgrid,sdp4bit,zeropp"
LAYOUTS = {"tp": {"dp": 2, "tp": 2, "pp": 1}, "pp": {"dp": 2, "tp": 1, "pp": 2}}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_grid_args(ap, POLICIES)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--layouts", default="tp,pp")
    ap.add_argument("--dp", type=int, default=2)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = args.policies.split(",")
    layouts = args.layouts.split(",")
    # both layouts are dp × 2 ranks
    base = grid_config(args, 2 * args.dp)
    name = f"hybrid_compare_{args.model}_{args.steps}" + (
        "" if args.dtype == "fp32" else f"_{args.dtype}")
    runner = train
    if args.simulate:
        from commpress.train.simulate import simulate as runner

        name += f"_sim{args.dp}"
    rows = run_grid(name, base, policies, seeds,
                    [dict(LAYOUTS[k], dp=args.dp) for k in layouts], runner=runner)
    agg = aggregate(rows)
    lines = []
    for layout in sorted({r["layout"] for r in rows}):
        none = agg[(layout, "none")]
        how = "played in one process" if args.simulate else "real ranks"
        lines += ["", f"**{layout}** ({args.model}, {args.dtype}, {args.steps} steps, seeds "
                  f"{args.seeds}, {2 * args.dp} ranks in nodes of {args.ranks_per_node}, "
                  f"{how}):", "",
                  "| policy | val loss (mean ± std) | vs none | paired Δ vs none "
                  "| step ms | wire MB dp / tp / pp (all ranks) | bits/elem |",
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
