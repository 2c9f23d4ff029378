"""What people look at: a progress bar while training, tables and PNG plots after."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from commpress.console import console
from commpress.validate import InputError

AXES = ("dp", "tp", "pp", "ep", "outer")


def bytes_per_axis(wire: dict[str, float]) -> dict[str, float]:
    """Sum per-label byte counts into dp / tp / pp / ep / outer (DiLoCo across sites)."""
    return {axis: sum((v for label, v in wire.items() if label.split(".")[0] == axis), 0.0)
            for axis in AXES}


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class TrainProgress:
    """A rich progress bar: step, loss, tokens/s, step time, rank 0's bytes per axis."""

    def __init__(self, steps: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            console=console(stderr=True), transient=False)
        self.task = self.progress.add_task("train", total=steps, info="")
        self.progress.start()

    def update(self, r: dict[str, Any]) -> None:
        axes = bytes_per_axis(r.get("wire_bytes_rank0", {}))
        wire = " ".join(f"{a} {_human(v)}" for a, v in axes.items() if v)
        val = f" val {r['val_loss']:.3f}" if "val_loss" in r else ""
        sent = f" | rank 0 sent this step: {wire}" if wire else ""
        info = (f"loss {r['loss']:.3f}{val} | {r['tokens_per_s']:,.0f} tok/s | "
                f"{1e3 * r['step_time_s']:.0f} ms{sent}")
        self.progress.update(self.task, completed=r["step"], info=info)

    def close(self) -> None:
        self.progress.stop()


def summary_table(summary: dict[str, Any]) -> Table:
    t = Table(title=f"{summary['policy']}: dp{summary['dp']}×tp{summary['tp']}×pp{summary['pp']}"
                    f", {summary['model']}, {summary['steps']} steps")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("final validation loss", f"{summary['final_val_loss']:.4f}")
    t.add_row("byte unigram entropy", f"{summary['unigram_entropy']:.4f}")
    t.add_row("median step time", f"{1e3 * summary['step_time_s_median']:.1f} ms")
    t.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}")
    t.add_row("skipped steps", str(summary["skipped_steps"]))
    for what, ways in sorted(summary.get("fallback", {}).items()):
        t.add_row(f"fallback {what} (rank 0's buckets)",
                  ", ".join(f"{n} {way}" for way, n in ways.items() if n))
    for label, wire in sorted(summary["wire_bytes"].items()):
        raw = summary["raw_bytes"].get(label, 0)
        t.add_row(f"sent {label} (all ranks, whole run)",
                  f"{_human(wire)} ({summary['bits_per_elem'][label]:.2f} bits/elem, "
                  f"{raw / max(wire, 1):.1f}x smaller)")
    return t


def compare_table(results: dict[str, dict[str, Any]]) -> Table:
    base = results.get("none")
    t = Table(title="policy comparison (same seed, data and steps; bytes: all ranks, whole run)")
    for col in ("policy", "val loss", "Δ vs none", "step ms", "speedup",
                *(f"{a} bytes sent" for a in AXES)):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, s in results.items():
        axes = bytes_per_axis(s["wire_bytes"])
        delta = speed = "-"
        if base:
            delta = f"{100 * (s['final_val_loss'] / base['final_val_loss'] - 1):+.2f}%"
            speed = f"{base['step_time_s_median'] / s['step_time_s_median']:.2f}x"
        t.add_row(name, f"{s['final_val_loss']:.4f}", delta,
                  f"{1e3 * s['step_time_s_median']:.1f}", speed,
                  *(_human(axes[a]) for a in AXES))
    return t


