"""Megatron-core on the emulated cluster: stock Megatron against commpress policies.

    python benchmarks/megatron_cluster.py [--steps 20] [--bandwidth 50mbit] [--tp 1]
        [--policies stock,none,sdp4bit,hybrid] [--hidden 256] [--layers 4]

2 nodes × 2 ranks (network namespaces, tbf-shaped links in both directions; see
``commpress.testbed``), Megatron's distributed optimizer over data-parallel ranks (with
``--tp 2``: tensor parallelism inside each node, data parallelism across), a bf16 GPT
on byte tokens of the standard-library corpus, 1 sequence of 128 tokens per rank and
step (communication, not compute, is what is measured). ``stock`` is Megatron without
commpress; the others apply the policy with ``commpress.megatron.apply``. Per policy:
the median step time after 2 warm-up steps, the mean loss of the last 5 steps, the
bytes commpress counted per step (all ranks) and the bytes that crossed the nodes'
links (the whole run). Writes ``benchmarks/results/megatron_cluster.{json,md}``.
Needs root and iproute2. On a CPU-only torch the ranks borrow the engine tests' CPU
shim for Megatron (``tests/integrations/engines/megatron_workers.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from commpress.launch import set_parent_death_signal  # noqa: E402
from commpress.testbed import Cluster  # noqa: E402

RESULTS = os.path.join(HERE, "results")
NODES, RANKS_PER_NODE = 2, 2


def rank_main(args) -> None:
    """One rank: build, apply the policy, train, write this rank's numbers."""
    import torch
    import torch.distributed as dist
    from tests.integrations.engines import megatron_workers as workers

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    workers.init_parallel(args.tp, 1)
    import commpress

    world = dist.get_world_size()
    shape = workers.Shape(layers=args.layers, hidden=args.hidden, heads=args.heads,
                          seq=args.seq, batch=world // args.tp, micro=1)
    model, optimizer = workers.build(args.tp, 1, bucket_size=args.bucket_numel, shape=shape)
    comm = None
    if args.policy != "stock":
        comm = commpress.megatron.apply(model, optimizer, args.policy)
    commpress.reset_stats()
    record = workers.train(model, optimizer, workers.data(), 0, args.steps, shape=shape,
                           hashes=False)
    stats = commpress.stats()
    if comm is not None:
        comm.remove()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"record": record, "wire_bytes": sum(s["wire_bytes"] for s in stats.values()),
                   "params": sum(p.numel() for p in model.parameters())}, f)
    dist.destroy_process_group()


def run_policy(policy: str, args) -> dict:
    """All ranks of one policy on a fresh cluster; their numbers combined."""
    world = NODES * RANKS_PER_NODE
    out = tempfile.mkdtemp(prefix="megatron_cluster_")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("steps", "tp", "hidden", "layers", "heads", "seq", "bucket_numel")]
    with Cluster(NODES, args.bandwidth) as cluster:
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank % RANKS_PER_NODE),
                       LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), MASTER_ADDR=cluster.ip(0),
                       MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME="eth0",
                       OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            argv = ["ip", "netns", "exec", cluster.ns(rank // RANKS_PER_NODE), sys.executable,
                    os.path.abspath(__file__), "--rank", "--policy", policy, "--out", out,
                    *flags]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE,
                                          preexec_fn=set_parent_death_signal))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        link = sum(sum(cluster.link_bytes(n)) for n in range(NODES)) / 2  # sent = received
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode]
        if failed:
            err = procs[failed[0]].stderr.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{policy}: rank {failed[0]} failed:\n{err}")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    steps = len(ranks[0]["record"])
    losses = [statistics.fmean(x for r in ranks for x in r["record"][s]["losses"])
              for s in range(steps)]
    times = [max(r["record"][s]["time_s"] for r in ranks) for s in range(2, steps)]
    return {"step_s": statistics.median(times), "loss": statistics.fmean(losses[-5:]),
            "losses": losses, "wire_mb_per_step": sum(r["wire_bytes"] for r in ranks) / steps / 1e6,
            "link_mb": link / 1e6, "params": ranks[0]["params"]}


def report(res: dict, args) -> str:
    base = res.get("stock") or next(iter(res.values()))
    lines = [f"Megatron-core {args.layers}-layer GPT (hidden {args.hidden}, "
             f"{base['params'] / 1e6:.1f} M parameters per rank, bf16), {NODES} nodes × "
             f"{RANKS_PER_NODE} ranks, tp {args.tp}, {args.bandwidth} between nodes, "
             f"{args.steps} steps", "",
             "| policy | step s | speedup | loss (last 5) | vs stock | commpress MB/step | "
             "link MB (run) |", "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['step_s']:.2f} | {base['step_s'] / r['step_s']:.2f}x | "
                     f"{r['loss']:.4f} | {100 * (r['loss'] / base['loss'] - 1):+.2f} % | "
                     f"{r['wire_mb_per_step']:.2f} | {r['link_mb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="stock,none,sdp4bit,hybrid")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bandwidth", default="50mbit")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket-numel", type=int, default=1 << 20)
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    res = {}
    for policy in args.policies.split(","):
        print(f"[{policy}]", flush=True)
        res[policy] = run_policy(policy, args)
    text = report(res, args)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "megatron_cluster.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()
                            if k not in ("rank", "policy", "out")}, "results": res}, f, indent=1)
    with open(os.path.join(RESULTS, "megatron_cluster.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
