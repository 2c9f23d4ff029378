"""FSDP2 as HSDP on the emulated cluster: stock HSDP against commpress.fsdp.compress.

    python benchmarks/hsdp_cluster.py [--steps 30] [--model gpt-3m]
        [--bandwidth 50mbit] [--policies exact,zeropp,sdp4bit]

2 nodes × 2 ranks (network namespaces, tbf in both directions at --bandwidth), Gloo,
the project's GPT of --model sharded with ``fully_shard`` on a ``(replicate, shard)``
mesh of (2, 2): weights sharded inside a node, replicated across — each block and the
root, fp32, AdamW (lr 1e-3, weight decay 0.1), global batch --batch × --seq tokens of
the standard-library corpus, seed 0. ``exact`` is stock HSDP, untouched; any other
name is a commpress policy applied with ``commpress.fsdp.compress``: the shard
reduce-scatter and weight all-gather run inside the node, and the replicate all-reduce
of the gradient shards — the only per-step traffic between nodes — goes through the
policy's inter-node gradient codec (label ``dp.grad.inter``).

Per policy: the median step time (after two warm-up steps), the training loss (mean of
the last five steps), commpress's bytes per label (per rank, per step) and bits per
element, and each node's link bytes during the steps — as bits per model parameter
(stock HSDP: 32, each rank all-reducing its half of the gradients in fp32).
Writes benchmarks/results/hsdp_cluster.{json,md}. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    NODES,
    RANKS_PER_NODE,
    add_cluster_args,
    namespace_link_bytes,
    rank_flags,
    run_policies,
    write_results,
)

RANK_FLAGS = ("steps", "model", "batch", "seq", "lr")


def rank_main(args) -> None:
    """One rank, inside its node's namespace (environment as torchrun gives it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commpress
    from commpress.model.gpt import GPT, config_from_preset
    from commpress.train.data import TextData, load_tokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(config_from_preset(args.model, block_size=args.seq))
    numel = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (NODES, RANKS_PER_NODE),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.policy != "exact":
        commpress.fsdp.compress(model, args.policy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = TextData(load_tokens(max_bytes=8 << 20))
    per = args.batch // world
    losses, times = [], []
    dist.barrier()
    commpress.reset_stats()
    link_before = namespace_link_bytes()
    for step in range(args.steps):
        x, y = data.batch("train", args.batch, args.seq, 0, step)
        start = time.perf_counter()
        _, loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        times.append(time.perf_counter() - start)
        losses.append(mean.item() / world)
    dist.barrier()
    link = [a - b for a, b in zip(namespace_link_bytes(), link_before)]
    everyone = [None] * world
    dist.all_gather_object(everyone, {"link": link, "stats": commpress.stats(),
                                      "step_s": times})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "numel": numel,
                       # a step lasts as long as its slowest rank
                       "step_s": [max(r["step_s"][s] for r in everyone)
                                  for s in range(args.steps)],
                       "stats": [r["stats"] for r in everyone],
                       "link_bytes": [{"sent": r["link"][0], "received": r["link"][1]}
                                      for r in everyone[::RANKS_PER_NODE]]}, f)
    dist.barrier()
    dist.destroy_process_group()


def summarize(policy: str, r: dict, steps: int) -> dict:
    """One policy's row: times, losses, rank 0's bytes per label, the nodes' links."""
    import commpress

    stats = r["stats"][0]
    row = {"policy": policy, "step_s_median": statistics.median(r["step_s"][2:]),
           "loss_last5": statistics.mean(r["losses"][-5:]), "losses": r["losses"],
           "numel": r["numel"],
           "bytes_per_rank_step": {k: s["wire_bytes"] / steps for k, s in sorted(stats.items())},
           "bits_per_element": {k: 8 * s["wire_bytes"] / s["elements"]
                                for k, s in sorted(stats.items()) if s["elements"]},
           "seconds_per_rank_step": {k: {f: s[f] / steps for f in ("encode_s", "decode_s",
                                                                   "comm_s")}
                                     for k, s in sorted(stats.items())},
           "link_sent_mb_per_node_step": [x["sent"] / 1e6 / steps for x in r["link_bytes"]],
            "load_average": r["load_average"]}
    # bits per model parameter on each node's link: every node sends each parameter's
    # gradient once per step (its ranks hold one half each)
    row["link_bits_per_param"] = [8e6 * mb / r["numel"]
                                  for mb in row["link_sent_mb_per_node_step"]]
    if policy != "exact":
        # the codec's own rate for the calls it made: what dp.grad.inter must show
        codec = commpress.Policy.resolve(policy).codec_for("dp", "grad", "inter")
        inter = stats.get("dp.grad.inter")
        if inter and inter["calls"]:
            row["inter_codec_bits"] = codec.bits_per_element(
                int(inter["elements"] // inter["calls"]))
    return row


def report(rows: list[dict], args) -> str:
    base = rows[0]
    lines = [f"FSDP2 HSDP (shard 2 inside a node, replicate 2 across), {NODES} nodes × "
             f"{RANKS_PER_NODE} ranks at {args.bandwidth}, {args.model} "
             f"({base['numel'] / 1e6:.2f} M parameters), batch {args.batch} × {args.seq}, "
             f"{args.steps} steps", "",
             "| policy | step s (median) | speedup | loss (last 5) | vs exact | "
             "load (1 min) | link MB / node / step | link bits / parameter | "
             "commpress bytes / rank / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        labels = ", ".join(f"{k} {v / 1e6:.3f} MB ({r['bits_per_element'][k]:.2f} b)"
                           for k, v in r["bytes_per_rank_step"].items()
                           if k in r["bits_per_element"]) or "—"
        lines.append(f"| {r['policy']} | {r['step_s_median']:.2f} | "
                     f"{base['step_s_median'] / r['step_s_median']:.2f}x | "
                     f"{r['loss_last5']:.4f} | "
                     f"{100 * (r['loss_last5'] / base['loss_last5'] - 1):+.2f} % | "
                     f"{r['load_average'][0]:.1f} → {r['load_average'][1]:.1f} | "
                     f"{statistics.mean(r['link_sent_mb_per_node_step']):.2f} | "
                     f"{statistics.mean(r['link_bits_per_param']):.2f} | {labels} |")
    lines.append("")
    lines += [f"{r['policy']}: dp.grad.inter {r['bits_per_element']['dp.grad.inter']:.3f} bits "
              f"per element measured, {r['inter_codec_bits']:.3f} the codec's"
              for r in rows if "inter_codec_bits" in r]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cluster_args(ap, steps=30, policies="exact,zeropp,sdp4bit", port=29640)
    ap.add_argument("--model", default="gpt-3m")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step, all ranks")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    rows = run_policies(__file__, "hsdp_cluster", args, rank_flags(args, RANK_FLAGS), summarize)
    write_results("hsdp_cluster", {"bandwidth": args.bandwidth, "model": args.model,
                                   "steps": args.steps, "batch": args.batch, "seq": args.seq,
                                   "runs": rows}, report(rows, args))


if __name__ == "__main__":
    main()
