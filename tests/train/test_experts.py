"""The reference trainer's mixture of experts with expert parallelism, end to end on Gloo:
ep spreads the experts without changing the math, expert replicas stay identical, a
resume equals the uninterrupted run."""

import json
import os

import pytest
import torch

from commpress.train import checkpoint
from commpress.train.config import TrainConfig
from commpress.train.loop import train

MOE = dict(model="moe-tiny", steps=6, batch_size=8, seq_len=32, warmup=2, eval_every=0,
           eval_batches=2, max_data_bytes=300_000, progress=False, bucket_numel=20_000)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _model(out, step, rank):
    return torch.load(checkpoint.rank_file(out, step, rank), map_location="cpu",
                      weights_only=True)["model"]


def test_expert_parallelism_keeps_the_single_copy_curve(tmp_path):
    """ep 1 and 2 over 4 data-parallel ranks run the same model on the same tokens:
    only summation orders differ (exact ep codecs)."""
    curves = {}
    for ep in (1, 2):
        out = str(tmp_path / f"ep{ep}")
        summary = train(TrainConfig(policy="none", dp=4, ep=ep, out=out, **MOE))
        curves[ep] = _losses(out)
        assert summary["ep"] == ep
    assert curves[2] == pytest.approx(curves[1], rel=2e-4)
    assert curves[1][-1] < curves[1][0]  # it trains


@pytest.mark.slow
def test_expert_replicas_are_identical_and_a_resume_equals_the_run(tmp_path):
    """hybrid compresses the dispatch and combine (int8) and the gradients: the experts
    a rank holds equal, bit for bit, those of the rank with the same experts in the other
    expert-parallel group; a run stopped at step 3 and resumed equals the whole run."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    base = dict(MOE, policy="hybrid", dp=4, ep=2, checkpoint_every=3)
    summary = train(TrainConfig(out=full, **base))
    assert {"ep.dispatch", "ep.combine", "ep.dispatch_grad", "ep.combine_grad"} <= set(
        summary["wire_bytes"])
    assert summary["bits_per_elem"]["ep.dispatch"] < 32
    # ranks 0 and 2 hold experts 0-3, ranks 1 and 3 experts 4-7
    models = [_model(full, 6, r) for r in range(4)]
    experts = [n for n in models[0] if n.endswith(("mlp.w_in", "mlp.w_out"))]
    assert experts
    for name in experts:
        assert torch.equal(models[0][name], models[2][name])
        assert torch.equal(models[1][name], models[3][name])
        assert not torch.equal(models[0][name], models[1][name])
    for name in set(models[0]) - set(experts):  # dense weights: one replica everywhere
        assert all(torch.equal(models[0][name], m[name]) for m in models[1:])
    train(TrainConfig(out=part, **dict(base, steps=3)))
    train(TrainConfig(out=part, resume=part, **base))
    assert _losses(part) == _losses(full)
