"""Which of the four expert-parallel directions tolerates which bits: loss at equal tokens.

    python benchmarks/moe_ep_directions.py [--steps 150] [--seeds 0,1,2]

torchtitan's Qwen3-MoE, tiny (2 layers, dim 64, 8 experts, top-2, byte-level vocabulary),
with torchtitan's own expert parallelism over 2 Gloo ranks (EP = 2), trained with AdamW
on the torch package's own Python sources (text the tests do not use: they read the
standard library's), the last tenth held out. Rows: exact; each direction alone
(dispatch, combine, dispatch_grad, combine_grad) at int8 and at int4 after a Hadamard-128
rotation; the presets. Each row's validation loss (mean of both ranks' held-out batches)
against exact on the same seed, and the bytes each direction sent against exact's.
Writes results/moe_ep_directions.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tests.engines.torchtitan_moe_workers import qwen3_moe  # noqa: E402

import commpress  # noqa: E402
from commpress.launch import spawn  # noqa: E402
from commpress.policy import EP_KINDS  # noqa: E402
from commpress.train.data import load_tokens  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
WORLD, BATCH, SEQ, LR, VAL_BATCHES = 2, 8, 64, 3e-3, 8


def rows() -> dict[str, dict | str]:
    # exact through commpress's exchange (torchtitan's all-to-all bit for bit, counted)
    out: dict[str, dict | str] = {"exact": {"name": "exact", "ep": dict.fromkeys(EP_KINDS,
                                                                              "none")}}
    for bits, spec in (("8", "int8"), ("4", "int4:hadamard=128")):
        for kind in EP_KINDS:
            out[f"{kind} int{bits}"] = {"name": f"{kind}-{bits}", "ep": {kind: spec}}
    for preset in ("ep-fp8", "ep-int8", "ep-int4"):
        out[preset] = preset
    return out


def _batch(tokens: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, tokens.numel() - SEQ - 1, (BATCH,), generator=g)
    x = torch.stack([tokens[s:s + SEQ] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + SEQ + 1] for s in starts.tolist()])
    return x, y


def run(rank: int, world: int, policy, seed: int, steps: int) -> dict:
    tokens = load_tokens(os.path.dirname(torch.__file__), max_bytes=4 << 20)
    split = int(0.9 * tokens.numel())
    train, val = tokens[:split], tokens[split:]
    model = qwen3_moe(world, seed)
    comm = commpress.torchtitan.compress(model, policy)
    commpress.reset_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        x, y = _batch(train, g)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    stats = {k: {"raw": v["raw_bytes"], "wire": v["wire_bytes"]}
             for k, v in commpress.stats().items() if k.startswith("ep.")}
    gv = torch.Generator().manual_seed(10_000 + rank)
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item()
                    for x, y in (_batch(val, gv) for _ in range(VAL_BATCHES)))
    mean = torch.tensor([total / VAL_BATCHES])
    dist.all_reduce(mean)
    comm.remove()
    return {"val": mean.item() / world, "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(RESULTS, exist_ok=True)
    cache_path = os.path.join(RESULTS, "moe_ep_directions.runs.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    table = rows()
    for name, policy in table.items():
        for seed in seeds:
            key = f"{name}|{seed}|{args.steps}"
            if key not in cache:
                cache[key] = spawn(run, WORLD, (policy, seed, args.steps), timeout=1800)[0]
                json.dump(cache, open(cache_path, "w"), indent=1)
                print(f"{name} seed {seed}: {cache[key]['val']:.4f}", flush=True)
    lines = [f"MoE EP directions: Qwen3-MoE tiny (2 layers, dim 64, 8 experts, top-2), EP = "
             f"{WORLD}, {args.steps} steps, batch {BATCH} × {SEQ} per rank, seeds {seeds}",
             "", "| row | val loss | vs exact | paired Δ (mean ± std) | ep bytes vs exact |",
             "|---|---|---|---|---|"]
    exact = [cache[f"exact|{s}|{args.steps}"] for s in seeds]
    exact_bytes = sum(sum(v["wire"] for v in r["stats"].values()) for r in exact)
    base = statistics.mean(r["val"] for r in exact)
    for name in table:
        runs = [cache[f"{name}|{s}|{args.steps}"] for s in seeds]
        vals = [r["val"] for r in runs]
        deltas = [r["val"] - e["val"] for r, e in zip(runs, exact)]
        sent = sum(sum(v["wire"] for v in r["stats"].values()) for r in runs)
        ratio = f"{sent / exact_bytes:.3f}"
        sd = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
        lines.append(f"| {name} | {statistics.mean(vals):.4f} ± "
                     f"{statistics.stdev(vals) if len(vals) > 1 else 0:.4f} | "
                     f"{100 * (statistics.mean(vals) / base - 1):+.2f} % | "
                     f"{statistics.mean(deltas):+.4f} ± {sd:.4f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    open(os.path.join(RESULTS, "moe_ep_directions.md"), "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
