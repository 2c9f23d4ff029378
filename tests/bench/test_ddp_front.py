"""benchmarks/ddp_front.py in its smallest configuration: 2 × 2 ranks on loopback
(``--local``: no namespaces, so the two "links" are labels), tiny models, a few steps."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "ddp_front.py")


@pytest.mark.slow
@pytest.mark.sweep  # a benchmark's smoke run, outside CI
def test_smallest_grid_writes_its_table_and_plot(tmp_path):
    hooks = "allreduce,powersgd-r1,acp-r4-int8,compute-only"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--local", "--links", "50mbit,1gbit", "--seeds", "0",
         "--models", "gpt-tiny,torchnn-tiny", "--hooks", hooks, "--loss-steps", "8",
         "--time-steps", "4", "--results", str(tmp_path), "--port", "29583"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, verdicts = (tmp_path / "ddp_front.md").read_text().split("For each PowerSGD rank")
    rows = [line for line in table.splitlines() if line.startswith("| gpt") or
            line.startswith("| torchnn")]
    # one verdict per (model, link) for its one PowerSGD rank
    assert sum(line.startswith("| gpt") for line in verdicts.splitlines()) == 2
    assert len(rows) == 2 * 2 * 4  # models × links × hooks
    # the timing runs reproduce the loss runs' first steps bit for bit, and the
    # data-parallel hooks keep replicas identical (compute-only alone lets them drift)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1].startswith("yes"), row
        assert ("replicas differ" in cells[-1]) == (cells[2] == "compute-only"), row
    assert (tmp_path / "ddp_front.png").stat().st_size > 10_000
    assert "load" in proc.stdout


def test_an_unknown_hook_is_refused_naming_the_allowed_ones(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--local", "--hooks", "powersgd-r3",
                           "--results", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2
    assert "powersgd-r3" in proc.stderr and "powersgd-r4" in proc.stderr
