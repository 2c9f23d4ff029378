"""The reference trainer end to end: layout parity, resume, outputs."""

import json
import os

import pytest

from commpress.train.config import TrainConfig
from commpress.train.loop import train

TINY = dict(model="gpt-tiny", steps=6, batch_size=8, seq_len=32, micro_batches=2, warmup=2,
            eval_every=3, eval_batches=2, max_data_bytes=300_000, progress=False,
            bucket_numel=20_000)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref"))
    train(TrainConfig(policy="none", dp=1, tp=1, pp=1, out=out, **TINY))
    return _losses(out)


@pytest.mark.parametrize(("dp", "tp", "pp"), [
    pytest.param(1, 2, 2, marks=pytest.mark.slow), (2, 2, 1),
    pytest.param(2, 1, 2, marks=pytest.mark.slow),
    pytest.param(4, 1, 1, marks=pytest.mark.slow)])
def test_none_policy_reproduces_the_single_rank_curve(reference_run, tmp_path, dp, tp, pp):
    out = str(tmp_path)
    train(TrainConfig(policy="none", dp=dp, tp=tp, pp=pp, out=out, **TINY))
    got = _losses(out)
    for a, b in zip(got, reference_run, strict=True):
        # same math, other summation orders (split matmuls, sharded reductions): fp32 only
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-4)
        if "val_loss" in b:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=2e-4)


def test_outputs_and_summary(tmp_path):
    out = str(tmp_path)
    summary = train(TrainConfig(policy="hybrid", dp=2, tp=1, pp=2, out=out, **TINY))
    for name in ("metrics.jsonl", "summary.json", "loss.png", "config.json"):
        assert os.path.exists(os.path.join(out, name)), name
    assert not os.path.exists(os.path.join(out, "ckpt"))  # checkpoint_every 0: none
    for key in ("final_val_loss", "step_time_s_median", "tokens_per_s", "wire_bytes",
                "raw_bytes"):
        assert key in summary
    # hybrid compresses every axis present: dp (8-bit grads, 8-bit params), pp (8-bit)
    assert set(summary["wire_bytes"]) >= {"dp.grad.intra", "dp.param", "pp.act", "pp.act_grad"}
    assert summary["bits_per_elem"]["pp.act"] == pytest.approx(8.25)


@pytest.mark.slow
def test_resume_is_bitwise_identical(tmp_path):
    full_dir, part_dir = str(tmp_path / "full"), str(tmp_path / "part")
    policy = "sdp4bit"
    base = dict(TINY, steps=6, checkpoint_every=3, eval_every=0)
    train(TrainConfig(policy=policy, dp=2, tp=2, pp=1, out=full_dir, **base))
    # stop after 3 steps (as a crash would), then resume from the run directory
    train(TrainConfig(policy=policy, dp=2, tp=2, pp=1, out=part_dir, **dict(base, steps=3)))
    train(TrainConfig(policy=policy, dp=2, tp=2, pp=1, out=part_dir, resume=part_dir, **base))
    full, resumed = _losses(full_dir), _losses(part_dir)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]


# activations with stochastic rounding and error feedback: state a careless evaluation
# would move (its forward sends activations through the same codecs)
STATEFUL_ACTIVATIONS = """
tp:
  act: "int8:rounding=stochastic"
  act_grad: {codec: "int4:rounding=stochastic", error_feedback: true}
pp:
  act: {codec: "int4:rounding=stochastic", error_feedback: true}
  act_grad: "int8:rounding=stochastic"
"""


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_evaluation_does_not_change_training(tmp_path, tp, pp):
    """The training losses are the same bits whether or not the run evaluates between
    steps: evaluation leaves the activation codecs' state as it found it."""
    policy = str(tmp_path / "stateful.yaml")
    with open(policy, "w") as f:
        f.write(STATEFUL_ACTIVATIONS)
    runs = {}
    for every in (0, 1):
        out = str(tmp_path / f"eval{every}")
        train(TrainConfig(policy=policy, dp=2, tp=tp, pp=pp, out=out,
                          **dict(TINY, steps=4, eval_every=every)))
        runs[every] = _losses(out)
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
    assert sum("val_loss" in r for r in runs[1]) == 4


POLICIES = ["int2ef", "sdp4bit", "hybrid"]


def test_runs_one_after_another_release_their_process_groups(tmp_path):
    # compare runs every policy in one process group: each run's mesh groups and the DDP
    # hook's group (and its thread) used to stay registered, with their Gloo threads (a
    # 280-run sweep reached 976 threads per rank); then the parameters' hooks kept each
    # sharded run's optimizer, and with it its dp group's threads, alive. The node levels
    # the first run makes are kept for the next runs of the same ranks.
    from commpress.launch import spawn
    from tests.train import workers

    counts = spawn(workers.groups_after_runs, 4, (POLICIES, str(tmp_path)),
                   ranks_per_node=2, timeout=240)
    for rank_counts in counts:
        assert len(set(rank_counts)) == 1, rank_counts


def test_a_measured_fallback_reports_which_way_each_bucket_went(tmp_path):
    """--fallback measured: after 10 steps every bucket of rank 0 has decided both of its
    collectives (none still measuring), and the summary counts them."""
    summary = train(TrainConfig(policy="zeropp", fallback="measured", dp=2, tp=1, pp=1,
                                out=str(tmp_path), **dict(TINY, steps=10, eval_every=0,
                                                           micro_batches=1)))
    ways = summary["fallback"]
    assert set(ways) == {"dp.grad", "dp.param"}
    assert all(row["measuring"] == 0 and row["compressed"] + row["exact"] > 0
               for row in ways.values())
    assert ways["dp.grad"]["compressed"] + ways["dp.grad"]["exact"] == (
        ways["dp.param"]["compressed"] + ways["dp.param"]["exact"])  # one of each per bucket
