"""The DDP speed–loss front: torch's hooks against commpress's on the emulated cluster.

    python benchmarks/ddp_front.py [--links 50mbit,1gbit] [--seeds 0,1,2]
        [--models gpt,torchnn] [--hooks allreduce,powersgd-r1,...] [--loss-steps 40]
        [--time-steps 6] [--fresh]

2 nodes × 2 ranks (network namespaces, ``tc tbf`` in both directions: see
``commpress.testbed``), torch DDP with the hook under test, AdamW, global batch 8 × 128
bytes, two ~3 M-parameter models: ``gpt`` (the reference trainer's GPT, gpt-3m) and
``torchnn`` (a byte-level LM of ``nn.TransformerEncoderLayer``\\ s, 3.3 M parameters).

Every hook computes the same bits whatever the link, so validation loss is a property of
(model, hook, seed, steps), not of the link: it is measured once, on the fastest link
(``--loss-steps`` steps), and the slower links only time ``--time-steps`` steps after the
same warm-up. The report checks that claim: each timing run's training losses must equal
the loss run's first steps bit for bit. Step time is the median over the timed steps of
the slowest rank's step (forward, backward with the hook, clip, AdamW); the first
``WARMUP_STEPS`` are not timed (PowerSGD reduces them exactly, as the trainer sets it).
Link MB is what crossed node 0's link per timed step (both directions).

The ranks of one (link, seed) stay up and train every (model, hook) in turn, so the
hooks of a seed are interleaved and machine load hits them alike; the load average is
printed with each row. Writes ``benchmarks/results/ddp_front.{json,md,png}``; finished
runs are cached in the JSON (``--fresh`` starts over). Needs root and iproute2, except
with ``--local`` (all ranks on loopback, no shaping: for tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from commpress.launch import set_parent_death_signal  # noqa: E402
from commpress.model.gpt import GPT, config_from_preset  # noqa: E402
from commpress.testbed import Cluster  # noqa: E402

RESULTS = os.path.join(HERE, "results")
NODES, RANKS_PER_NODE = 2, 2
WARMUP_STEPS = 2
SAME = {True: "yes", False: "NO", None: "unchecked"}
BATCH, SEQ, LR, EVAL_BATCHES = 8, 128, 3e-3, 8


@dataclass(frozen=True)
class HookSpec:
    """A DDP hook as the worker installs it. ``kind``: ``allreduce``, ``powersgd``,
    ``commpress`` (``commpress.ddp_hook`` with ``arg`` as policy), ``lowrank``
    (``commpress.lowrank_hook`` with ``options``) or ``local`` (no communication: the
    compute floor; its loss is not data-parallel training's)."""

    kind: str
    arg: str = ""
    options: dict = field(default_factory=dict)
    bucket_cap_mb: float = 4.0  # DDP's buckets (as the reference trainer sets them)


HOOKS: dict[str, HookSpec] = {
    "allreduce": HookSpec("allreduce"),
    "powersgd-r1": HookSpec("powersgd", "1"),
    "powersgd-r4": HookSpec("powersgd", "4"),
    "powersgd-r16": HookSpec("powersgd", "16"),
    "int2ef": HookSpec("commpress", "int2ef"),
    "int2ef-b512k": HookSpec("commpress", "int2ef", {"bucket_numel": 1 << 19}),
    "sdp4bit": HookSpec("commpress", "sdp4bit"),
    # PowerSGD with its factors as int8/int4 codes across nodes (commpress.lowrank_hook)
    "lowrank-r4-int8": HookSpec("lowrank", options={"rank": 4, "factor_codec": "int8"}),
    "lowrank-r4-fp32": HookSpec("lowrank", options={"rank": 4, "factor_codec": "none"}),
    "lowrank-r8-int4": HookSpec("lowrank", options={"rank": 8, "factor_codec": "int4"}),
    "lowrank-r16-fp32": HookSpec("lowrank", options={"rank": 16, "factor_codec": "none"}),
    "lowrank-r16-int8": HookSpec("lowrank", options={"rank": 16, "factor_codec": "int8"}),
    "lowrank-r32-int8": HookSpec("lowrank", options={"rank": 32, "factor_codec": "int8"}),
    "lowrank-r64-int8": HookSpec("lowrank", options={"rank": 64, "factor_codec": "int8"}),
    "lowrank-r16-int8-b1m": HookSpec("lowrank", options={"rank": 16, "factor_codec": "int8",
                                                         "bucket_numel": 1 << 20}),
    # ACP-SGD: P and Q on alternate steps, one all-reduce per step
    "acp-r4-int8": HookSpec("lowrank", options={"rank": 4, "factor_codec": "int8",
                                                "alternate": True}),
    "acp-r8-int8": HookSpec("lowrank", options={"rank": 8, "factor_codec": "int8",
                                                "alternate": True}),
    "acp-r16-int8": HookSpec("lowrank", options={"rank": 16, "factor_codec": "int8",
                                                 "alternate": True}),
    "acp-r4-int8-b1m": HookSpec("lowrank", options={"rank": 4, "factor_codec": "int8",
                                                    "alternate": True,
                                                    "bucket_numel": 1 << 20}),
    "compute-only": HookSpec("local"),
}
DEFAULT_HOOKS = "allreduce,powersgd-r1,powersgd-r4,powersgd-r16,int2ef,sdp4bit,compute-only"


# -- models ------------------------------------------------------------------------------
class TorchNNByteLM(nn.Module):
    """A byte-level causal LM of torch.nn layers only: d 256, 4 pre-norm
    ``nn.TransformerEncoderLayer``\\ s, 3.3 M parameters."""

    def __init__(self, d: int = 256, layers: int = 4, heads: int = 4, block: int = SEQ) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        x = self.tok(idx) + self.pos(torch.arange(T))  # (B, T, C)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))  # (B, T, 256)


MODELS = {  # name → builder; the *-tiny ones keep the script's test short
    "gpt": lambda: GPT(config_from_preset("gpt-3m")),
    "torchnn": lambda: TorchNNByteLM(),
    "gpt-tiny": lambda: GPT(config_from_preset("gpt-tiny", block_size=SEQ)),
    "torchnn-tiny": lambda: TorchNNByteLM(d=64, layers=2),
}


def build_model(name: str) -> nn.Module:
    """``gpt``: commpress's GPT (gpt-3m, 2.8 M parameters); ``torchnn``: TorchNNByteLM."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not allowed; allowed: {', '.join(MODELS)}")
    return MODELS[name]()


# -- one rank ------------------------------------------------------------------------------
def install(ddp, spec: HookSpec, ranks_per_node: int):
    """Register ``spec``'s hook on ``ddp``; returns its state."""
    import commpress
    from commpress.collectives import Topology
    from commpress.frontends.ddp_lowrank import lowrank_hook
    from commpress.train.ddp_engine import install_hook

    topology = Topology(ranks_per_node)
    if spec.kind == "allreduce":
        return install_hook(ddp, "allreduce", None, None, topology)
    if spec.kind == "powersgd":
        return install_hook(ddp, f"powersgd:{spec.arg}", None, None, topology)
    if spec.kind == "commpress":
        state, hook = commpress.ddp_hook(ddp, spec.arg, topology=topology, **spec.options)
    elif spec.kind == "lowrank":
        state, hook = lowrank_hook(ddp, topology=topology, **spec.options)
    elif spec.kind == "local":
        def hook(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        state = None
    else:
        raise ValueError(f"hook kind {spec.kind!r} is not allowed; allowed: allreduce, "
                         "powersgd, commpress, lowrank, local")
    ddp.register_comm_hook(state, hook)
    return state


def link_bytes() -> int | None:
    """Bytes sent plus received on this namespace's ``eth0`` (None off the testbed)."""
    if os.environ.get("GLOO_SOCKET_IFNAME") != "eth0":
        return None
    try:
        return sum(int(open(f"/sys/class/net/eth0/statistics/{c}_bytes").read())
                   for c in ("tx", "rx"))
    except OSError:
        return None


def run_one(item: dict, data, ranks_per_node: int) -> dict:
    """Train ``item['model']`` with ``item['hook']`` for ``item['steps']`` steps on every
    rank; evaluate if ``item['evaluate']``."""
    steps, evaluate = item["steps"], item["evaluate"]
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress
    from commpress.train.ddp_engine import replica_optimizer, step_replica
    from commpress.train.run import lr_factor

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = HOOKS[item["hook"]]
    torch.manual_seed(item["seed"])
    module = build_model(item["model"])
    # the same seed builds the same replica on every rank: no broadcast over the slow link
    ddp = DDP(module, bucket_cap_mb=spec.bucket_cap_mb, init_sync=False)
    install(ddp, spec, ranks_per_node)
    opt = replica_optimizer(module, LR, 0.1)
    commpress.reset_stats()
    schedule = SimpleNamespace(warmup=4, steps=item["schedule_steps"], min_lr_ratio=0.1)
    times, losses, link = [], [], None
    for step in range(steps):
        if step == WARMUP_STEPS:
            link = link_bytes()
        x, y = (t.chunk(world)[rank] for t in data.batch("train", BATCH, SEQ, item["seed"], step))
        for g in opt.param_groups:
            g["lr"] = LR * lr_factor(schedule, step)
        t0 = time.perf_counter()
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        step_replica(module, opt, 1.0, "skip", f"step {step}")
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    end = link_bytes()
    counters = commpress.stats()
    timed = torch.tensor(times[WARMUP_STEPS:], dtype=torch.float64)
    gathered = [torch.zeros_like(timed) for _ in range(world)]
    dist.all_gather(gathered, timed)
    slowest = torch.stack(gathered).max(0).values.tolist()
    # replicas must agree bit for bit: compare a checksum of every parameter's bytes
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    digest = torch.tensor([float(flat.view(torch.int32).double().sum()),
                           float(flat.double().abs().sum())], dtype=torch.float64)
    digests = [torch.zeros_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest)
    val = None
    if evaluate:
        val = evaluate_loss(ddp.module, data, item["seed"])
    timed_steps = steps - WARMUP_STEPS
    return {**item, "step_s": statistics.median(slowest) if slowest else None,
            "step_s_each": slowest, "train_losses": losses, "val_loss": val,
            "link_mb_per_step": (end - link) / timed_steps / 1e6
            if link is not None and timed_steps else None,
            "hook_cpu_s_per_step": sum(c["encode_s"] + c["decode_s"] for c in counters.values())
            / steps,
            "replicas_identical": all(torch.equal(d, digests[0]) for d in digests),
            "params": flat.numel()}


def evaluate_loss(module, data, seed: int) -> float:
    """Mean validation loss over ``EVAL_BATCHES`` batches, split over the ranks."""
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for b in range(rank, EVAL_BATCHES, world):
            x, y = data.batch("val", BATCH, SEQ, seed, b)
            logits = module(x)
            total[0] += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            total[1] += 1
    dist.all_reduce(total)
    return float(total[0] / total[1])


def rank_main(args) -> None:
    """One rank: every item of the plan in turn, rank 0 appending each result."""
    import datetime

    import torch.distributed as dist

    from commpress.train.data import TextData, load_tokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    data = TextData(load_tokens(None, max_bytes=8 << 20))
    plan = json.loads(args.plan)
    for item in plan:
        result = run_one(item, data, RANKS_PER_NODE)
        if dist.get_rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


# -- the grid ------------------------------------------------------------------------------
def launch(cluster: Cluster | None, plan: list[dict], on_result, port: int,
           timeout_s: float) -> None:
    """Run ``plan`` on 2 × 2 ranks (in ``cluster``'s namespaces, or on loopback without
    one); ``on_result(result)`` as each item finishes. Raises if a rank fails."""
    world = NODES * RANKS_PER_NODE
    out = tempfile.mktemp(prefix="ddp_front_", suffix=".jsonl")
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank % RANKS_PER_NODE), LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
                   MASTER_ADDR=cluster.ip(0) if cluster else "127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        prefix = []
        if cluster:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            prefix = ["ip", "netns", "exec", cluster.ns(rank // RANKS_PER_NODE)]
        argv = [*prefix, sys.executable, os.path.abspath(__file__), "--rank", "--plan",
                json.dumps(plan), "--out", out, "--timeout-s", str(timeout_s)]
        # stderr to a file: a pipe nobody reads blocks a chatty rank once it is full
        logs.append(tempfile.TemporaryFile())
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                      stderr=logs[-1], preexec_fn=set_parent_death_signal))
    seen = 0
    try:
        while True:
            lines = open(out).read().splitlines() if os.path.exists(out) else []
            for line in lines[seen:]:
                on_result(json.loads(line))
            seen = len(lines)
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.5)
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            logs[failed[0]].seek(0)
            err = logs[failed[0]].read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"rank {failed[0]} failed:\n{err}")
        lines = open(out).read().splitlines()
        for line in lines[seen:]:
            on_result(json.loads(line))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
        if os.path.exists(out):
            os.remove(out)


