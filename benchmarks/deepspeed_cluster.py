"""DeepSpeed ZeRO-2 on the emulated cluster: the stock engine against commpress inside it.

    python benchmarks/deepspeed_cluster.py [--steps 30] [--model gpt-3m]
        [--bandwidth 50mbit] [--policies exact,sdp4bit]

2 nodes × 2 ranks (network namespaces, tbf in both directions at --bandwidth), Gloo,
DeepSpeed 0.19.8 ZeRO-2 on CPU (overlap_comm, contiguous_gradients, its default
reduce_scatter and use_multi_rank_bucket_allreduce), AdamW, GPT of --model, global
batch 8 × 128 tokens, seed 0. ``exact`` is the stock engine, untouched; any other name
is a commpress policy applied with ``commpress.deepspeed.compress``. For each: the
median step time (steps after the first two), the training loss (mean of the last five
steps), commpress's bytes per label (per rank, per step), and the bytes each node's
link carried during the steps. Writes benchmarks/results/deepspeed_cluster.{json,md}.
Needs root and iproute2 (see ``commpress testbed``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
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

BATCH, SEQ = 8, 128


def deepspeed_config(world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // world,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1,
                                                      "torch_adam": True}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2, "overlap_comm": True,
                                  "contiguous_gradients": True,
                                  "reduce_bucket_size": 1 << 20,
                                  "allgather_bucket_size": 1 << 20},
            "steps_per_print": 10**9}


def rank_main(args) -> None:
    """One rank, inside its node's namespace (environment as torchrun gives it)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import deepspeed
    from deepspeed.utils import logger

    import commpress
    from commpress.model.gpt import GPT, config_from_preset
    from commpress.train.data import TextData, load_tokens

    logger.setLevel(logging.WARNING)
    # the shared-memory op DeepSpeed compiles at start (minutes) serves inference only
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(0)
    model = GPT(config_from_preset(args.model, block_size=SEQ))
    engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(world),
                                      model_parameters=model.parameters())
    if args.policy != "exact":
        commpress.deepspeed.compress(engine, args.policy)
    data = TextData(load_tokens(max_bytes=8 << 20))
    per = BATCH // world
    losses, times = [], []
    dist.barrier()
    commpress.reset_stats()
    link_before = namespace_link_bytes()
    for step in range(args.steps):
        x, y = data.batch("train", BATCH, SEQ, 0, step)
        start = time.perf_counter()
        _, loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        times.append(time.perf_counter() - start)
        losses.append(mean.item() / world)
    dist.barrier()
    # each node's link during the steps: read by the first rank of each node
    link = torch.tensor([a - b for a, b in zip(namespace_link_bytes(), link_before)])
    links = [torch.zeros_like(link) for _ in range(world)]
    dist.all_gather(links, link)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "step_s": times, "stats": commpress.stats(),
                       "numel": sum(p.numel() for p in model.parameters()),
                       "link_bytes": [{"sent": int(x[0]), "received": int(x[1])}
                                      for x in links[::RANKS_PER_NODE]]}, f)
    dist.barrier()


def summarize(name: str, r: dict, steps: int) -> dict:
    return {"policy": name, "step_s_median": statistics.median(r["step_s"][2:]),
            "loss_last5": statistics.mean(r["losses"][-5:]), "losses": r["losses"],
            "numel": r["numel"],
            "bytes_per_rank_step": {label: s["wire_bytes"] / steps
                                    for label, s in sorted(r["stats"].items())},
            "bits_per_element": {label: 8 * s["wire_bytes"] / s["elements"]
                                 for label, s in sorted(r["stats"].items()) if s["elements"]},
            "seconds_per_step": {label: {k: s[k] / steps for k in ("encode_s", "decode_s",
                                                                  "comm_s")}
                                 for label, s in sorted(r["stats"].items())},
            "link_sent_mb_per_node_step": [x["sent"] / 1e6 / steps for x in r["link_bytes"]],
            "load_average": r["load_average"]}


def report(rows: list[dict], args) -> str:
    base = rows[0]
    lines = [f"DeepSpeed ZeRO-2, {NODES} nodes × {RANKS_PER_NODE} ranks at {args.bandwidth}, "
             f"{args.model} ({base['numel'] / 1e6:.2f} M parameters), {args.steps} steps",
             "", "| policy | step s (median) | speedup | loss (last 5) | vs exact | "
             "load (1 min) | link MB / node / step | commpress bytes / rank / step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        labels = ", ".join(f"{k} {v / 1e6:.3f} MB ({r['bits_per_element'][k]:.2f} b)"
                           for k, v in r["bytes_per_rank_step"].items()) or "—"
        lines.append(f"| {r['policy']} | {r['step_s_median']:.2f} | "
                     f"{base['step_s_median'] / r['step_s_median']:.2f}x | "
                     f"{r['loss_last5']:.4f} | "
                     f"{100 * (r['loss_last5'] / base['loss_last5'] - 1):+.2f} % | "
                     f"{r['load_average'][0]:.1f} → {r['load_average'][1]:.1f} | "
                     f"{statistics.mean(r['link_sent_mb_per_node_step']):.2f} | {labels} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cluster_args(ap, steps=30, policies="exact,sdp4bit", port=29600)
    ap.add_argument("--model", default="gpt-3m")
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    rows = run_policies(__file__, "deepspeed_cluster", args, rank_flags(args, ("model", "steps")),
                        summarize, env={"DS_ACCELERATOR": "cpu"})
    write_results("deepspeed_cluster", {"bandwidth": args.bandwidth, "model": args.model,
                                        "steps": args.steps, "runs": rows},
                  report(rows, args))


if __name__ == "__main__":
    main()
