"""The one-shot GPU scripts dry-run on CPU (Triton in interpreter mode, Gloo): a GPU
run is rare and short, so a script that broke since it last ran must be caught here,
not there. Each check row must also pass."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _run(script: str, args: list[str], out: str, **env: str) -> list[dict]:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script),
                           "--device", "cpu", "--out", out, *args],
                          env={**os.environ, "TRITON_INTERPRET": "1", **env},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = os.path.splitext(script)[0] + ".jsonl"
    with open(os.path.join(out, name)) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.sweep  # a benchmark's smoke run, outside CI (kernel checks: tests/kernels)
def test_gpu_kernels_script_dry_runs_and_its_checks_pass(tmp_path):
    rows = _run("gpu_kernels.py", ["--tune"], str(tmp_path), COMMPRESS_KERNELS="triton")
    checks = [r for r in rows if "ok" in r]
    # two dtypes × (int, fp8, trit configs, rows = flat for 3 widths, top-k), and the
    # two fp32 product precisions
    assert len(checks) == 2 * (6 + 3 + 2 + 3 + 3) + 2
    assert {r["fp32_dot"] for r in checks if "fp32_dot" in r} == {"ieee", "tf32x3"}
    assert all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    hosts = {r["host_path"] for r in rows if "host_path" in r}
    assert {"int4", "int4:hadamard=128", "fp8", "int2:packing=trits", "topk:ratio=0.01"} <= hosts
    tuned = {r["tune"] for r in rows if "tune" in r and "GBps" in r}
    assert {r["row_kernels"] for r in rows if r.get("tune") == "dequantize"} == {True, False}
    assert tuned == {"quantize", "dequantize", "fp8_quantize", "fp8_dequantize",
                     "trits_quantize", "trits_dequantize", "topk"}
    assert any("dequant_reduce_requant" in r for r in rows)


@pytest.mark.slow
@pytest.mark.sweep  # a benchmark's smoke run, outside CI
def test_gpu_multirank_script_dry_runs_and_its_checks_pass(tmp_path):
    rows = _run("gpu_multirank.py", ["--model", "gpt-tiny", "--steps", "3"], str(tmp_path))
    by = {}
    for r in rows:
        by.setdefault(r.get("check"), []).append(r)
    assert "failed" not in by, by.get("failed")
    assert len(by["collectives"]) == 6 and all(r["ok"] for r in by["collectives"])
    assert all(r["identical_every_step"] for r in by["replicas"]), by["replicas"]
    assert len(by["train"]) == 2 and all(r["val_loss"] > 0 for r in by["train"])
    assert len(by["end_to_end"]) == 6
