"""`commpress simulate` plays an N-rank data-parallel run in one process: for every
preset whose gradients are compressed, the weights equal the real run's bit for bit —
with the sharded optimizer and with DDP and commpress's hook."""

import json
import os

import pytest

import commpress
from commpress.launch import spawn
from commpress.train import checkpoint
from commpress.train.config import TrainConfig
from commpress.train.loop import train
from tests.train import workers

BASE = dict(model="gpt-tiny", batch_size=8, seq_len=32, warmup=2, eval_every=0,
            eval_batches=1, max_data_bytes=200_000, progress=False, bucket_numel=20_000,
            nproc=4, ranks_per_node=2)
# gradients reduced exactly: the backend's own summation order, so fp32-close only
EXACT_GRADIENTS = {"none", "qw", "qwd"}
FAST = ["sdp4bit", "int2ef"]  # CI's slow cases; every other preset is in the sweep below


def _compare(tmp_path, policy, steps, **extra):
    """A real run against `simulate` (one process, or one per tensor-parallel slice):
    data-parallel rank 0's final weights of every stage (and slice), and the losses."""
    cfg = dict(BASE, policy=policy, steps=steps, **extra)
    tp, pp = cfg.get("tp", 1), cfg.get("pp", 1)
    out = str(tmp_path / "real")
    train(TrainConfig(out=out, checkpoint_every=steps, **cfg))
    # data-parallel rank 0's stages and slices are global ranks 0 … pp·tp - 1
    key = (lambda s, t, n: (s, t, n)) if tp > 1 else (lambda s, t, n: (s, n))
    real = {key(s, t, n): w for s in range(pp) for t in range(tp) for n, w in
            workers.weights_of_checkpoint(checkpoint.rank_file(out, steps, s * tp + t)).items()}
    slices = spawn(workers.played_weights, tp, (dict(cfg, out=str(tmp_path / "sim")),))
    played = {k: w for weights, _ in slices for k, w in weights.items()}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        real_losses = [json.loads(line)["loss"] for line in f]
    return real, played, real_losses, slices[0][1]


