"""``commpress compare``: the same training run under several policies, side by side.

Each policy trains in a run directory of its own (``OUT/<policy>``), so a comparison
resumes as a whole: ``--resume OUT`` continues each policy from its own checkpoint,
starts the policies that never saved one, and reuses the summary of those that
finished. Under a launcher every policy trains in the one process group.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from commpress.console import console
from commpress.files import write_json
from commpress.train import checkpoint
from commpress.train.config import TrainConfig, policy_slug
from commpress.train.errors import RunFailedError
from commpress.train.loop import launched, launched_group, train
from commpress.train.report import compare_table, plot_compare
from commpress.validate import InputError


def read_history(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compare(policies: list[str], base: TrainConfig, out_dir: str | None = None,
            json_path: str | None = None,
            runner: Callable[[TrainConfig], dict | None] = train) -> dict[str, dict[str, Any]]:
    """Train once per policy (same seed and data) with ``runner`` (``train``, or
    ``simulate``); print a table, write plots and JSON.

    Under ``torchrun`` every rank trains; rank 0 alone reports (other ranks return ``{}``).
    Raises :class:`RunFailedError` after the report if a policy trained nothing.
    """
    if not policies:
        raise InputError("--policies is empty; give a comma-separated list such as none,hybrid")
    out_dir = out_dir or base.out or f"runs/compare-s{base.seed}"
    runs = policy_runs(policies, base, out_dir)
    reporter = int(os.environ.get("RANK", "0")) == 0
    summaries, histories, failed = {}, {}, []
    with launched_group(base):
        for name, cfg, finished in runs:
            if reporter:
                console(stderr=True).print(f"[bold]policy {name}[/bold]"
                                           + (" (finished before)" if finished else ""))
            try:
                summary = runner(cfg) if finished is None else finished if reporter else None
            except RunFailedError as e:  # reported with the others; the rest still run
                summary = e.summary
                failed.append(str(e))
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
    write_json(os.path.join(out_dir, "compare.json"), result)
    if json_path:
        write_json(json_path, result)
    if failed:
        raise RunFailedError("; ".join(failed))
    return summaries


def policy_runs(policies: list[str], base: TrainConfig,
                out_dir: str) -> list[tuple[str, TrainConfig, dict[str, Any] | None]]:
    """Each policy's configuration (run directory ``out_dir/<policy>``) and, when
    resuming, the summary of a policy that had finished already (else None)."""
    runs = []
    for name in policies:
        slug = policy_slug(name)
        cfg = dataclasses.replace(base, policy=name, out=os.path.join(out_dir, slug))
        finished = None
        if base.resume:
            saved = os.path.join(base.resume, slug)
            step = _saved_step(saved)
            finished = _finished_summary(saved, cfg) if step == cfg.steps else None
            cfg = dataclasses.replace(cfg, resume=saved if step is not None else None)
        runs.append((name, cfg, finished))
    if base.resume and all(cfg.resume is None for _, cfg, _ in runs):
        dirs = ", ".join(os.path.join(base.resume, policy_slug(n)) for n in policies)
        raise InputError(f"--resume {base.resume!r} holds no checkpoint of these policies "
                         f"(looked in {dirs}); allowed: the output directory of an earlier "
                         "comparison with --checkpoint-every, which keeps one run per policy")
    return runs


def _saved_step(run_dir: str) -> int | None:
    """The step of ``run_dir``'s newest complete checkpoint; None if it has none."""
    try:
        directory, _ = checkpoint.find(run_dir)
        return checkpoint.read_manifest(directory)["step"]
    except checkpoint.CheckpointError:
        return None


# what may change between a run and the comparison that takes its results over
NOT_COMPARED = ("out", "resume", "progress", "timeout_s", "checkpoint_every")


def _finished_summary(run_dir: str, cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a run that trained all of ``cfg.steps`` with ``cfg``'s settings
    (None if it wrote none: it is resumed, and refused, as any other)."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return None
    saved = saved.get("train") or saved.get("simulate") or {}
    world = int(os.environ["WORLD_SIZE"]) if launched() else None
    mine = cfg.resolved(world).to_dict()
    for key, value in mine.items():
        if key not in saved:  # a field added since that run: it ran the field's default
            field = next(f for f in dataclasses.fields(TrainConfig) if f.name == key)
            saved[key] = getattr(dataclasses.replace(cfg, **{key: field.default}).resolved(
                world), key)
        if key not in NOT_COMPARED and saved.get(key) != value:
            raise InputError(f"--resume: {run_dir!r} finished with {key}={saved.get(key)!r}, "
                             f"this comparison has {key}={value!r}; resume with the same value")
    return summary
