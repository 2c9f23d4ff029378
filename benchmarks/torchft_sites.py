"""torchft's own DiLoCo across shaped links: its fp32 all-reduce against commpress's codes.

    python benchmarks/torchft_sites.py [--sites 2] [--links 100mbit] [--sync-every 32]
        [--steps 66] [--rows torchft,torchft-int8,torchft-int4,local]

One torchft replica group per site: one process in a network namespace of its own
(``commpress.testbed``'s ``Cluster``: ``tc tbf`` at the link's rate both ways), torchft's
lighthouse in site 0's process, torchft's ``Manager`` on its ``ProcessGroupGloo``, and
torchft's ``DiLoCo`` (H = ``--sync-every``, Nesterov outer SGD lr 0.7 momentum 0.9) over
AdamW inside the site — the same model, data and batch as ``diloco_sites.py`` (gpt-3m,
global batch 16 × 128 bytes split over the sites, torch's ``_inductor`` sources).

Rows: ``torchft`` (its Gloo all-reduce, fp32), ``torchft-int8`` / ``torchft-int4`` (the
Manager's process group wrapped by ``commpress.torchft.compress`` with ``diloco-int8`` /
``diloco-int4``), ``-buckets`` (torchft's DiLoCo with ``use_bucketization=True``: one
all-reduce of a flat buffer per sync, not one per parameter), and ``local`` (the same loop
without torchft: the compute floor); ``commpress-int2ef`` / ``commpress-sparse``:
``commpress.torchft.DiLoCo`` on the same Manager (its fragments, error feedback and outer
step: ``diloco-int2ef`` Nesterov lr 0.7 momentum 0.9, ``diloco-sparse`` lr 1 no momentum).
Columns: seconds per inner step (mean after the first two), compute utilization
(``local``'s ÷ the row's) and bytes site 0 sent on its link per inner step, less what the
``local`` row sent (the start-up); then where a sync's time goes, per sync on site 0:
torchft's quorum (``Manager.start_quorum``), the pseudo-gradients' all-reduces issued
(``prepare_sync``), waited for (``perform_sync`` up to its commit vote), the commit vote
(``Manager.should_commit``) and the outer step after it. Needs root and iproute2. Writes
``benchmarks/results/torchft_sites.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
from _common import RESULTS, rank0_result, rank_flags, write_markdown

DATA = os.path.join(os.path.dirname(torch.__file__), "_inductor")
PORT = 29610  # the lighthouse's, in site 0 (the ranks' MASTER_PORT)
WARMUP = 2
# the policy wrapping the Manager's process group (None: torchft's own), and whether
# torchft's DiLoCo packs the pseudo-gradients into one buffer (use_bucketization)
ROWS = {"torchft": (None, False), "torchft-int8": ("diloco-int8", False),
        "torchft-int4": ("diloco-int4", False), "torchft-buckets": (None, True),
        "torchft-int4-buckets": ("diloco-int4", True), "local": (None, False)}
# commpress.torchft.DiLoCo on the same Manager: its own fragments and error feedback
OURS = {"commpress-int2ef": "diloco-int2ef", "commpress-sparse": "diloco-sparse"}
ROWS.update({row: (None, False) for row in OURS})


# -- one site (runs inside its namespace) -------------------------------------------------

def site(args) -> dict:
    """Train ``args.steps`` inner steps as the site of this process's ``RANK``, the row
    ``args.policy``; returns its timings."""
    from torch.distributed import TCPStore

    import commpress
    from commpress.model.gpt import GPT, config_from_preset
    from commpress.train.data import TextData, load_tokens

    me = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every site starts from the same weights: no healing at step 0
    model = GPT(config_from_preset(args.model, block_size=128))
    data = TextData(load_tokens(DATA, max_bytes=8 << 20))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    per_site = 16 // args.sites

    def step(i: int) -> float:
        x, y = data.batch("train", 16, 128, 0, i)
        _, loss = model(x[me * per_site:(me + 1) * per_site],
                        y[me * per_site:(me + 1) * per_site])
        loss.backward()
        inner.step()
        inner.zero_grad()
        return loss.item()

    walls: list[float] = []
    if args.policy == "local":
        for i in range(args.steps):
            step(i)
            walls.append(time.perf_counter())
        return {"walls": walls}
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    address, port = args.ips.split(",")[me], os.environ["MASTER_PORT"]
    lighthouse = None
    if me == 0:
        lighthouse = LighthouseServer(bind=f"0.0.0.0:{port}", min_replicas=args.sites)
    timeout = timedelta(seconds=120)
    pg = ProcessGroupGloo(timeout=timeout)
    policy, buckets = ROWS[args.policy]
    if policy is not None:
        pg = commpress.torchft.compress(pg, policy, timeout=timeout).process_group
    store = TCPStore(address, 0, 1, is_master=True)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=pg, min_replica_size=args.sites, use_async_quorum=False,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"site{me}", store_addr=address, store_port=store.port, rank=0,
        world_size=1, hostname=address, init_sync=False,  # identical seeds: nothing to heal
        lighthouse_addr=f"http://{os.environ['MASTER_ADDR']}:{port}",
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    commpress.reset_stats()
    phases = SyncPhases(manager)
    try:
        if args.policy in OURS:
            sync = commpress.torchft.DiLoCo(manager, model, inner, sync_every=args.sync_every,
                                            policy=OURS[args.policy])
            for i in range(args.steps):
                step(i)
                walls.append(time.perf_counter())
            sync.remove()
        else:
            with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every,
                        backup_device=torch.device("cpu"), pin_memory=False,
                        use_bucketization=buckets):
                for i in range(args.steps):
                    step(i)
                    walls.append(time.perf_counter())
        stats = commpress.stats()
    finally:
        phases.restore()
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()
    return {"walls": walls, "step": manager.current_step(), "phases": phases.seconds,
            "wire_bytes": sum(s["wire_bytes"] for s in stats.values())}


class SyncPhases:
    """Seconds spent in each phase of torchft's sync, summed: the Manager's quorum and
    commit vote, and a fragment's prepare (issue the all-reduces) and perform (wait for
    them, vote, outer step), timed by wrapping them while the row runs."""

    def __init__(self, manager) -> None:
        from torchft.local_sgd import _StreamingDiLoCoFragment

        self.seconds: dict[str, float] = {}
        self.undo = []
        for owner, name in ((manager, "start_quorum"), (manager, "should_commit"),
                            (_StreamingDiLoCoFragment, "prepare_sync"),
                            (_StreamingDiLoCoFragment, "perform_sync")):
            original = getattr(owner, name)
            setattr(owner, name, self._timed(name, original))
            self.undo.append((owner, name, original))

    def _timed(self, name, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            if isinstance(owner, type):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance's own wrapper: its class's again


# -- the driver -------------------------------------------------------------------------

def time_row(args, row: str, link: str) -> dict:
    from commpress.testbed.netns import Cluster

    with Cluster(args.sites, link) as cluster:
        flags = [f"--ips={','.join(cluster.ip(i) for i in range(args.sites))}",
                 *rank_flags(args, ("sites", "steps", "sync_every", "model"))]
        site0 = rank0_result(cluster, __file__, args.name, row, flags, PORT, args.timeout,
                             nodes=args.sites, per_node=1)
        sent, _ = cluster.link_bytes(0)
    walls = site0["walls"]
    return {"s_per_step": (walls[-1] - walls[WARMUP - 1]) / (len(walls) - WARMUP),
            "sent_node0": sent, "steps": len(walls), "syncs": site0.get("step"),
            "wire_bytes_node0": site0.get("wire_bytes"), "phases": site0.get("phases")}


def report(args, cache: dict) -> str:
    """Every row timed so far (this run's and earlier ones'), per link."""
    lines = [f"# torchft's DiLoCo across {args.sites} sites ({args.model}, H = "
             f"{args.sync_every}, {args.steps} inner steps)", ""]
    for link in args.links.split(","):
        timing = {r: cache[f"{args.sites}|{link}|{r}"] for r in ROWS
                  if f"{args.sites}|{link}|{r}" in cache}
        if "local" not in timing:
            continue
        floor, base = timing["local"]["s_per_step"], timing["local"]["sent_node0"]
        lines += [f"## {link} per site's link", "",
                  "| row | s / inner step | compute utilization | bytes / step sent by site 0 "
                  "| outer steps committed |", "|---|---|---|---|---|"]
        for r, t in timing.items():
            per_step = (t["sent_node0"] - base) / t["steps"]
            syncs = "-" if t["syncs"] is None else t["syncs"]
            lines.append(f"| {r} | {t['s_per_step']:.3f} | {100 * floor / t['s_per_step']:.1f} % "
                         f"| {per_step / 1e3:,.1f} kB | {syncs} |")
        lines.append("")
        profiled = {r: t for r, t in timing.items() if t.get("phases") and t["syncs"]}
        if profiled:
            lines += ["Seconds per sync on site 0 (each phase summed over the run ÷ syncs):",
                      "", "| row | quorum | issue all-reduces | wait + vote + outer step "
                      "| of which the commit vote | sync overhead per sync |",
                      "|---|---|---|---|---|---|"]
            for r, t in profiled.items():
                ph, n = t["phases"], t["syncs"]
                extra = (t["s_per_step"] - floor) * args.sync_every
                lines.append(
                    f"| {r} | {ph.get('start_quorum', 0) / n:.3f} | "
                    f"{ph.get('prepare_sync', 0) / n:.3f} | {ph.get('perform_sync', 0) / n:.3f} "
                    f"| {ph.get('should_commit', 0) / n:.3f} | {extra:.3f} |")
            lines.append("")
    return write_markdown(f"{args.name}.md", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--links", default="100mbit")
    ap.add_argument("--steps", type=int, default=66, help="inner steps (2 + 2·H)")
    ap.add_argument("--sync-every", type=int, default=32)
    ap.add_argument("--model", default="gpt-3m")
    ap.add_argument("--rows", default="torchft,torchft-int8,torchft-int4,local")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per row")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--name", default="torchft_sites", help="results/NAME.{json,md}")
    # one site's process (run_ranks starts it inside the site's namespace)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)  # the row
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ips", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        result = site(args)
        if os.environ["RANK"] == "0":  # site 0's timings are the row's
            with open(args.out, "w") as f:
                json.dump(result, f)
        return
    rows = args.rows.split(",")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{args.name}.json")
    cache = {} if args.fresh or not os.path.exists(path) else json.load(open(path))
    for link in args.links.split(","):
        for r in rows:
            key = f"{args.sites}|{link}|{r}"
            if key in cache:
                continue
            print(f"[torchft_sites] {key}", flush=True)
            cache[key] = time_row(args, r, link)
            with open(path, "w") as f:
                json.dump(cache, f, indent=1)
    report(args, cache)


if __name__ == "__main__":
    main()
