"""The trainer's DDP engine with torch's hooks and commpress's hook."""

import json
import os

import pytest

from commpress.train.config import TrainConfig
from commpress.train.loop import train

TINY = dict(model="gpt-tiny", steps=4, batch_size=8, seq_len=32, eval_every=0, eval_batches=1,
            progress=False, max_data_bytes=200_000, engine="ddp", nproc=2)


@pytest.fixture(scope="module")
def allreduce_run(tmp_path_factory):
    return train(TrainConfig(ddp_hook="allreduce", out=str(tmp_path_factory.mktemp("ar")),
                             **TINY))


@pytest.mark.parametrize(("hook", "tolerance"), [
    pytest.param("fp16", 1e-4, marks=pytest.mark.slow), ("powersgd:2", 0.01), ("commpress", 1e-4)])
def test_ddp_hooks_track_plain_all_reduce(tmp_path, allreduce_run, hook, tolerance):
    # the same seed, data and steps: a hook may only cost its compression error (fp16 and
    # sdp4bit here are ~1e-6 of the loss after 4 steps; PowerSGD rank 2, ~0.2 %)
    s = train(TrainConfig(ddp_hook=hook, policy="sdp4bit", out=str(tmp_path), **TINY))
    ref = allreduce_run["final_val_loss"]
    assert abs(s["final_val_loss"] - ref) <= tolerance * ref, (s["final_val_loss"], ref)
    assert ref < 5.45  # 4 steps moved it off the uniform-byte loss ln 256 = 5.55
    if not hook.startswith("powersgd"):  # torch's PowerSGD does not report its bytes
        assert sum(s["wire_bytes"].values()) > 0


def test_ddp_engine_refuses_tp():
    with pytest.raises(ValueError, match="engine=ddp runs data parallelism only"):
        TrainConfig(engine="ddp", tp=2)
    with pytest.raises(ValueError, match="ddp_hook='powersgd' is not allowed"):
        TrainConfig(ddp_hook="powersgd")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["int2ef", pytest.param("tlq", marks=pytest.mark.sweep),
                                    pytest.param("none", marks=pytest.mark.sweep)])
def test_ddp_engine_resume_is_bitwise(tmp_path, policy):
    # DDP re-buckets after the first iteration of every process; the commpress hook's own
    # fixed buckets keep its error-feedback memory, rounding streams and summation order
    # where they were (torch's own hooks reduce DDP's buckets: after a resume their sums
    # run in another order, off by rounding)
    base = dict(TINY, nproc=4, ranks_per_node=2, steps=6, checkpoint_every=3,
                ddp_hook="commpress", policy=policy)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train(TrainConfig(out=full, **base))
    train(TrainConfig(out=part, **dict(base, steps=3)))
    train(TrainConfig(out=part, resume=part, **base))

    def losses(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f]

    assert losses(part) == losses(full)


@pytest.mark.parametrize("layout", [dict(nproc=2, ranks_per_node=1),
                                    pytest.param(dict(nproc=4, ranks_per_node=2),
                                                 marks=pytest.mark.slow)])
def test_diloco_across_nodes_trains_sends_codes_between_sites_and_resumes_bitwise(tmp_path,
                                                                                  layout):
    """``--outer``: DDP inside each node, DiLoCo across the 2 nodes with 2-bit
    pseudo-gradients and a fragment in flight at the checkpoint; the resumed run's losses
    are the uninterrupted run's, and only codes cross between the sites."""
    base = dict(TINY, **layout, steps=8, checkpoint_every=3,
                ddp_hook="commpress", policy="none", outer="diloco-int2ef", sync_every=4,
                fragments=2, outer_delay=1)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    s = train(TrainConfig(out=full, **base))
    train(TrainConfig(out=part, resume=os.path.join(full, "ckpt", "step_000003"), **base))

    def losses(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f]

    assert losses(part) == losses(full)
    assert s["bits_per_elem"]["outer.grad.inter"] < 1.8
    if layout["ranks_per_node"] > 1:  # DDP's all-reduce inside the node
        assert s["wire_bytes"]["outer.grad.inter"] < s["wire_bytes"]["dp.grad"] / 20
    with pytest.raises(ValueError, match="outer='diloco-int2ef' needs engine=ddp"):
        TrainConfig(outer="diloco-int2ef")
    with pytest.raises(ValueError, match="delay=4 is not allowed"):
        TrainConfig(engine="ddp", outer="diloco", sync_every=4, outer_delay=4)


def test_diloco_on_one_node_and_its_options_without_outer_are_refused_naming_why(tmp_path):
    # one node: DDP keeps every rank identical, DiLoCo would send the model between copies
    with pytest.raises(Exception, match=r"runs DiLoCo across nodes, and the 2 data-parallel "
                                        r"ranks here are one node of 2") as e:
        train(TrainConfig(out=str(tmp_path / "one"), **dict(TINY, nproc=2, steps=2),
                          ddp_hook="commpress", policy="none", outer="diloco", sync_every=2))
    assert "ranks_per_node=1" in str(e.value)
    for options in ({"sync_every": 64}, {"fragments": 2}, {"outer_delay": 1},
                    {"outer_lr": 0.5}):
        name = next(iter(options))
        with pytest.raises(ValueError, match=f"{name}=.* given without outer"):
            TrainConfig(engine="ddp", **options)
