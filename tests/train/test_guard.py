"""The trainer's --guard: a naive int2 run promoted by the guard, its signals and
promotions in metrics.jsonl and on the loss plot; what it cannot run is refused by name."""

import json
import os

import pytest
import yaml

from commpress.train.config import TrainConfig
from commpress.train.loop import train
from commpress.validate import InputError

BASE = dict(model="gpt-tiny", batch_size=8, seq_len=32, warmup=2, eval_every=0,
            eval_batches=1, max_data_bytes=200_000, progress=False, bucket_numel=40_000,
            nproc=2, ranks_per_node=2)


@pytest.mark.parametrize("engine", ["sharded", pytest.param("ddp", marks=pytest.mark.slow)])
def test_a_guarded_run_records_its_signals_and_promotions(tmp_path, engine):
    policy = tmp_path / "naive-int2.yaml"
    policy.write_text(yaml.safe_dump({"dp": {"grad": "int2:hadamard=0"}}))
    out = str(tmp_path / "run")
    summary = train(TrainConfig(out=out, policy=str(policy), steps=6, engine=engine,
                                guard="max_rel_error=0.3,window=2,every=1", tensorboard=True,
                                **BASE))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    sampled = [r for r in records if "guard" in r]
    assert len(sampled) == 6  # every step sampled
    promoted = [e for r in sampled for g in r["guard"] for e in g["promoted"]]
    assert promoted and all("int4" in e["to"] for e in promoted[:1])
    assert promoted[0]["step"] == 1  # two samples in a row over the budget: steps 0 and 1
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["policy"]["guard"] == {"max_rel_error": 0.3, "window": 2, "every": 1}
    assert os.path.exists(os.path.join(out, "loss.png")) and summary["steps"] == 6
    assert os.path.exists(os.path.join(out, "guard.png"))  # the signals per bucket
    assert summary["guard_promotions"] == len(promoted)
    # the same signals as TensorBoard scalars, step by step, and the promotions as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(os.path.join(out, "tensorboard")).Reload()
    what = sampled[0]["guard"][0]["what"]
    shown = [e.value for e in board.Scalars(f"guard/{what}/rel_error/bucket0")]
    assert shown == pytest.approx([r["guard"][0]["rel_error"][0] for r in sampled])
    assert len(board.Scalars("loss/train")) == 6
    assert f"guard/{what}/promoted/text_summary" in board.Tags()["tensors"]


def test_what_the_guard_cannot_run_is_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="guard='lots' is not allowed"):
        TrainConfig(policy="tlq", guard="lots", **BASE)
    with pytest.raises(InputError, match="guard.max_rel_error"):
        TrainConfig(policy="tlq", guard="-1", **BASE)
    with pytest.raises(InputError, match="guard='0.3' with ddp_hook='fp16' is not allowed"):
        TrainConfig(policy="tlq", guard="0.3", engine="ddp", ddp_hook="fp16", **BASE)
    from commpress.train.simulate import simulate

    with pytest.raises(InputError, match="simulate does not play it yet"):
        simulate(TrainConfig(policy="tlq", guard="0.3", out=str(tmp_path / "s"), steps=1,
                             **BASE))


@pytest.mark.slow
def test_a_guarded_run_across_sites_guards_the_pseudo_gradients_too(tmp_path):
    """engine ddp with --outer: the hook's buckets and DiLoCo's fragment both guarded by
    --guard (the hook's are exact here: never sampled); the fragment's int2
    pseudo-gradients are promoted at its second sync, recorded with the inner step that
    began it."""
    outer = tmp_path / "naive-outer.yaml"
    outer.write_text(yaml.safe_dump({"outer": {"grad": "int2:hadamard=0"}}))
    out = str(tmp_path / "run")
    train(TrainConfig(out=out, policy="none", engine="ddp", outer=str(outer), sync_every=2,
                      steps=6, guard="max_rel_error=0.2,window=2,every=1",
                      **{**BASE, "ranks_per_node": 1}))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    sampled = [g for r in records for g in r.get("guard", [])]
    assert {g["what"] for g in sampled} == {"DiLoCo"}
    promoted = [e for g in sampled for e in g["promoted"]]
    assert [e["step"] for e in promoted] == [4] and "int4" in promoted[0]["to"]
