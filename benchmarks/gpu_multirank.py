"""On a CUDA GPU: the multi-rank path, checked and timed end to end.

    PYTHONPATH=src python benchmarks/gpu_multirank.py --out $OUT [--model gpt-125m]

4 ranks as 2 nodes × 2 share the GPU over Gloo with CUDA tensors (NCCL refuses two ranks
on one device), bf16:

1. every collective (all-reduce, reduce-scatter, all-gather, the two-level three,
   point-to-point) and codec against the exact float64 result;
2. ``ShardedOptimizer`` for every preset, the DDP hook (int2ef, sdp4bit) and FSDP2
   ``compress``: replicas bitwise identical after every step;
3. ``commpress train`` dp2 × tp2 and dp2 × pp2;
4. end to end on ``--model``: ZeRO none / sdp4bit / zeropp, DDP all-reduce / int2ef /
   PowerSGD rank 4 (ZeRO none and sdp4bit right after 1) — Gloo's trip through host
   memory is the slow link here.

Every row is printed and appended to ``gpu_multirank.jsonl`` under --out as it finishes
(a timeout keeps the finished rows). ``--device cpu --model gpt-tiny`` dry-runs it on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import commpress  # noqa: E402
from commpress.launch import spawn  # noqa: E402
from commpress.model.gpt import GPT, config_from_preset  # noqa: E402
from commpress.model.gpt import PRESETS as MODEL_PRESETS  # noqa: E402
from commpress.train.config import TrainConfig  # noqa: E402
from commpress.train.data import TextData, load_tokens  # noqa: E402
from commpress.train.loop import train  # noqa: E402

CODECS = ["none", "bf16", "int8", "int4:hadamard=128", "int2:packing=trits", "fp8"]


def _device(device_type: str) -> torch.device:
    """This rank's device (``spawn(device="cuda")`` made its GPU the current one)."""
    return (torch.device("cuda", torch.cuda.current_device())
            if device_type == "cuda" else torch.device("cpu"))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def collectives(rank: int, world: int, specs: list[str], device_type: str) -> list[dict]:
    """One row per codec; a codec that fails is a row with its error (every rank fails
    it alike: the agreement check runs before each collective)."""
    rows = []
    for spec in specs:
        try:
            rows.append(_collectives(rank, world, spec, _device(device_type)))
        except Exception as e:  # noqa: BLE001 - reported as a row
            rows.append({"codec": spec, "error": f"{type(e).__name__}: {e}"[:400], "ok": False})
    return rows