def plot_loss(history: list[dict[str, Any]], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train", lw=1)
    val = [r for r in history if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    mark_promotions(ax, history)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_promotions(ax: Any, history: list[dict[str, Any]], color: str = "red") -> None:
    """A dashed line where the convergence guard promoted buckets, labelled with how many
    went to which codec."""
    first = True
    for r in history:
        promoted = [e for sampled in r.get("guard", []) for e in sampled["promoted"]]
        if not promoted:
            continue
        codecs: dict[str, int] = {}
        for e in promoted:  # "dp.grad=topk:ratio=0.04" → "topk:ratio=0.04"
            short = e["to"].split(", ")[-1].split("=", 1)[-1].split(",")[0]
            codecs[short] = codecs.get(short, 0) + 1
        ax.axvline(r["step"], color=color, ls="--", lw=0.8, alpha=0.7,
                   label="guard promotion" if first else None)
        ax.annotate("; ".join(f"{n}× → {c}" for c, n in codecs.items()),
                    (r["step"], 0.98), xycoords=("data", "axes fraction"), fontsize=7,
                    rotation=90, va="top", ha="right", color=color)
        first = False


def plot_guard(history: list[dict[str, Any]], path: str,
               budgets: dict[str, float] | None = None, title: str = "") -> bool:
    """The convergence guard's signals per bucket over the sampled steps — one panel per
    signal the run measured (relative error of what was sent without error feedback,
    memory ratio, weight gap), the budget dashed, promotions marked; False (nothing
    written) for a run without the guard's records."""
    sampled = [(r["step"], g) for r in history for g in r.get("guard", [])]
    if not sampled:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in ("rel_error", "memory_ratio", "weight_gap")
             if any(any(v > 0 for v in g.get(s, [])) for _, g in sampled)] or ["rel_error"]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        lines: dict[str, tuple[list[int], list[float]]] = {}
        for step, g in sampled:
            for j, v in zip(g["buckets"], g.get(name, [])):
                xs, ys = lines.setdefault(f"{g['what']} {j}", ([], []))
                xs.append(step)
                ys.append(v)
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, ".-", lw=0.8, ms=2, label=label if len(lines) <= 8 else None)
        if budgets and name in budgets:
            ax.axhline(budgets[name], color="black", ls=":", lw=1, label="budget")
        mark_promotions(ax, history)
        ax.set(xlabel="step", ylabel=name.replace("_", " "),
               title=f"{title} {name.replace('_', ' ')}".strip())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_compare(histories: dict[str, list[dict]], summaries: dict[str, dict], path: str) -> None:
    """Loss vs step, loss vs wall time, and bytes per axis, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, hist in histories.items():
        line, = axes[0].plot([r["step"] for r in hist], [r["loss"] for r in hist], lw=1,
                             label=name)
        mark_promotions(axes[0], hist, line.get_color())
        axes[1].plot([r["wall_s"] for r in hist], [r["loss"] for r in hist], lw=1, label=name)
    axes[0].set(xlabel="step", ylabel="train loss", title="loss vs step")
    axes[1].set(xlabel="wall time (s)", ylabel="train loss", title="loss vs wall time")
    names = list(summaries)
    width = 0.8 / len(AXES)
    for i, axis in enumerate(AXES):
        vals = [bytes_per_axis(summaries[n]["wire_bytes"])[axis] / 1e6 for n in names]
        axes[2].bar([j + i * width for j in range(len(names))], vals, width, label=axis)
    axes[2].set_xticks([j + width for j in range(len(names))], names, rotation=20)
    axes[2].set(ylabel="MB on the wire (all ranks)", title="bytes per axis")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class TensorBoardLog:
    """``--tensorboard``: each step's record as TensorBoard scalars under ``directory``, as
    the run goes — the loss, validation loss, learning rate, step time, bytes per axis, and
    the convergence guard's signals per bucket (``guard/<front-end>/<signal>/bucket<j>``)
    with each promotion as text. ``first_step``: a resumed run's first step; what an
    earlier run wrote from it on is dropped from the view (TensorBoard's purge)."""

    def __init__(self, directory: str, first_step: int = 1) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboard is pinned with the engines
            raise InputError("tensorboard=True is not allowed without the tensorboard "
                             "package; allowed: pip install tensorboard, or tensorboard="
                             "False (metrics.jsonl holds the same numbers)") from None
        self.writer = SummaryWriter(directory, purge_step=first_step)

    def write(self, record: dict[str, Any]) -> None:
        step, add = record["step"], self.writer.add_scalar
        add("loss/train", record["loss"], step)
        if "val_loss" in record:
            add("loss/val", record["val_loss"], step)
        add("lr", record["lr"], step)
        add("step_time_s", record["step_time_s"], step)
        for axis, sent in bytes_per_axis(record["wire_bytes_rank0"]).items():
            if sent:
                add(f"wire_bytes_rank0/{axis}", sent, step)
        for sampled in record.get("guard", []):
            where = f"guard/{sampled['what']}"
            for signal in ("rel_error", "memory_ratio", "weight_gap"):
                for j, value in zip(sampled["buckets"], sampled.get(signal, [])):
                    add(f"{where}/{signal}/bucket{j}", value, step)
            for e in sampled["promoted"]:
                self.writer.add_text(f"{where}/promoted", f"bucket {e['bucket']}: {e['from']} "
                                     f"→ {e['to']} ({e['reason']})", step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
