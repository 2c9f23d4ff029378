"""Training across sites: DDP against DiLoCo with compressed pseudo-gradients.

    python benchmarks/diloco_sites.py [--sites 2,4] [--links 100mbit,1gbit:20ms]
        [--seeds 0,1,2] [--steps 256] [--sync-every 32] [--model gpt-3m]
        [--rows ddp-allreduce,...] [--fresh]

One rank per site by default, ``--ranks-per-site 2`` for DDP inside each site (a
namespace per site, ``tc tbf`` at the link's rate and ``netem`` delay on each site's link,
both directions: ``commpress.testbed``), Gloo, the reference GPT (``--model``), AdamW
inside each site, global batch 16 × 128 bytes split over the ranks, text the tests never
read (torch's ``_inductor`` Python sources, 8 MB).

Rows (``ROWS``): DDP with torch's all-reduce and with commpress's ``int2ef`` hook (the
trainer's ``--engine ddp``); DiLoCo (``--outer``) with each outer preset, H =
``--sync-every``, each with its preset's outer step (Nesterov SGD lr 0.7 momentum 0.9;
``diloco-sparse`` lr 1, no momentum) and the rows named for another, and streaming (4
fragments, delay 2) for two of them; ``local`` never syncs (``sync_every`` past the last
step): the compute floor.

Every row computes the same bits whatever the link, so loss is a property of (row, seed,
steps): it is measured once per seed without shaping (``--steps`` steps, loopback,
validation loss at the end), and each link only times ``--time-steps`` steps (a multiple
of H, so that the syncs are in them; DDP rows ``--ddp-time-steps``). Columns: seconds
per inner step (mean over the timed steps after two, syncs included), compute
utilization (``local``'s seconds per step ÷ the row's), bytes between sites per inner
step and site (commpress's counters of the labels that cross sites; the testbed's link
counters beside them), validation loss at equal tokens (mean ± sample std over the
seeds), and training loss at equal wall time (each row's loss curve placed on the link's
seconds per step, read at the wall time the fastest row needs for all its steps; mean
over the seeds of the mean training loss of the 8 steps before that time).

Writes ``benchmarks/results/diloco_sites.{json,md,png}``; finished runs are cached in
the JSON (``--fresh`` starts over). Needs root and iproute2 for the timing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402
from _common import write_markdown  # noqa: E402

from commpress.testbed import run_on_testbed  # noqa: E402
from commpress.train.config import TrainConfig  # noqa: E402
from commpress.train.loop import train  # noqa: E402

RESULTS = os.path.join(HERE, "results")
DATA = os.path.join(os.path.dirname(torch.__file__), "_inductor")
WARMUP = 2
WINDOW = 8  # steps averaged for the loss at equal wall time
STREAMING = {"fragments": 4, "outer_delay": 2}
ROWS: dict[str, dict] = {
    "ddp-allreduce": {"ddp_hook": "allreduce"},
    "ddp-int2ef": {"ddp_hook": "commpress", "policy": "int2ef"},
    "diloco": {"outer": "diloco"},
    "diloco-avg": {"outer": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0},  # local SGD
    "diloco-int8": {"outer": "diloco-int8"},
    "diloco-int4": {"outer": "diloco-int4"},
    "diloco-int2ef": {"outer": "diloco-int2ef"},
    "diloco-sparse": {"outer": "diloco-sparse"},
    "diloco-topk": {"outer": "diloco-topk"},  # the former sparse preset: top-k 2 %, fp32
    # the sparse preset without its error feedback's decay, and with 8-bit values
    "diloco-sparse-nodecay": {"outer": os.path.join(HERE, "diloco_sparse_nodecay.yaml"),
                              "outer_lr": 1.0, "outer_momentum": 0.0},
    "diloco-sparse-8bit": {"outer": os.path.join(HERE, "diloco_sparse_8bit.yaml"),
                           "outer_lr": 1.0, "outer_momentum": 0.0},
    # the sparse preset under other outer steps than its own (lr 1, no momentum)
    "diloco-sparse-lr07": {"outer": "diloco-sparse", "outer_lr": 0.7},
    "diloco-sparse-nesterov": {"outer": "diloco-sparse", "outer_lr": 0.7,
                               "outer_momentum": 0.9},
    "diloco-int2ef-h128": {"outer": os.path.join(HERE, "diloco_int2ef_h128.yaml")},
    "diloco-int4-streaming": {"outer": "diloco-int4", **STREAMING},
    "diloco-int2ef-streaming": {"outer": "diloco-int2ef", **STREAMING},
    "diloco-sparse-streaming": {"outer": "diloco-sparse", **STREAMING},
    "local": {"outer": "diloco", "local": True},
}


def config(args, row: str, sites: int, steps: int, seed: int, out: str,
           per_site: int = 1) -> TrainConfig:
    options = dict(ROWS[row])
    local = options.pop("local", False)
    if "outer" in options:  # DDP inside a site: exact (nothing to send with one rank)
        options = {"ddp_hook": "allreduce", "policy": "none", "sync_every": args.sync_every,
                   **options}
        if local:
            options["sync_every"] = steps + 1
    return TrainConfig(engine="ddp", model=args.model, steps=steps, nproc=sites * per_site,
                       ranks_per_node=per_site, batch_size=16, seq_len=128, eval_every=0,
                       eval_batches=args.eval_batches if steps == args.steps else 1,
                       data=DATA, max_data_bytes=8 << 20, seed=seed, out=out,
                       progress=False, warmup=min(30, steps // 4), **options)


def history(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def crossing_bytes(summary: dict) -> float:
    """Bytes of every rank's labels that cross sites (one rank per site: all of DDP's
    gradient traffic, all of DiLoCo's outer traffic)."""
    return sum(v for label, v in summary["wire_bytes"].items()
               if label.startswith(("dp.grad", "outer.grad")))


