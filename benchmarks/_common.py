"""Shared helpers for the benchmark scripts: run a grid of trainings, cache summaries,
and aggregate over seeds (mean and sample standard deviation); start an engine's ranks
on the emulated cluster (the ``*_cluster.py`` scripts)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from commpress.launch import set_parent_death_signal  # noqa: E402
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


# -- engines on the emulated cluster ---------------------------------------------------
# The *_cluster.py scripts start their own ranks inside the nodes' namespaces (the
# engines' own set-up, not `commpress train`): the launcher, its options and the link
# counters live here once.

NODES, RANKS_PER_NODE = 2, 2


def add_cluster_args(ap: argparse.ArgumentParser, *, steps: int, policies: str,
                     port: int) -> None:
    """The options every cluster script takes, and the hidden ones of its rank processes."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--bandwidth", default="50mbit", help="each node's link, both directions")
    ap.add_argument("--policies", default=policies)
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per policy")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def rank_flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """``--name=value`` for the ``names`` of ``args`` a rank process needs again."""
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in names]


def run_ranks(cluster, script: str, policy: str, out: str, flags: list[str], port: int,
              timeout: float, env: dict[str, str] | None = None, nodes: int = NODES,
              per_node: int = RANKS_PER_NODE) -> None:
    """Run ``script --rank`` as ``nodes × per_node`` ranks inside ``cluster``'s
    namespaces with the environment torchrun gives; wait for all. A rank that fails stops
    the others and raises with its stderr's end; so does the timeout."""
    world = nodes * per_node
    procs, logs = [], []
    for rank in range(world):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_RANK=str(rank % per_node),
                        LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR=cluster.ip(0),
                        MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                        OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
        argv = ["ip", "netns", "exec", cluster.ns(rank // per_node), sys.executable,
                os.path.abspath(script), "--rank", "--policy", policy, "--out", out, *flags]
        # stderr to a file: a pipe nobody reads blocks a chatty rank once it is full
        logs.append(tempfile.TemporaryFile())
        procs.append(subprocess.Popen(argv, env=rank_env, stdout=subprocess.DEVNULL,
                                      stderr=logs[-1], preexec_fn=set_parent_death_signal))
    try:
        failed = _wait_all(procs, timeout)
        if failed is not None:
            logs[failed].seek(0)
            err = logs[failed].read().decode(errors="replace")[-3000:]
            code = procs[failed].returncode
            why = "timed out" if code is None else f"exited with {code}"
            raise RuntimeError(f"{policy}: rank {failed} {why}:\n{err}")
    finally:
        for p in procs:  # a failed or timed-out run leaves no rank behind
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()


def rank0_result(cluster, script: str, name: str, policy: str, flags: list[str], port: int,
                 timeout: float, env: dict[str, str] | None = None,
                 **layout: int) -> dict:
    """:func:`run_ranks` for one policy whose rank 0 writes a JSON file; that file's
    contents (the file itself removed), with the machine's 1-minute load average before
    and after the run under ``load_average`` (other jobs on the cores slow every step).
    ``layout``: :func:`run_ranks`'s ``nodes`` and ``per_node``."""
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, f"{name}.{policy}.rank0.json")
    load_before = os.getloadavg()[0]
    run_ranks(cluster, script, policy, out, flags, port, timeout, env, **layout)
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    result["load_average"] = [load_before, os.getloadavg()[0]]
    return result


def run_policies(script: str, name: str, args: argparse.Namespace, flags: list[str],
                 summarize, env: dict[str, str] | None = None) -> list[dict]:
    """Each of ``args.policies`` in turn on one emulated cluster (:func:`rank0_result`,
    ports from ``args.port`` up); ``summarize(policy, result, args.steps)`` of each."""
    from commpress.testbed import Cluster

    rows = []
    with Cluster(NODES, args.bandwidth) as cluster:
        for i, policy in enumerate(args.policies.split(",")):
            print(f"[{policy}] {args.steps} steps at {args.bandwidth}", flush=True)
            result = rank0_result(cluster, script, name, policy, flags, args.port + i,
                                  args.timeout, env)
            rows.append(summarize(policy, result, args.steps))
    return rows


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> int | None:
    """Wait for every process; the first one that failed (or is still running at the
    timeout), else ``None``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.2)
    return next((r for r, p in enumerate(procs) if p.poll() != 0), None)


def namespace_link_bytes() -> tuple[int, int]:
    """Bytes this node's link (``eth0`` of the rank's namespace) has sent and received so
    far; zeros off the testbed."""
    def read(counter: str) -> int:
        path = f"/sys/class/net/eth0/statistics/{counter}"
        return int(open(path).read()) if os.path.exists(path) else 0
    return read("tx_bytes"), read("rx_bytes")


def write_results(name: str, payload: dict, text: str) -> None:
    """``RESULTS/name.json`` (the numbers) and ``RESULTS/name.md`` (the table), printed."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    write_markdown(f"{name}.md", text.rstrip("\n").split("\n"))
