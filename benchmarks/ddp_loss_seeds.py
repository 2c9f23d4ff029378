"""Validation loss of the DDP hooks over several seeds (the testbed table has one).

    python benchmarks/ddp_loss_seeds.py [--seeds 0,1,2] [--steps 150]

Same model, data and batch as benchmarks/testbed_peers.py (gpt-3m, 4 ranks as 2 nodes
× 2, batch 8 × 128), no shaping: the loss does not depend on the link. Pairs every hook
with plain all-reduce seed by seed. Writes results/ddp_loss_seeds.md.
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

HOOKS = {  # name → (train options, policy)
    "allreduce": ({"engine": "ddp", "ddp_hook": "allreduce"}, "none"),
    "PowerSGD rank 4": ({"engine": "ddp", "ddp_hook": "powersgd:4"}, "none"),
    "commpress int2ef": ({"engine": "ddp", "ddp_hook": "commpress"}, "int2ef"),
    "commpress sdp4bit": ({"engine": "ddp", "ddp_hook": "commpress"}, "sdp4bit"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    base = TrainConfig(model="gpt-3m", batch_size=8, seq_len=128, nproc=4, ranks_per_node=2,
                       steps=args.steps, eval_every=args.steps, eval_batches=16)
    rows = []
    for name, (layout, policy) in HOOKS.items():
        for r in run_grid(f"ddp_loss_seeds_{args.steps}", base, [policy], seeds, [layout]):
            rows.append({**r, "layout": "", "policy": name})
    agg = aggregate(rows)
    ref = agg[("", "allreduce")]
    lines = ["| hook | val loss (mean ± std) | vs all-reduce | paired Δ vs all-reduce | seeds |",
             "|---|---|---|---|---|"]
    for name in HOOKS:
        a = agg[("", name)]
        paired = paired_deltas(rows, name, "", base="allreduce")
        lines.append(f"| {name} | {loss_cells(a, ref, paired)} | {a['n']} |")
    write_markdown(f"ddp_loss_seeds_{args.steps}.md", lines)


if __name__ == "__main__":
    main()