def run_grid(args) -> dict:
    """Every (link, seed) launch, with a rich progress bar; results cached by key."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    links, seeds = args.links.split(","), [int(s) for s in args.seeds.split(",")]
    models, hooks = args.models.split(","), args.hooks.split(",")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    cache = {} if args.fresh or not os.path.exists(args.json) else json.load(open(args.json))
    loss_link = links[-1]  # the fastest link, listed last
    console = Console()
    total = len(links) * len(seeds) * len(models) * len(hooks)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("DDP front", total=total)
        # seed by seed, so a cut-short grid leaves whole seeds; the loss run of a seed
        # first, since its timing runs are checked against it
        for seed in seeds:
            for link in reversed(links):
                plan = [{"model": m, "hook": h, "seed": seed,
                         **run_length(args, h, link == loss_link)}
                        for m in models for h in hooks if f"{link}|{m}|{h}|{seed}" not in cache]
                progress.advance(task, len(models) * len(hooks) - len(plan))
                if not plan:
                    continue
                progress.update(task, description=f"{link} seed {seed}")

                def on_result(r: dict, link: str = link) -> None:
                    r["link"], r["load_avg"] = link, os.getloadavg()[0]
                    cache[f"{link}|{r['model']}|{r['hook']}|{r['seed']}"] = r
                    with open(args.json, "w") as f:
                        json.dump(cache, f, indent=1)
                    val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
                    mb = (f"{r['link_mb_per_step']:.2f} MB" if r["link_mb_per_step"]
                          is not None else "-")
                    progress.console.print(f"{link:>7} {r['model']:>7} {r['hook']:>16} "
                                           f"s{r['seed']}: "
                                           f"{r['step_s']:.3f} s/step, val {val}, {mb}, "
                                           f"load {r['load_avg']:.1f}")
                    progress.advance(task)

                if args.local:
                    launch(None, plan, on_result, args.port, args.timeout_s)
                else:
                    with Cluster(NODES, link) as cluster:
                        launch(cluster, plan, on_result, args.port, args.timeout_s)
    return cache


def run_length(args, hook: str, loss_run: bool) -> dict:
    """Steps and evaluation of one run: the loss link trains ``--loss-steps`` and
    evaluates; other links, and the compute floor everywhere, time the short run."""
    # every run follows the loss run's learning-rate schedule: a timing run is its prefix
    if loss_run and HOOKS[hook].kind != "local":
        return {"steps": args.loss_steps, "evaluate": True, "schedule_steps": args.loss_steps}
    return {"steps": WARMUP_STEPS + args.time_steps, "evaluate": False,
            "schedule_steps": args.loss_steps}


# -- the report ----------------------------------------------------------------------------
def summarize(cache: dict, links: list[str], models: list[str], hooks: list[str]) -> dict:
    """(model, link, hook) → step s (median of seeds), val loss mean ± std, MB/step,
    load average, and whether every timing run reproduced the loss run's losses."""
    loss_link = links[-1]
    out = {}
    for m in models:
        for link in links:
            for h in hooks:
                runs = [r for k, r in cache.items() if k.startswith(f"{link}|{m}|{h}|")]
                base = {r["seed"]: r for k, r in cache.items()
                        if k.startswith(f"{loss_link}|{m}|{h}|")}
                if not runs or not base:
                    continue
                vals = [b["val_loss"] for b in base.values() if b["val_loss"] is not None]
                # runs cached before timing runs shared the loss run's schedule: unchecked
                checked = [r for r in runs if r["seed"] in base and "schedule_steps" in r]
                same = (all(base[r["seed"]]["train_losses"][:len(r["train_losses"])]
                            == r["train_losses"] for r in checked) if checked else None)
                mbs = [r["link_mb_per_step"] for r in runs if r["link_mb_per_step"] is not None]
                out[(m, link, h)] = {
                    "step_s": statistics.median(r["step_s"] for r in runs),
                    "loss": statistics.mean(vals) if vals else math.nan,
                    "loss_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                    "losses": {seed: b["val_loss"] for seed, b in base.items()},
                    "seeds": len(vals), "mb": statistics.median(mbs) if mbs else math.nan,
                    "load": statistics.mean(r["load_avg"] for r in runs),
                    "same_bits": same, "identical": all(r["replicas_identical"] for r in runs),
                    "params": runs[0]["params"]}
    return out


