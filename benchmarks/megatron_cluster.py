"""Megatron-core on the emulated cluster: stock Megatron against commpress policies.

    python benchmarks/megatron_cluster.py [--steps 20] [--bandwidth 50mbit] [--tp 1]
        [--policies stock,none,sdp4bit,hybrid] [--hidden 256] [--layers 4]

2 nodes × 2 ranks (network namespaces, tbf-shaped links in both directions; see
``commpress.testbed``), Megatron's distributed optimizer over data-parallel ranks (with
``--tp 2``: tensor parallelism inside each node, data parallelism across), a bf16 GPT
on byte tokens of the standard-library corpus, 1 sequence of 128 tokens per rank and
step (communication, not compute, is what is measured). ``stock`` is Megatron without
commpress; the others apply the policy with ``commpress.megatron.compress``. Per policy:
the median step time after 2 warm-up steps, the mean loss of the last 5 steps, the
bytes commpress counted per step (all ranks) and the bytes that crossed the nodes'
links (the whole run). Writes ``benchmarks/results/megatron_cluster.{json,md}``.
Needs root and iproute2. On a CPU-only torch the ranks borrow the engine tests' CPU
shim for Megatron (``tests/engines/megatron_workers.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from _common import (  # noqa: E402
    NODES,
    RANKS_PER_NODE,
    add_cluster_args,
    rank_flags,
    run_ranks,
    write_results,
)

from commpress.testbed import Cluster  # noqa: E402

RANK_FLAGS = ("steps", "tp", "hidden", "layers", "heads", "seq", "bucket_numel")


def rank_main(args) -> None:
    """One rank: build, apply the policy, train, write this rank's numbers."""
    import torch
    import torch.distributed as dist
    from tests.engines import megatron_workers as workers

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
        comm = commpress.megatron.compress(model, optimizer, args.policy)
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
    # a fresh cluster per policy: its link counters cover this run only
    with Cluster(NODES, args.bandwidth) as cluster:
        run_ranks(cluster, __file__, policy, out, rank_flags(args, RANK_FLAGS), args.port,
                  args.timeout)
        link = sum(sum(cluster.link_bytes(n)) for n in range(NODES)) / 2  # sent = received
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
    add_cluster_args(ap, steps=20, policies="stock,none,sdp4bit,hybrid", port=29541)
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket-numel", type=int, default=1 << 20)
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    res = {}
    for policy in args.policies.split(","):
        print(f"[{policy}]", flush=True)
        res[policy] = run_policy(policy, args)
    write_results("megatron_cluster",
                  {"args": {k: v for k, v in vars(args).items()
                            if k not in ("rank", "policy", "out")}, "results": res},
                  report(res, args))


if __name__ == "__main__":
    main()