def _check(policy, real, played, real_losses, played_losses):
    assert real.keys() == played.keys()
    if policy not in EXACT_GRADIENTS:
        assert real == played, [n for n in real if real[n] != played[n]]
    for a, b in zip(real_losses, played_losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


# the default selection's 4-rank cases are test_simulate_equals_train_on_a_few_cases
@pytest.mark.slow
@pytest.mark.parametrize("policy", FAST)
def test_simulate_equals_a_real_4_rank_run(tmp_path, policy):
    _check(policy, *_compare(tmp_path, policy, 8))


@pytest.mark.slow
@pytest.mark.sweep  # outside CI: the other presets beside FAST's one per kind of path
@pytest.mark.parametrize("policy", [p for p in commpress.list_presets() if p not in FAST])
def test_simulate_equals_a_real_4_rank_run_every_preset(tmp_path, policy):
    _check(policy, *_compare(tmp_path, policy, 20))


# the DDP hook's gradient paths: two levels with exact intra (int2ef), compressed intra
# with the fused TLq-HS codecs (sdp4bit), one level (naive: int4 on 4 ranks)
DDP_FAST = ["int2ef"]
DDP_SLOW = ["sdp4bit", "naive", "hybrid", "none"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", [*DDP_FAST, *DDP_SLOW])
def test_simulate_equals_a_real_4_rank_ddp_run(tmp_path, policy):
    _check(policy, *_compare(tmp_path, policy, 8 if policy in DDP_FAST else 20, engine="ddp",
                             micro_batches=2))


# pipeline parallelism: activations and their gradients through the pp codecs (naive:
# int4, hybrid: its own), one optimizer per stage, one norm over all ranks
# stochastic rounding and error feedback on the pipeline's codecs: each rank's random
# stream (its global rank) and error-feedback memory (keyed by destination) must match
STATEFUL_PP = """
dp:
  grad: "int4:rounding=stochastic"
pp:
  act: "int4:rounding=stochastic"
  act_grad: {codec: "int8:rounding=stochastic", error_feedback: true}
"""


@pytest.mark.parametrize("policy,layout", [
    ("stateful-pp", dict(nproc=4, pp=2, ranks_per_node=2)),
    pytest.param("naive", dict(nproc=4, pp=2, ranks_per_node=2), marks=pytest.mark.slow),
    pytest.param("hybrid", dict(nproc=4, pp=2, ranks_per_node=2), marks=pytest.mark.slow),
    pytest.param("sdp4bit", dict(nproc=8, pp=2, ranks_per_node=4, batch_size=16),
                 marks=pytest.mark.slow),  # dp 4 in 2 nodes: two-level with stages
])
def test_simulate_equals_a_real_pipeline_run(tmp_path, policy, layout):
    if policy == "stateful-pp":
        policy = str(tmp_path / "stateful-pp.yaml")
        with open(policy, "w") as f:
            f.write(STATEFUL_PP)
    _check(policy, *_compare(tmp_path, policy, 6, **layout))


# tensor parallelism: tp processes, each a slice playing its data-parallel ranks; the
# layers' all-reduces real (hybrid: int8 activations; below: stochastic rounding and
# error feedback, whose state each played rank keeps apart)
STATEFUL_TP = """
dp:
  grad: "int4:rounding=stochastic"
tp:
  act: "int8:rounding=stochastic"
  act_grad: {codec: "int4:rounding=stochastic", error_feedback: true}
pp:
  act: "int4:rounding=stochastic"
"""


@pytest.mark.parametrize("policy,layout", [
    pytest.param("stateful-tp", dict(nproc=4, tp=2, ranks_per_node=2), marks=pytest.mark.slow),
    pytest.param("hybrid", dict(nproc=4, tp=2, ranks_per_node=2), marks=pytest.mark.slow),
    pytest.param("sdp4bit", dict(nproc=8, tp=2, ranks_per_node=4, batch_size=16),
                 marks=pytest.mark.slow),  # dp 4 in 2 nodes: two-level with slices
    pytest.param("stateful-tp", dict(nproc=8, tp=2, pp=2, ranks_per_node=4),
                 marks=pytest.mark.slow),  # each stage's random stream: its global rank
])
def test_simulate_equals_a_real_tensor_parallel_run(tmp_path, policy, layout):
    if policy == "stateful-tp":
        policy = str(tmp_path / "stateful-tp.yaml")
        with open(policy, "w") as f:
            f.write(STATEFUL_TP)
    _check(policy, *_compare(tmp_path, policy, 6, **layout))


@pytest.mark.slow
@pytest.mark.parametrize("policy,extra", [
    ("sdp4bit", {}),
    ("int2ef", dict(engine="ddp", micro_batches=2)),
    ("hybrid", dict(pp=2)),
])
def test_simulate_equals_a_real_run_in_bf16(tmp_path, policy, extra):
    # bf16 weights, gradients and activations: every sum and cast where the real run has it
    _check(policy, *_compare(tmp_path, policy, 6, dtype="bf16", **extra))


def test_simulate_refuses_what_it_does_not_play():
    from commpress.train.simulate import simulate

    base = dict(BASE, policy="int2ef", steps=1)
    with pytest.raises(ValueError, match="ddp_hook='powersgd:4'.*allowed: commpress"):
        simulate(TrainConfig(engine="ddp", ddp_hook="powersgd:4", **base))
    with pytest.raises(ValueError, match="engine=ddp runs data parallelism only; got tp=2"):
        simulate(TrainConfig(tp=2, engine="ddp", **base))
    # DiLoCo across sites needs two sites or more, played as trained
    with pytest.raises(ValueError, match="outer='diloco-int4' runs DiLoCo across nodes.*one "
                                         "node of 4"):
        simulate(TrainConfig(**dict(base, engine="ddp", outer="diloco-int4",
                                    ranks_per_node=4)))


def test_simulate_cli_one_policy_and_a_comparison(tmp_path, capsys):
    from commpress.cli import main

    common = ["--ranks", "4", "--ranks-per-node", "2", "--model", "gpt-tiny", "--steps", "2",
              "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1",
              "--max-data-bytes", "200000", "--no-progress"]
    assert main(["simulate", *common, "--policy", "tlq", "--out", str(tmp_path / "one")]) == 0
    summary = json.load(open(tmp_path / "one" / "summary.json"))
    assert summary["policy"] == "tlq" and summary["dp"] == 4 and summary["final_val_loss"] > 0
    assert (tmp_path / "one" / "loss.png").exists()
    # --ranks data-parallel ranks, each of --pp stages: 2 × 2 ranks in 2 nodes of 2
    assert main(["simulate", *common, "--ranks", "2", "--pp", "2", "--policy", "hybrid",
                 "--out", str(tmp_path / "pp")]) == 0
    summary = json.load(open(tmp_path / "pp" / "summary.json"))
    assert (summary["dp"], summary["pp"]) == (2, 2) and "pp.act" in summary["wire_bytes"]
    # --tp slices, each a process of its own: its layers' all-reduces are counted too
    assert main(["simulate", *common, "--ranks", "2", "--tp", "2", "--policy", "hybrid",
                 "--out", str(tmp_path / "tp")]) == 0
    summary = json.load(open(tmp_path / "tp" / "summary.json"))
    assert (summary["dp"], summary["tp"]) == (2, 2)
    assert {"tp.act", "tp.act_grad"} <= set(summary["wire_bytes"])
    assert any(label.startswith("dp.grad") for label in summary["wire_bytes"])
    assert main(["simulate", *common, "--policies", "none,sdp4bit", "--out",
                 str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare.png").exists()
    assert "policy comparison" in capsys.readouterr().out
    # what it does not play, or cannot, is refused with the reason
    assert main(["simulate", *common, "--ranks", "0", "--out", str(tmp_path / "zero")]) == 2
    assert main(["simulate", *common, "--policy", "sdp4bit", "--ranks", "3",
                 "--ranks-per-node", "2", "--out", str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("policy,layout", [
    ("sdp4bit", {}),  # qWD and TLq-HS on 2 nodes × 2: both levels of each
    pytest.param("zeropp", {}, marks=pytest.mark.slow),  # int8 weights, two levels
    pytest.param("none", {}, marks=pytest.mark.slow),  # torch's own all-gather
    pytest.param("hybrid", dict(tp=2), marks=pytest.mark.slow),  # the slices' all-reduces
])
def test_simulate_counts_the_bytes_a_real_run_sends(tmp_path, policy, layout):
    from commpress.train.simulate import simulate

    cfg = dict(BASE, policy=policy, steps=2, **layout)
    real = train(TrainConfig(out=str(tmp_path / "real"), **cfg))
    played = simulate(TrainConfig(out=str(tmp_path / "sim"), **cfg))
    assert any(label.startswith("dp.param") for label in real["wire_bytes"])
    assert real["wire_bytes"] == pytest.approx(played["wire_bytes"], rel=0)


def _final_state(run_dir: str, steps: int, slices: int) -> list[dict]:
    return [checkpoint.load(checkpoint.rank_file(run_dir, steps, t)) for t in range(slices)]


def _assert_same_state(a, b, path="state"):
    """Bitwise equal nested states (tensors by their bytes)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same_state(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("policy,layout", [
    ("sdp4bit", {}),  # qWD weights, two-level gradients: every rank's codec state
    pytest.param("int2ef", dict(engine="ddp", micro_batches=2), marks=pytest.mark.slow),
    # DiLoCo across 2 sites: every site's weights and optimizer, every played rank's outer
    # codecs, a sync in flight across the stop (fragment 0 starts at step 3, lands at 4)
    pytest.param("int2ef", dict(engine="ddp", micro_batches=1, outer="diloco-sparse",
                                sync_every=6, fragments=2, outer_delay=1), id="int2ef-outer"),
    pytest.param("stateful-pp", dict(pp=2), marks=pytest.mark.slow),
    pytest.param("stateful-tp", dict(tp=2), marks=pytest.mark.slow),
])
def test_simulate_resumes_bitwise(tmp_path, policy, layout):
    """Stopped after 3 steps and resumed from its checkpoint, a simulated run ends with the
    uninterrupted run's state, bit for bit: weights, optimizers, every played rank's
    codec state (stochastic counters, error feedback, qWD), losses."""
    from commpress.train.simulate import simulate

    if policy.startswith("stateful"):
        text = STATEFUL_PP if policy == "stateful-pp" else STATEFUL_TP
        policy = str(tmp_path / f"{policy}.yaml")
        with open(policy, "w") as f:
            f.write(text)
    # warm-up past the last step: the learning rate does not depend on `steps`
    cfg = dict(BASE, policy=policy, steps=6, checkpoint_every=3, warmup=10, **layout)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    simulate(TrainConfig(out=full, **cfg))
    simulate(TrainConfig(out=part, **dict(cfg, steps=3)))
    summary = simulate(TrainConfig(out=part, resume=part, **cfg))
    slices = layout.get("tp", 1)
    a, b = _final_state(full, 6, slices), _final_state(part, 6, slices)
    for x, y in zip(a, b, strict=True):
        _assert_same_state({k: v for k, v in x.items() if k not in ("config", "history")},
                           {k: v for k, v in y.items() if k not in ("config", "history")})
        assert [r["loss"] for r in x["history"]] == [r["loss"] for r in y["history"]]
    assert summary["steps"] == 6 and summary["final_val_loss"] is not None


@pytest.mark.slow
def test_simulate_refuses_a_checkpoint_of_another_run(tmp_path):
    from commpress.train.simulate import simulate

    cfg = dict(BASE, policy="sdp4bit", steps=2, checkpoint_every=2)
    simulate(TrainConfig(out=str(tmp_path / "a"), **cfg))
    with pytest.raises(checkpoint.CheckpointError, match="policy"):
        simulate(TrainConfig(out=str(tmp_path / "b"), resume=str(tmp_path / "a"),
                             **dict(cfg, policy="zeropp", steps=4)))
    # a `train` checkpoint holds one rank's state, not every played rank's
    train(TrainConfig(out=str(tmp_path / "real"), **cfg))
    with pytest.raises(checkpoint.CheckpointError, match="ranks|simulate"):
        simulate(TrainConfig(out=str(tmp_path / "c"), resume=str(tmp_path / "real"),
                             **dict(cfg, steps=4)))