def _collectives(rank: int, world: int, spec: str, dev: torch.device) -> dict:
    topo = commpress.Topology(2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1 << 16, generator=g).to(dev, torch.bfloat16)
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    exact = torch.stack([e.double() for e in everyone]).sum(0)
    m = x.numel() // world
    checks = {}
    y = x.clone()
    commpress.all_reduce(y, spec, op="sum")
    checks["all_reduce"] = _rel(y, exact)
    out = torch.empty(m, device=dev, dtype=x.dtype)
    commpress.reduce_scatter(out, x, spec, op="sum")
    checks["reduce_scatter"] = _rel(out, exact.view(world, m)[rank])
    full = torch.empty(world * m, device=dev, dtype=x.dtype)
    commpress.all_gather(full, x[:m], spec)
    checks["all_gather"] = _rel(full, torch.cat([e[:m] for e in everyone]))
    y = x.clone()
    commpress.hierarchical_all_reduce(y, intra="none", inter=spec, topology=topo, op="sum")
    checks["hierarchical_all_reduce"] = _rel(y, exact)
    commpress.hierarchical_reduce_scatter(out, x, intra="int8", inter=spec, topology=topo,
                                          op="sum")
    checks["hierarchical_reduce_scatter"] = _rel(out, exact.view(world, m)[rank])
    commpress.hierarchical_all_gather(full, x[:m], inter=spec, topology=topo)
    checks["hierarchical_all_gather"] = _rel(full, torch.cat([e[:m] for e in everyone]))
    got = torch.empty(1024, device=dev, dtype=x.dtype)
    ops = [commpress.P2POp("send", x[:1024], (rank + 1) % world, spec),
           commpress.P2POp("recv", got, (rank - 1) % world, spec)]
    for h in commpress.batch_isend_irecv(ops):
        h.wait()
    checks["p2p"] = _rel(got, everyone[(rank - 1) % world][:1024])
    # each collective quantizes an element at most twice: its error stays within
    # 1.6 × one round trip of the codec on this rank's data (or bf16 rounding)
    c = commpress.codec(spec)
    trip = _rel(c.decode(c.encode(x)), x)
    ok = all(v <= max(1.6 * trip, 0.01) for v in checks.values())
    return {"codec": spec, **checks, "round_trip": trip, "ok": ok}


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: gather the shards
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def replicas(rank: int, world: int, model_name: str, device_type: str) -> dict:
    """Digests after every step for every preset (ShardedOptimizer), the DDP hook and FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _device(device_type)
    data = TextData(load_tokens(max_bytes=1 << 20))
    out: dict[str, list[str]] = {}

    def model():
        torch.manual_seed(0)
        return GPT(config_from_preset(model_name, block_size=64)).to(dev, torch.bfloat16)

    def steps(m, opt, name):
        digests = []
        for step in range(3):
            x, y = data.batch("train", 4 * world, 64, 0, step)
            per = x.shape[0] // world
            _, loss = m(x[rank * per:(rank + 1) * per].to(dev), y[rank * per:(rank + 1) * per]
                        .to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            digests.append(_digest(m))
        out[name] = digests

    for preset in commpress.list_presets():
        m = model()
        try:
            steps(m, commpress.ShardedOptimizer(m, torch.optim.AdamW, preset, lr=1e-3,
                                                topology=commpress.Topology(2)),
                  f"zero-{preset}")
        except ImportError as e:  # an optional codec library (zfpy) is not installed
            out[f"zero-{preset}"] = [f"not run: {e}"]
    for preset in ("int2ef", "sdp4bit"):
        m = DDP(model())
        m.register_comm_hook(*commpress.ddp_hook(m, preset, topology=commpress.Topology(2)))
        steps(m, torch.optim.AdamW(m.parameters(), lr=1e-3), f"ddp-{preset}")
    m = model()
    for block in m.blocks:
        fully_shard(block)
    fully_shard(m)
    commpress.fsdp.compress(m, "zeropp", topology=commpress.Topology(2))
    steps(m, torch.optim.AdamW(m.parameters(), lr=1e-3), "fsdp-zeropp")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--check-model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_multirank.jsonl")
    # run directories (metrics, plots) outside --out: a device call returns few files
    runs = tempfile.mkdtemp(prefix="gpu_multirank_runs_")

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    t0 = time.perf_counter()

    def guarded(what: str, fn) -> None:
        """One piece; a failure is a row with its error and the next piece still runs."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported as a row
            emit({"check": "failed", "what": what, "error": f"{type(e).__name__}: {e}"[:400],
                  "ok": False})

    def check_collectives() -> None:  # one launch for all codecs: a launch costs seconds
        for row in spawn(collectives, 4, (CODECS, args.device), ranks_per_node=2,
                         device=args.device, timeout=300)[0]:
            emit({"check": "collectives", **row})

    def check_replicas() -> None:
        ranks = spawn(replicas, 4, (args.check_model, args.device), ranks_per_node=2,
                      device=args.device, timeout=300)
        for name in ranks[0]:
            if ranks[0][name][0].startswith("not run"):
                emit({"check": "replicas", "run": name, "skipped": ranks[0][name][0]})
                continue
            emit({"check": "replicas", "run": name,
                  "identical_every_step": all(len({r[name][s] for r in ranks}) == 1
                                              for s in range(len(ranks[0][name])))})

    small = dict(model=args.check_model, steps=4, batch_size=8, seq_len=32, eval_every=0,
                 eval_batches=1, progress=False, device=args.device, backend="gloo", nproc=4,
                 ranks_per_node=2, dtype="bf16", max_data_bytes=1 << 20)

    def check_train(layout: dict) -> None:
        name = "-".join(f"{k}{v}" for k, v in layout.items())
        s = train(TrainConfig(policy="hybrid", out=os.path.join(runs, f"train-{name}"),
                              **layout, **small))
        emit({"check": "train", "layout": layout, "val_loss": s["final_val_loss"]})

    big = dict(small, model=args.model, steps=args.steps, batch_size=16,
               seq_len=min(256, MODEL_PRESETS[args.model].block_size), bucket_numel=1 << 24)

    def end_to_end(engine: str, policy: str, hook: str) -> None:
        s = train(TrainConfig(engine=engine, policy=policy, ddp_hook=hook,
                              out=os.path.join(runs, f"e2e-{engine}-{policy}-{hook}"), **big))
        emit({"check": "end_to_end", "model": args.model, "engine": engine, "policy": policy,
              "hook": hook, "step_time_s": s["step_time_s_median"],
              "val_loss": s["final_val_loss"], "elapsed_s": time.perf_counter() - t0})

    # the acceptance pair (ZeRO none against sdp4bit) before the longer checks, so a
    # timeout keeps it
    runs_e2e = [("sharded", "none", "commpress"), ("sharded", "sdp4bit", "commpress"),
                ("sharded", "zeropp", "commpress"), ("ddp", "none", "allreduce"),
                ("ddp", "int2ef", "commpress"), ("ddp", "none", "powersgd:4")]
    guarded("collectives", check_collectives)
    for run in runs_e2e[:2]:
        guarded(f"end_to_end {run}", lambda run=run: end_to_end(*run))
    guarded("replicas", check_replicas)
    for layout in ({"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}):
        guarded(f"train {layout}", lambda layout=layout: check_train(layout))
    emit({"check": "elapsed_s", "value": time.perf_counter() - t0})
    for run in runs_e2e[2:]:
        guarded(f"end_to_end {run}", lambda run=run: end_to_end(*run))

if __name__ == "__main__":
    main()
