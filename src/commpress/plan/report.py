"""Tables for ``commpress plan``."""

from __future__ import annotations

from typing import Any

from rich.table import Table

PARTS = ("compute_s", "dp_grad_s", "dp_param_s", "dp_exposed_s", "tp_s", "pp_s", "ep_s",
         "codec_s")


def plan_table(result: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    t.add_column("policy")
    for p in PARTS:
        t.add_column(p.removesuffix("_s").replace("_", " ") + " ms", justify="right")
    for col in ("step ms", "tokens/s", "TFLOPS/GPU", "speedup"):
        t.add_column(col, justify="right")
    for name, r in result["policies"].items():
        b = r["breakdown"]
        t.add_row(name, *(f"{1e3 * b[p]:.1f}" for p in PARTS), f"{1e3 * r['step_time_s']:.1f}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
                  f"{r['speedup_vs_none']:.2f}x")
    return t


def break_even_table(result: dict[str, Any]) -> Table:
    t = Table(title="break-even node bandwidth (below it, the codec pays)")
    t.add_column("policy")
    t.add_column("collective = codec")
    t.add_column("GB/s per node", justify="right")
    for name, r in result["policies"].items():
        for key, bw in r["break_even_inter_GBps"].items():
            t.add_row(name, key, "-" if bw is None else ("any" if bw == float("inf")
                                                          else f"{bw:,.1f}"))
    return t


def outer_table(outer: dict[str, Any], ddp: dict[str, Any], sync_every: int,
                sites: int) -> Table:
    """DiLoCo presets across the sites beside DDP over the same links."""
    t = Table(title=f"DiLoCo across {sites} sites (nodes), H = {sync_every}, beside DDP")
    for col in ("", "s / step", "exposed sync s", "compute utilization",
                "MB / step / node between sites", "speedup vs DDP"):
        t.add_column(col, justify="left" if not col else "right")
    compute = ddp["breakdown"]["compute_s"]
    t.add_row("DDP (all-reduce)", f"{ddp['step_time_s']:.3f}", "-",
              f"{100 * compute / ddp['step_time_s']:.1f} %", "-", "1.00x")
    for name, r in outer.items():
        t.add_row(name, f"{r['mean_step_s']:.3f}", f"{r['exposed_sync_s']:.2f}",
                  f"{100 * r['utilization']:.1f} %",
                  f"{r['inter_bytes_per_step_node'] / 1e6:.2f}",
                  f"{ddp['step_time_s'] / r['mean_step_s']:.2f}x")
    return t
