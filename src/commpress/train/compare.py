"""``commpress compare``: the same training run under several policies, side by side."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from commpress.console import console
from commpress.train.config import TrainConfig, policy_slug
from commpress.train.loop import train
from commpress.train.report import compare_table, plot_compare


def read_history(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compare(policies: list[str], base: TrainConfig, out_dir: str | None = None,
            json_path: str | None = None,
            runner: Callable[[TrainConfig], dict | None] = train) -> dict[str, dict[str, Any]]:
    """Train once per policy (same seed and data) with ``runner`` (``train``, or
    ``simulate``); print a table, write plots and JSON.

    Under ``torchrun`` every rank trains; rank 0 alone reports (other ranks return ``{}``).
    """
    if not policies:
        raise ValueError("--policies is empty; give a comma-separated list such as none,hybrid")
    out_dir = out_dir or base.out or f"runs/compare-s{base.seed}"
    summaries, histories = {}, {}
    for name in policies:
        console(stderr=True).print(f"[bold]policy {name}[/bold]")
        cfg = dataclasses.replace(base, policy=name, out=os.path.join(out_dir, policy_slug(name)))
        summary = runner(cfg)
        if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
            continue
        summaries[name] = summary
        histories[name] = read_history(summary["out"])
    if not summaries:
        return {}
    console().print(compare_table(summaries))
    os.makedirs(out_dir, exist_ok=True)
    plot_compare(histories, summaries, os.path.join(out_dir, "compare.png"))
    result = {"policies": summaries}
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return summaries
