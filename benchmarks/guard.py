"""The convergence guard: does it catch a codec too aggressive for the model, and what
does it cost a healthy one?

    python benchmarks/guard.py [--steps 500] [--seeds 0,1,2] [--model gpt-1m] [--fresh]

4 ranks as 2 nodes × 2 (``commpress train``, the sharded optimizer, Gloo), global batch
16 × 128 bytes of text the tests never read (torch's ``_inductor`` Python sources).
Rows, each unguarded and guarded: ``naive-topk`` (``benchmarks/naive_topk.yaml``: top-k
1 % without error feedback), ``topk-ef`` (``benchmarks/topk_ef.yaml``: the same with error
feedback), the healthy presets ``int2ef`` and ``sdp4bit``, and the hybrid paper's
``naive`` (int4 everywhere: gradients without Hadamard, the weights themselves); ``none``
(exact) and ``hybrid`` for reference. The guard: ``max_rel_error=0.3,window=3,every=10``
with the defaults ``max_memory_ratio=4``, ``max_weight_gap=0.05``; ``strict``:
``max_rel_error=0.1`` and ``max_memory_ratio=2``. Columns: validation
loss at the end (mean ± sample std over the seeds), its gap to ``none``, the guard's
promotions (at which steps, to what), median step time, and bits per element. Writes
``benchmarks/results/guard.{json,md}`` and the guarded ``naive-topk``'s loss plot of the
first seed (``guard_naive_topk_s<seed>.png``, promotions marked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics

import torch
from _common import RESULTS, grid_config, write_markdown

from commpress.train.loop import train

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(os.path.dirname(torch.__file__), "_inductor")
GUARD = "max_rel_error=0.3,window=3,every=10"
STRICT = "max_rel_error=0.1,window=3,every=10,max_memory_ratio=2"  # tighter budgets
NAIVE_TOPK = os.path.join(HERE, "naive_topk.yaml")
TOPK_EF = os.path.join(HERE, "topk_ef.yaml")
ROWS = {"none": ("none", None),
        "naive-topk": (NAIVE_TOPK, None), "naive-topk+guard": (NAIVE_TOPK, GUARD),
        "naive-topk+strict": (NAIVE_TOPK, STRICT),
        "topk-ef": (TOPK_EF, None), "topk-ef+guard": (TOPK_EF, GUARD),
        "topk-ef+strict": (TOPK_EF, STRICT),
        "int2ef": ("int2ef", None), "int2ef+guard": ("int2ef", GUARD),
        "int2ef+strict": ("int2ef", STRICT),
        "sdp4bit": ("sdp4bit", None), "sdp4bit+guard": ("sdp4bit", GUARD),
        "naive": ("naive", None), "naive+guard": ("naive", GUARD),
        "naive+strict": ("naive", STRICT),
        "hybrid": ("hybrid", None)}


def run(args, row: str, seed: int) -> dict:
    policy, guard = ROWS[row]
    base = grid_config(args, 4)
    out = os.path.join("runs", "bench", "guard", f"{row}-s{seed}")
    cfg = dataclasses.replace(base, policy=policy, guard=guard, seed=seed, out=out,
                              progress=False)
    summary = train(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    promoted = [(r["step"], e["bucket"], e.get("kind", "dp.grad"),
                 e["to"].split("=")[1].split(":")[0])
                for r in records for g in r.get("guard", []) for e in g["promoted"]]
    if row == "naive-topk+guard" and seed == args.plot_seed:
        shutil.copy(os.path.join(out, "loss.png"),
                    os.path.join(RESULTS, f"guard_naive_topk_s{seed}.png"))
    return {"val": summary["final_val_loss"], "step_s": summary["step_time_s_median"],
            "bits": summary["bits_per_elem"], "promoted": promoted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--table", action="store_true",
                    help="only the table, of the rows and seeds the cache holds")
    args = ap.parse_args()
    # what grid_config reads
    args.ranks_per_node, args.eval_batches, args.dtype = 2, 16, "fp32"
    args.data, args.batch_size, args.seq_len, args.bucket_numel = DATA, 16, 128, 1 << 18
    cache_path = os.path.join(RESULTS, "guard.json")
    cache = {} if args.fresh or not os.path.exists(cache_path) else json.load(open(cache_path))
    seeds = [int(s) for s in args.seeds.split(",")]
    args.plot_seed = seeds[0]
    rows = args.rows.split(",")
    for row in rows:
        for seed in seeds:
            key = f"{args.model}|{args.steps}|{row}|{seed}"
            if key not in cache and not args.table:
                print(f"[guard] {key}", flush=True)
                cache[key] = run(args, row, seed)
                os.makedirs(RESULTS, exist_ok=True)
                with open(cache_path, "w") as f:
                    json.dump(cache, f, indent=1)
    def runs(row: str) -> dict[int, dict]:
        return {s: cache[k] for s in seeds
                if (k := f"{args.model}|{args.steps}|{row}|{s}") in cache}

    ref = {s: r["val"] for s, r in runs("none").items()}
    lines = [f"# The convergence guard ({args.model}, 4 ranks as 2 × 2, {args.steps} steps, "
             f"seeds {args.seeds}, guard {GUARD}, strict {STRICT})", "",
             "| row | val loss | gap to none (paired, ± std) | promotions (step: buckets, "
             f"rules → codec), seed {seeds[0]} | promotions per seed | step ms | bits per "
             "element |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        by_seed = runs(row)
        if not by_seed:
            continue
        got = list(by_seed.values())
        vals = [g["val"] for g in got]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        gaps = [g["val"] / ref[s] - 1 for s, g in by_seed.items()]
        gap_sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        first = "; ".join(f"{s}: {summary}" for s, summary in _steps(got[0]["promoted"])) or "none"
        bits = {k: round(v, 2) for k, v in got[0]["bits"].items() if k.startswith("dp.")}
        lines.append(f"| {row} | {statistics.mean(vals):.4f} ± {sd:.4f} | "
                     f"{statistics.mean(gaps):+.2%} ± {gap_sd:.2%} | {first} | "
                     f"{[len(g['promoted']) for g in got]} | "
                     f"{1e3 * statistics.median(g['step_s'] for g in got):.0f} | {bits} |")
    write_markdown("guard.md", lines)


def _steps(promoted: list) -> list[tuple[int, str]]:
    """Promotions by step: ``(step, "3 dp.grad → int4, 1 dp.param → int8")``."""
    by_step: dict[int, dict[tuple[str, str], int]] = {}
    for step, _, kind, codec in promoted:
        counts = by_step.setdefault(step, {})
        counts[(kind, codec)] = counts.get((kind, codec), 0) + 1
    return [(step, ", ".join(f"{n} {kind} → {codec}" for (kind, codec), n in c.items()))
            for step, c in sorted(by_step.items())]


if __name__ == "__main__":
    main()
