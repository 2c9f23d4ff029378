"""End-to-end on the emulated cluster: commpress next to the peers users would pick.

    python benchmarks/testbed_peers.py [--loss-steps 150] [--time-steps 10]
        [--bandwidths 25mbit,50mbit,200mbit,1000mbit]

2 nodes × 2 ranks, GPT of 2.7M parameters (gpt-3m), batch 8 × 128 tokens, seed 0.
Validation loss does not depend on the link (the same bits are computed), so it is
measured on an unshaped run of --loss-steps; step time is the median of a shaped run of
--time-steps on the testbed (network namespaces, tbf in both directions) at each
bandwidth. Writes benchmarks/results/testbed_peers.{json,md}, testbed_speedup.png and
ddp_frontier.png (validation loss against step time of every DDP hook at 50 Mbit/s).
Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _common import RESULTS, TrainConfig, train, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {  # name → train options (as in `commpress train`)
    "ddp allreduce": {"engine": "ddp", "ddp_hook": "allreduce"},
    "ddp fp16_compress_hook": {"engine": "ddp", "ddp_hook": "fp16"},
    "ddp PowerSGD rank 1": {"engine": "ddp", "ddp_hook": "powersgd:1"},
    "ddp PowerSGD rank 4": {"engine": "ddp", "ddp_hook": "powersgd:4"},
    "ddp commpress sdp4bit": {"engine": "ddp", "ddp_hook": "commpress", "policy": "sdp4bit"},
    "ddp commpress int4": {"engine": "ddp", "ddp_hook": "commpress",
                           "policy": os.path.join(HERE, "ddp_int4.yaml")},
    "ddp commpress int2 bits+EF": {"engine": "ddp", "ddp_hook": "commpress",
                                   "policy": os.path.join(HERE, "ddp_int2ef.yaml")},
    "ddp commpress int2ef": {"engine": "ddp", "ddp_hook": "commpress", "policy": "int2ef"},
    "ddp commpress nf2+EF": {"engine": "ddp", "ddp_hook": "commpress",
                             "policy": os.path.join(HERE, "ddp_nf2_ef.yaml")},
    "ddp commpress sign+EF": {"engine": "ddp", "ddp_hook": "commpress",
                              "policy": os.path.join(HERE, "ddp_sign_ef.yaml")},
    "ddp commpress top1%+EF": {"engine": "ddp", "ddp_hook": "commpress",
                               "policy": os.path.join(HERE, "ddp_topk_ef.yaml")},
    "sharded none": {"policy": "none"},
    "sharded zeropp": {"policy": "zeropp"},
    "sharded sdp4bit": {"policy": "sdp4bit"},
    "3D dp2×tp2 none": {"policy": "none", "tp": 2},
    "3D dp2×tp2 naive": {"policy": "naive", "tp": 2},
    "3D dp2×tp2 hybrid": {"policy": "hybrid", "tp": 2},
}
BASE = dict(model="gpt-3m", batch_size=8, seq_len=128, nproc=4, ranks_per_node=2, seed=0,
            eval_batches=16, progress=False)


def _flags(opts: dict) -> list[str]:
    out = []
    for k, v in opts.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def shaped_step_time(name: str, opts: dict, bandwidth: str, steps: int) -> float:
    out = os.path.join("runs", "bench", "testbed", bandwidth, name.replace(" ", "_"))
    args = {k: v for k, v in {**BASE, **opts}.items() if k not in ("nproc", "ranks_per_node",
                                                                   "progress")}
    cmd = [sys.executable, "-m", "commpress.cli", "testbed", "--nodes", "2", "--ranks-per-node",
           "2", "--bandwidth", bandwidth, "--", "train", *_flags(args), "--steps", str(steps),
           "--eval-every", "0", "--eval-batches", "1", "--out", out, "--no-progress"]
    for _attempt in range(2):  # one retry: a rank can die at exit without a result
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        summary = os.path.join(out, "summary.json")
        if proc.returncode == 0 and os.path.exists(summary):
            with open(summary) as f:
                return json.load(f)["step_time_s_median"]
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loss-steps", type=int, default=150)
    ap.add_argument("--time-steps", type=int, default=10)
    ap.add_argument("--bandwidths", default="25mbit,50mbit,200mbit,1000mbit")
    ap.add_argument("--only", default=None, help="comma-separated config names")
    args = ap.parse_args()
    bws = args.bandwidths.split(",")
    path = os.path.join(RESULTS, "testbed_peers.json")
    res = json.load(open(path)) if os.path.exists(path) else {}
    names = args.only.split(",") if args.only else list(CONFIGS)
    for name in names:
        opts = CONFIGS[name]
        r = res.setdefault(name, {})
        if "val_loss" not in r:
            print(f"[loss] {name}", flush=True)
            s = train(TrainConfig(**{**BASE, **opts}, steps=args.loss_steps,
                                  eval_every=args.loss_steps,
                                  out=os.path.join("runs", "bench", "testbed", "loss",
                                                   name.replace(" ", "_"))))
            r["val_loss"], r["unshaped_step_s"] = s["final_val_loss"], s["step_time_s_median"]
            r["wire_bytes"] = s["wire_bytes"]
        for bw in bws:
            if bw not in r.setdefault("step_s", {}):
                print(f"[time] {name} @ {bw}", flush=True)
                r["step_s"][bw] = shaped_step_time(name, opts, bw, args.time_steps)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    report(res, bws)


def report(res: dict, bws: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = {name: res[name] for name in CONFIGS if name in res}  # table in CONFIGS order
    base_sharded = res.get("sharded none", {})
    base_ddp = res.get("ddp allreduce", {})
    lines = ["| configuration | val loss | vs baseline | " + " | ".join(
        f"step s @ {b}" for b in bws) + " | speedup @ 50mbit |",
        "|---|---|---|" + "---|" * len(bws) + "---|"]
    for name, r in res.items():
        base = base_ddp if name.startswith("ddp") else (
            res.get("3D dp2×tp2 none", {}) if name.startswith("3D") else base_sharded)
        vs = (f"{r['val_loss'] / base['val_loss'] - 1:+.2%}" if base.get("val_loss") else "-")
        sp = (f"{base['step_s']['50mbit'] / r['step_s']['50mbit']:.2f}x"
              if base.get("step_s", {}).get("50mbit") and r.get("step_s", {}).get("50mbit")
              else "-")
        times = " | ".join(f"{r.get('step_s', {}).get(b, float('nan')):.2f}" for b in bws)
        lines.append(f"| {name} | {r.get('val_loss', float('nan')):.4f} | {vs} | {times} | {sp} |")
    write_markdown("testbed_peers.md", lines)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mbits = [float(b.removesuffix("mbit")) for b in bws]
    for name, r in res.items():
        base = base_ddp if name.startswith("ddp") else (
            res.get("3D dp2×tp2 none", {}) if name.startswith("3D") else base_sharded)
        if name in ("ddp allreduce", "sharded none", "3D dp2×tp2 none") or not base.get("step_s"):
            continue
        sp = [base["step_s"][b] / r["step_s"][b] for b in bws if b in r.get("step_s", {})]
        if len(sp) == len(bws):
            ax.plot(mbits, sp, "o-", label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="link bandwidth per node (Mbit/s)", ylabel="speedup vs its uncompressed baseline",
           title="2 nodes × 2 ranks, gpt-3m: speedup against bandwidth")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "testbed_speedup.png"), dpi=110)
    frontier(res)


def frontier(res: dict, bw: str = "50mbit") -> None:
    """Validation loss (relative to DDP all-reduce) against step time, every DDP hook."""
    import matplotlib.pyplot as plt

    base = res.get("ddp allreduce", {}).get("val_loss")
    points = [(name, r["step_s"][bw], r["val_loss"] / base - 1) for name, r in res.items()
              if name.startswith("ddp") and base and bw in r.get("step_s", {})
              and r["val_loss"] / base - 1 < 0.2]
    if not points:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "oD^v<>phX*P"
    for i, (name, t, dl) in enumerate(sorted(points, key=lambda p: p[1])):
        peer = "PowerSGD" in name  # the peers: red squares, the lighter one rank 1
        ax.plot(t, 100 * dl, "s" if peer else markers[i % len(markers)], ms=8,
                color=("lightcoral" if "rank 1" in name else "tab:red") if peer
                else f"C{i % 10}", label=name.removeprefix("ddp "), ls="none")
    ax.legend(fontsize=7, ncol=2)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set(xlabel=f"step time at {bw} (s, log)", ylabel="val loss vs DDP all-reduce (%)",
           title="DDP hooks on 2 nodes × 2 ranks, gpt-3m: speed/loss frontier")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "ddp_frontier.png"), dpi=110)


if __name__ == "__main__":
    main()
