"""Determinism: the same seed gives the same run; replicas never drift."""

import json
import os

import pytest

from commpress.launch import spawn
from commpress.train.config import TrainConfig
from commpress.train.loop import train
from tests.reliability import workers


@pytest.mark.slow
def test_same_seed_same_loss_trajectory(tmp_path):
    cfg = dict(model="gpt-tiny", steps=5, batch_size=8, seq_len=32, eval_every=0,
               eval_batches=1, progress=False, policy="naive", dp=2, tp=1, pp=1,
               max_data_bytes=200_000, bucket_numel=20_000)
    runs = []
    for name in ("a", "b"):
        train(TrainConfig(out=str(tmp_path / name), **cfg))
        with open(os.path.join(tmp_path / name, "metrics.jsonl")) as f:
            runs.append([json.loads(line)["loss"] for line in f])
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.sweep  # outside CI: every step's replicas are compared in the shorter runs too
def test_replicas_identical_at_every_step_of_a_1000_step_run():
    digests = spawn(workers.long_run_replicas, 2, (1000,), timeout=900)
    assert len(digests[0]) == 1000
    first_diff = next((i for i, (a, b) in enumerate(zip(*digests)) if a != b), None)
    assert first_diff is None, f"replicas differ from step {first_diff}"
