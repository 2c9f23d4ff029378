"""The convergence guard: does it catch a codec too aggressive for the model, and what
does it cost a healthy one?

    python benchmarks/guard.py [--steps 200] [--seeds 0,1] [--model gpt-1m] [--fresh]

4 ranks as 2 nodes × 2 (``commpress train``, the sharded optimizer, Gloo), global batch
16 × 128 bytes of text the tests never read (torch's ``_inductor`` Python sources).
Rows: ``none`` (exact); ``naive-int2`` (``benchmarks/naive_int2.yaml``: int2 gradients
without Hadamard or error feedback) and ``naive-topk`` (``benchmarks/naive_topk.yaml``:
top-k 1 % without error feedback), each unguarded and guarded; ``sdp4bit`` unguarded and
guarded. The guard: ``max_rel_error=0.3,window=3,every=10``; ``fast-guard``:
``window=2,every=5``. Columns: validation loss at
the end (mean ± sample std over the seeds), its gap to ``none``, the guard's promotions
(how many, at which steps, to what), median step time, and gradient bits per element.
Writes ``benchmarks/results/guard.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch
from _common import RESULTS, grid_config, write_markdown

from commpress.train.loop import train

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(os.path.dirname(torch.__file__), "_inductor")
GUARD = "max_rel_error=0.3,window=3,every=10"
FAST = "max_rel_error=0.3,window=2,every=5"  # sampled twice as often, decided sooner
ROWS = {"none": ("none", None),
        "naive-int2": (os.path.join(HERE, "naive_int2.yaml"), None),
        "naive-int2+guard": (os.path.join(HERE, "naive_int2.yaml"), GUARD),
        "naive-topk": (os.path.join(HERE, "naive_topk.yaml"), None),
        "naive-topk+guard": (os.path.join(HERE, "naive_topk.yaml"), GUARD),
        "naive-topk+fast-guard": (os.path.join(HERE, "naive_topk.yaml"), FAST),
        "sdp4bit": ("sdp4bit", None),
        "sdp4bit+guard": ("sdp4bit", GUARD),
        "sdp4bit+fast-guard": ("sdp4bit", FAST)}


def run(args, row: str, seed: int) -> dict:
    policy, guard = ROWS[row]
    base = grid_config(args, 4)
    out = os.path.join("runs", "bench", "guard", f"{row}-s{seed}")
    cfg = dataclasses.replace(base, policy=policy, guard=guard, seed=seed, out=out,
                              progress=False)
    summary = train(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    promoted = [(r["step"], e["bucket"], e["to"].split("=")[1].split(":")[0])
                for r in records for g in r.get("guard", []) for e in g["promoted"]]
    return {"val": summary["final_val_loss"], "step_s": summary["step_time_s_median"],
            "bits": summary["bits_per_elem"], "promoted": promoted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    # what grid_config reads
    args.ranks_per_node, args.eval_batches, args.dtype = 2, 16, "fp32"
    args.data, args.batch_size, args.seq_len, args.bucket_numel = DATA, 16, 128, 1 << 18
    cache_path = os.path.join(RESULTS, "guard.json")
    cache = {} if args.fresh or not os.path.exists(cache_path) else json.load(open(cache_path))
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = args.rows.split(",")
    for row in rows:
        for seed in seeds:
            key = f"{args.model}|{args.steps}|{row}|{seed}"
            if key not in cache:
                print(f"[guard] {key}", flush=True)
                cache[key] = run(args, row, seed)
                os.makedirs(RESULTS, exist_ok=True)
                with open(cache_path, "w") as f:
                    json.dump(cache, f, indent=1)
    ref = statistics.mean(cache[f"{args.model}|{args.steps}|none|{s}"]["val"] for s in seeds)
    lines = [f"# The convergence guard ({args.model}, 4 ranks as 2 × 2, {args.steps} steps, "
             f"seeds {args.seeds}, guard {GUARD}, fast {FAST})", "",
             "| row | val loss | gap to none | promotions (step: bucket → codec), seed "
             f"{seeds[0]} | per seed | step ms | dp.grad bits |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        got = [cache[f"{args.model}|{args.steps}|{row}|{s}"] for s in seeds]
        vals = [g["val"] for g in got]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        first = ", ".join(f"{s}: b{b} → {c}" for s, b, c in got[0]["promoted"]) or "none"
        bits = {k: round(v, 2) for k, v in got[0]["bits"].items() if k.startswith("dp.grad")}
        lines.append(f"| {row} | {statistics.mean(vals):.4f} ± {sd:.4f} | "
                     f"{statistics.mean(vals) / ref - 1:+.2%} | {first} | "
                     f"{[len(g['promoted']) for g in got]} | "
                     f"{1e3 * statistics.median(g['step_s'] for g in got):.0f} | {bits} |")
    write_markdown("guard.md", lines)


if __name__ == "__main__":
    main()
