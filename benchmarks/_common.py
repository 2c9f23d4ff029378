"""Shared helpers for the benchmark scripts: run a grid of trainings, cache summaries,
and aggregate over seeds (mean and sample standard deviation)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from commpress.train.config import TrainConfig, policy_slug  # noqa: E402
from commpress.train.loop import train  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def add_grid_args(ap, policies: str) -> None:
    """The options every policy grid takes (each script adds its layout and ``--dtype``)."""
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--policies", default=policies)
    ap.add_argument("--simulate", action="store_true", help="play the ranks in one process")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--data", default=None)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--bucket-numel", type=int, default=1 << 20,
                    help="elements per gradient bucket (16 Mi on a GPU: fewer, larger calls)")


def grid_config(args, nproc: int, **extra) -> TrainConfig:
    """The grid's base run from :func:`add_grid_args`' options (evaluated at the end only)."""
    return TrainConfig(model=args.model, steps=args.steps, nproc=nproc,
                       ranks_per_node=args.ranks_per_node, eval_every=0,
                       eval_batches=args.eval_batches, dtype=args.dtype, data=args.data,
                       batch_size=args.batch_size, seq_len=args.seq_len,
                       max_data_bytes=1 << 30 if args.data else 8 << 20,
                       bucket_numel=args.bucket_numel, **extra)


def run_grid(name: str, base: TrainConfig, policies: list[str], seeds: list[int],
             layouts: list[dict] | None = None, runner=train) -> list[dict]:
    """Train every (layout, policy, seed) with ``runner`` (``train`` or ``simulate``);
    reuse summaries already on disk (each is saved as soon as it finishes)."""
    os.makedirs(RESULTS, exist_ok=True)
    cache_path = os.path.join(RESULTS, f"{name}.runs.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    rows = []
    for layout in layouts or [{}]:
        for policy in policies:
            for seed in seeds:
                tag = "-".join(f"{k}{v}" for k, v in layout.items())
                key = f"{tag}|{policy}|{seed}"
                if key not in cache:
                    out = os.path.join("runs", "bench", name, tag,
                                       f"{policy_slug(policy)}-s{seed}")
                    cfg = dataclasses.replace(base, policy=policy, seed=seed, out=out,
                                              progress=False, **layout)
                    print(f"[{name}] {key}", flush=True)
                    s = runner(cfg)
                    cache[key] = {k: s[k] for k in ("final_val_loss", "step_time_s_median",
                                                    "wire_bytes", "raw_bytes",
                                                    "bits_per_elem", "skipped_steps")}
                    with open(cache_path, "w") as f:
                        json.dump(cache, f, indent=1)
                rows.append({"layout": tag, "policy": policy, "seed": seed, **cache[key]})
    return rows


def aggregate(rows: list[dict], by=("layout", "policy")) -> dict[tuple, dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in by), []).append(r)
    out = {}
    for key, rs in groups.items():
        losses = [r["final_val_loss"] for r in rs]
        out[key] = {"mean": statistics.mean(losses),
                    "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "n": len(losses), "losses": losses,
                    "step_ms": 1e3 * statistics.median(r["step_time_s_median"] for r in rs),
                    "bits": rs[0]["bits_per_elem"], "wire": rs[0]["wire_bytes"]}
    return out


def paired_deltas(rows: list[dict], policy: str, layout: str = "", base: str = "none"
                  ) -> tuple[float, float]:
    """Mean and sample std of (policy − base) validation loss over seeds run with both:
    the same seed means the same data order and initialization, so the pairing removes
    most of the seed-to-seed spread."""
    by = {(r["layout"], r["policy"], r["seed"]): r["final_val_loss"] for r in rows}
    d = [by[(layout, policy, s)] - by[(layout, base, s)] for (lay, p, s) in by
         if lay == layout and p == policy and (layout, base, s) in by]
    if not d:
        return float("nan"), float("nan")
    return statistics.mean(d), statistics.stdev(d) if len(d) > 1 else 0.0


def loss_cells(a: dict, ref: dict, paired: tuple[float, float]) -> str:
    """Table cells ``mean ± std | vs reference | paired Δ ± std`` of one aggregate."""
    d, sd = paired
    return (f"{a['mean']:.4f} ± {a['std']:.4f} | {a['mean'] / ref['mean'] - 1:+.2%} | "
            f"{d:+.4f} ± {sd:.4f}")


def write_markdown(filename: str, lines: list[str]) -> str:
    """Write ``lines`` to ``RESULTS/filename``, print them, return the text."""
    text = "\n".join(lines) + "\n"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, filename), "w") as f:
        f.write(text)
    print(text)
    return text
