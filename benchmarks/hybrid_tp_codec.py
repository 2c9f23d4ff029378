"""Which codec should hybrid send tensor-parallel activations with? Loss at dp2 × tp2.

    python benchmarks/hybrid_tp_codec.py [--steps 300] [--seeds 0,1,2] [--dtype fp32]

Candidates: int8, fp8 (e4m3, group scales), fp8 after a Hadamard-128 rotation (as TACO
does), next to none; DP and PP as in hybrid. 2 nodes × 2 ranks, TP inside a node.
Writes benchmarks/results/hybrid_tp_codec_<model>_<steps>_<dtype>.md.
"""

from __future__ import annotations

import argparse
import os

from _common import TrainConfig, aggregate, loss_cells, paired_deltas, run_grid, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = ["none"] + [os.path.join(HERE, f"hybrid_tp_{c}.yaml") for c in
                         ("int8", "fp8", "fp8h")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    base = TrainConfig(model=args.model, steps=args.steps, nproc=4, ranks_per_node=2,
                       eval_every=0, eval_batches=16, dtype=args.dtype)
    name = f"hybrid_tp_codec_{args.model}_{args.steps}_{args.dtype}"
    layout = {"dp": 2, "tp": 2, "pp": 1}
    rows = run_grid(name, base, CANDIDATES, seeds, [layout])
    for r in rows:
        r["policy"] = os.path.splitext(os.path.basename(r["policy"]))[0]
    agg = aggregate(rows)
    tag = "dp2-tp2-pp1"
    none = agg[(tag, "none")]
    lines = [f"dp2 × tp2, {args.model}, {args.steps} steps, {args.dtype}, seeds {args.seeds}:",
             "", "| tp codec | val loss (mean ± std) | vs none | paired Δ vs none | "
             "tp bits/elem |", "|---|---|---|---|---|"]
    for p in ["none", "hybrid_tp_int8", "hybrid_tp_fp8", "hybrid_tp_fp8h"]:
        a = agg[(tag, p)]
        bits = a["bits"].get("tp.act", float("nan"))
        lines.append(f"| {p.removeprefix('hybrid_tp_')} | "
                     f"{loss_cells(a, none, paired_deltas(rows, p, tag))} | {bits:.2f} |")
    write_markdown(f"{name}.md", lines)


if __name__ == "__main__":
    main()