def loss_run(args, row: str, seed: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"diloco-{row}-s{seed}-")
    s = train(config(args, row, args.loss_sites, args.steps, seed, out))
    return {"val_loss": s["final_val_loss"], "losses": [r["loss"] for r in history(out)],
            "bytes_per_step_site": crossing_bytes(s) / args.steps / args.loss_sites}


def time_run(args, row: str, sites: int, link: str) -> dict:
    rate, _, delay = link.partition(":")
    out = tempfile.mkdtemp(prefix=f"diloco-time-{row}-")
    # DDP's steps are all alike: a few time it; DiLoCo's must include their syncs
    steps = args.time_steps if "outer" in ROWS[row] else args.ddp_time_steps
    cfg = config(args, row, sites, steps, 0, out, args.ranks_per_site)
    flags = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in ("ranks_per_node", "nproc", "progress") or value is None:
            continue
        flags.append(f"--{f.name.replace('_', '-')}={value}")
    links = os.path.join(out, "links.json")
    code = run_on_testbed(sites, args.ranks_per_site, ["train", *flags, "--no-progress"], rate,
                          delay or None, link_stats=links)
    if code:
        raise RuntimeError(f"{row} on {sites} sites at {link}: the testbed run failed")
    hist = history(out)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(links) as f:
        node0 = json.load(f)["nodes"][0]
    timed = hist[WARMUP:]
    seconds = (timed[-1]["wall_s"] - hist[WARMUP - 1]["wall_s"]) / len(timed)
    return {"s_per_step": seconds, "steps": steps,
            "bytes_per_step_site": crossing_bytes(summary) / steps / sites,
            "link_mb_node0": (node0["sent_bytes"] + node0["received_bytes"]) / 1e6,
            "link_sent_node0": node0["sent_bytes"],
            "load_average": os.getloadavg()[0]}


def time_key(args, sites: int, link: str, row: str) -> str:
    per_site = f"|x{args.ranks_per_site}" if args.ranks_per_site > 1 else ""
    return f"time|{sites}{per_site}|{link}|{row}"


def equal_time_loss(losses_by_seed: list[list[float]], s_per_step: float, t: float) -> float:
    step = min(int(t / s_per_step), len(losses_by_seed[0]))
    return statistics.mean(statistics.mean(ls[max(0, step - WINDOW):max(step, 1)])
                           for ls in losses_by_seed)


def report(args, cache: dict, rows: list[str]) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = [f"# DiLoCo across sites ({args.model}, {args.steps} steps, H = {args.sync_every}, "
             f"seeds {args.seeds})", ""]
    for sites in [int(s) for s in args.sites.split(",")]:
        for link in args.links.split(","):
            timing = {r: cache.get(time_key(args, sites, link, r)) for r in rows}
            if not all(timing.values()):
                continue
            fastest = min(t["s_per_step"] for r, t in timing.items() if r != "local")
            t_equal = fastest * args.steps
            rate, _, delay = link.partition(":")
            lines += [f"## {sites} sites of {args.ranks_per_site} rank(s), {rate} per site's link, "
                      f"{delay + ' added delay' if delay else 'no added delay'}", "",
                      "| row | s / inner step | compute utilization | bytes / step / site "
                      "(link MB, node 0) | val loss at equal tokens | train loss at "
                      f"{t_equal:.0f} s |", "|---|---|---|---|---|---|"]
            floor = timing["local"]["s_per_step"]
            for r in rows:
                t = timing[r]
                losses = [cache[f"loss|{r}|{s}"] for s in seeds if f"loss|{r}|{s}" in cache]
                val = [x["val_loss"] for x in losses]
                val_cell = (f"{statistics.mean(val):.4f} ± {statistics.stdev(val):.4f}"
                            if len(val) > 1 else "-")
                curves = [x["losses"] for x in losses]
                at_t = (f"{equal_time_loss(curves, t['s_per_step'], t_equal):.4f}"
                        if losses else "-")
                utilization = 100 * floor / t["s_per_step"]
                per_step = t["bytes_per_step_site"]
                if args.ranks_per_site > 1:  # counters mix the site's own traffic in: the
                    # link's, less the start-up that the never-syncing row sends too
                    per_step = ((t["link_sent_node0"] - timing["local"]["link_sent_node0"])
                                / t["steps"])
                sent = f"{per_step / 1e3:,.1f} kB ({t['link_mb_node0']:.1f})"
                lines.append(f"| {r} | {t['s_per_step']:.3f} | {utilization:.1f} % | {sent} "
                             f"| {val_cell} | {at_t} |")
            lines.append("")
    lines += loss_table(args, cache, rows, seeds)
    write_markdown(f"{args.name}.md", lines)
    plot(args, cache, rows, seeds)