def report(summary: dict, links: list[str], models: list[str], hooks: list[str], args,
           png: str, md: str) -> str:
    lines = [f"2 nodes × 2 ranks, torch DDP, global batch {BATCH} × {SEQ} bytes, AdamW lr "
             f"{LR}; loss: {args.loss_steps} steps on {links[-1]}; step time: median of "
             f"{args.time_steps} timed steps after {WARMUP_STEPS} untimed ones (loss link: of "
             f"{args.loss_steps - WARMUP_STEPS}), slowest rank, median over seeds "
             f"{args.seeds}.", "",
             "| model | link | hook | step s | vs PowerSGD r4 | val loss (mean ± std) | "
             "link MB/step | load avg | same bits as loss run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for link in links:
            ref = summary.get((m, link, "powersgd-r4"))
            for h in hooks:
                s = summary.get((m, link, h))
                if s is None:
                    continue
                speed = f"{ref['step_s'] / s['step_s']:.2f}×" if ref else "-"
                loss = ("not DP training" if HOOKS[h].kind == "local"
                        else f"{s['loss']:.4f} ± {s['loss_std']:.4f}")
                lines.append(f"| {m} ({s['params'] / 1e6:.2f} M) | {link} | {h} | "
                             f"{s['step_s']:.3f} | {speed} | {loss} | {s['mb']:.2f} | "
                             f"{s['load']:.1f} | {SAME[s['same_bits']]}"
                             f"{'' if s['identical'] else ', replicas differ'} |")
    lines += ["", *front_verdicts(summary, links, models, hooks)]
    text = "\n".join(lines) + "\n"
    with open(md, "w") as f:
        f.write(text)
    plot(summary, links, models, hooks, png)
    return text


def paired_delta(a: dict, b: dict) -> tuple[float, float]:
    """Mean and sample std of ``a − b`` validation loss over the seeds both ran (the
    same seed: the same initialization and batches)."""
    d = [a["losses"][seed] - b["losses"][seed] for seed in a["losses"] if seed in b["losses"]]
    if not d:
        return math.nan, math.nan
    return statistics.mean(d), statistics.stdev(d) if len(d) > 1 else 0.0


def front_verdicts(summary: dict, links: list[str], models: list[str],
                   hooks: list[str]) -> list[str]:
    """For each PowerSGD rank: the fastest commpress hook at a mean loss no worse."""
    ours = [h for h in hooks if HOOKS[h].kind in ("commpress", "lowrank")]
    lines = ["For each PowerSGD rank, the fastest commpress hook whose mean validation loss "
             "is no worse:", "",
             "| model | link | PowerSGD | step s | val loss | commpress hook | step s | "
             "speedup | paired Δ loss ± std |", "|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for link in links:
            for h in hooks:
                peer = summary.get((m, link, h))
                if peer is None or HOOKS[h].kind != "powersgd":
                    continue
                fits = [(summary[(m, link, o)]["step_s"], o) for o in ours
                        if (m, link, o) in summary and summary[(m, link, o)]["loss"]
                        <= peer["loss"]]
                row = f"| {m} | {link} | {h} | {peer['step_s']:.3f} | {peer['loss']:.4f} |"
                if not fits:
                    lines.append(row + " none | - | - | - |")
                    continue
                t, o = min(fits)
                d, sd = paired_delta(summary[(m, link, o)], peer)
                lines.append(row + f" {o} | {t:.3f} | {peer['step_s'] / t:.2f}× | "
                                   f"{d:+.4f} ± {sd:.4f} |")
    return lines


def plot(summary: dict, links: list[str], models: list[str], hooks: list[str], png: str) -> None:
    """One panel per (model, link): validation loss against step time, PowerSGD in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(len(models), len(links), figsize=(5.5 * len(links),
                             4 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for k, h in enumerate(hooks):
                s = summary.get((m, link, h))
                if s is None or HOOKS[h].kind == "local":
                    if s is not None:
                        ax.axvline(s["step_s"], color="grey", ls=":")
                        ax.annotate("compute only", (s["step_s"], 0.02), rotation=90,
                                    xycoords=("data", "axes fraction"), fontsize=6)
                    continue
                peer = HOOKS[h].kind in ("powersgd", "allreduce")
                ax.errorbar(s["step_s"], s["loss"], yerr=s["loss_std"], ls="none",
                            marker="s" if peer else "o", ms=7,
                            color="tab:red" if HOOKS[h].kind == "powersgd" else
                            "black" if peer else f"C{k % 10}", alpha=0.5 + 0.5 * peer)
                ax.annotate(h, (s["step_s"], s["loss"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
            times = [summary[(m, link, h)]["step_s"] for h in hooks if (m, link, h) in summary]
            log_x = bool(times) and max(times) > 8 * min(times)  # else no decade tick shows
            if log_x:
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set(xlabel=f"step time (s{', log' if log_x else ''})", ylabel="validation loss",
                   title=f"{m} @ {link}")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", default="50mbit,1gbit", help="slowest first; loss on the last")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--models", default="gpt,torchnn")
    ap.add_argument("--hooks", default=DEFAULT_HOOKS)
    ap.add_argument("--loss-steps", type=int, default=40)
    ap.add_argument("--time-steps", type=int, default=6)
    ap.add_argument("--fresh", action="store_true", help="ignore cached runs")
    ap.add_argument("--local", action="store_true", help="loopback ranks, no namespaces")
    ap.add_argument("--name", default="ddp_front", help="output files' stem in --results")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args)
        return
    for flag, names, allowed in (("--hooks", args.hooks, HOOKS), ("--models", args.models,
                                                                  MODELS)):
        for name in names.split(","):
            if name not in allowed:
                ap.error(f"{flag}: {name!r} is not allowed; allowed: {', '.join(allowed)}")
    if args.loss_steps <= WARMUP_STEPS or args.time_steps < 1:
        ap.error(f"--loss-steps must exceed {WARMUP_STEPS} and --time-steps be >= 1")
    os.makedirs(args.results, exist_ok=True)
    stem = os.path.join(args.results, args.name)
    args.json = stem + ".json"
    cache = run_grid(args)
    links, models, hooks = args.links.split(","), args.models.split(","), args.hooks.split(",")
    print(report(summarize(cache, links, models, hooks), links, models, hooks, args,
                 stem + ".png", stem + ".md"))


if __name__ == "__main__":
    main()
