"""Tables for ``commpress plan``."""

from __future__ import annotations

from typing import Any

from rich.table import Table

PARTS = ("compute_s", "dp_grad_s", "dp_param_s", "dp_exposed_s", "tp_s", "pp_s", "codec_s")


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