def loss_table(args, cache: dict, rows: list[str], seeds: list[int]) -> list[str]:
    """Validation loss at equal tokens per row (mean ± sample std over the seeds it ran)
    and its gap to exact DiLoCo paired by seed (mean ± standard error)."""
    val = {r: {s: cache[f"loss|{r}|{s}"]["val_loss"] for s in seeds
               if f"loss|{r}|{s}" in cache} for r in rows}
    val = {r: v for r, v in val.items() if v}
    if not val:
        return []
    lines = [f"## Validation loss at equal tokens ({args.loss_sites} sites)", "",
             "| row | seeds | val loss | gap to `diloco`, paired by seed | bytes / step / site |",
             "|---|---|---|---|---|"]
    base = val.get("diloco", {})
    for r, v in val.items():
        spread = f" ± {statistics.stdev(v.values()):.4f}" if len(v) > 1 else ""
        gaps = [100 * (v[s] / base[s] - 1) for s in v if s in base]
        gap = "-" if r == "diloco" or not gaps else f"{statistics.mean(gaps):+.2f} %" + (
            f" ± {statistics.stdev(gaps) / len(gaps) ** 0.5:.2f}" if len(gaps) > 1 else "")
        sent = statistics.mean(cache[f"loss|{r}|{s}"]["bytes_per_step_site"] for s in v)
        lines.append(f"| {r} | {','.join(map(str, v))} | {statistics.mean(v.values()):.4f}"
                     f"{spread} | {gap} | {sent / 1e3:,.1f} kB |")
    return lines + [""]


def plot(args, cache: dict, rows: list[str], seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(cache.get(time_key(args, int(n), link, r)) for n in args.sites.split(",")
               for link in args.links.split(",") for r in rows):
        return  # loss only: the table says it; the plot's axes are wall time and bytes
    if not any(f"loss|{r}|{s}" in cache for r in rows for s in seeds):
        return  # timing only: no curves to plot
    sites, link = args.sites.split(",")[0], args.links.split(",")[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        runs = [cache.get(f"loss|{r}|{s}") for s in seeds]
        t = cache.get(time_key(args, int(sites), link, r))
        if r == "local" or not all(runs) or t is None:
            continue
        mean = [statistics.mean(v) for v in zip(*(x["losses"] for x in runs))]
        steps = range(1, len(mean) + 1)
        axes[0].plot([s * t["s_per_step"] for s in steps], mean, lw=1, label=r)
        axes[1].plot([s * runs[0]["bytes_per_step_site"] / 1e6 for s in steps], mean, lw=1,
                     label=r)
    axes[0].set(xscale="log", xlabel=f"wall time (s), {sites} sites at {link}",
                ylabel="train loss", title="loss vs wall time")
    axes[1].set(xscale="log", xlabel="MB sent between sites per site",
                ylabel="train loss", title="loss vs bytes")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{args.name}.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", default="2,4")
    ap.add_argument("--loss-sites", type=int, default=2, help="sites of the loss runs")
    ap.add_argument("--ranks-per-site", type=int, default=1,
                    help="ranks per site (timing runs): DDP inside a site, the outer "
                         "all-reduce (or DDP's) across")
    ap.add_argument("--links", default="100mbit,1gbit",
                    help="RATE[:DELAY] per site's link; DELAY needs the kernel's netem")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--time-steps", type=int, default=66, help="timed steps (2 + 2·H)")
    ap.add_argument("--ddp-time-steps", type=int, default=12, help="timed steps of DDP rows")
    ap.add_argument("--sync-every", type=int, default=32)
    ap.add_argument("--model", default="gpt-3m")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--no-loss", action="store_true", help="time only")
    ap.add_argument("--no-time", action="store_true", help="loss only (no root needed)")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--name", default="diloco_sites", help="results/NAME.{json,md,png}")
    args = ap.parse_args()
    rows = args.rows.split(",")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{args.name}.json")
    cache = {} if args.fresh or not os.path.exists(path) else json.load(open(path))
    jobs = []
    if not args.no_loss:
        jobs += [(f"loss|{r}|{s}", lambda r=r, s=int(s): loss_run(args, r, s))
                 for s in args.seeds.split(",") for r in rows if r != "local"]
    if not args.no_time:
        jobs += [(time_key(args, int(n), link, r), lambda r=r, n=int(n), link=link:
                  time_run(args, r, n, link))
                 for n in args.sites.split(",") for link in args.links.split(",")
                 for r in rows]
    for key, job in jobs:
        if key in cache:
            continue
        print(f"[diloco_sites] {key}", flush=True)
        cache[key] = job()
        with open(path, "w") as f:
            json.dump(cache, f, indent=1)
    report(args, cache, rows)


if __name__ == "__main__":
    main()
