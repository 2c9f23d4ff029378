"""Bad input gets a clear error naming the field, the value and what is allowed."""

import pytest
import torch

from commpress.cli import main
from commpress.launch import LaunchError, spawn
from commpress.train import checkpoint
from commpress.train.config import TrainConfig
from commpress.train.loop import train
from tests.reliability import workers


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(dp=3, nproc=4), "world size 4 is not dp × tp × pp = 3 × 1 × 1"),
    (dict(nproc=4, ranks_per_node=3), "world size 4 is not divisible by ranks_per_node=3"),
    (dict(nproc=4, batch_size=6), "batch_size=6 is not divisible by dp × micro_batches"),
])
def test_layout_errors(kwargs, needle):
    with pytest.raises(ValueError) as info:
        TrainConfig(**kwargs).resolved()
    assert needle in str(info.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(policy="fastest"), "unknown policy preset 'fastest'; allowed: none, naive"),
    (dict(model="gpt-huge"), "model='gpt-huge' is not allowed; allowed: gpt-tiny"),
    (dict(tp=0), "tp=0 is not allowed; allowed: >= 1"),
    (dict(seq_len=4096), "seq_len=4096 exceeds model 'gpt-1m' block_size 128"),
    (dict(nonfinite="ignore"), "nonfinite='ignore' is not allowed; allowed: skip, raise"),
])
def test_config_errors(kwargs, needle):
    with pytest.raises(ValueError) as info:
        TrainConfig(**kwargs)
    assert needle in str(info.value)


def test_cli_reports_bad_input_without_traceback(capsys):
    assert main(["train", "--policy", "fastest"]) == 2
    assert "unknown policy preset 'fastest'" in capsys.readouterr().err
    assert main(["train", "--data", "/no/such/corpus", "--steps", "1", "--nproc", "1",
                 "--no-progress"]) != 0


def test_dtype_mismatch_across_ranks():
    for msg in spawn(workers.mismatched_dtype, 2):
        assert "ranks disagree" in msg, msg
        assert "input.dtype differs (rank 0: float32; rank 1: bfloat16)" in msg, msg


TINY = dict(model="gpt-tiny", steps=2, batch_size=8, seq_len=32, eval_every=0, eval_batches=1,
            progress=False, max_data_bytes=200_000, bucket_numel=20_000)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run"))
    train(TrainConfig(policy="sdp4bit", dp=2, out=out, **TINY))
    return out


def test_truncated_checkpoint_is_refused(saved_run, tmp_path):
    path = checkpoint.rank_file(saved_run, 2, 0)
    data = open(path, "rb").read()
    bad = tmp_path / "rank00000.pt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is corrupted or truncated"):
        checkpoint.load(str(bad))


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "x": Evil()}, path)
    with pytest.raises(ValueError, match="is corrupted or truncated"):
        checkpoint.load(str(path))  # weights_only=True refuses arbitrary objects


@pytest.mark.parametrize(("change", "needle"), [
    (dict(dp=4), "was written by 2 ranks; this run has 4"),
    (dict(policy="zeropp"), "has policy='sdp4bit', this run policy='zeropp'"),
])
def test_checkpoint_from_another_layout_or_policy_is_refused(saved_run, tmp_path, change,
                                                             needle):
    cfg = dict(TINY, policy="sdp4bit", dp=2, steps=4, out=str(tmp_path), resume=saved_run)
    cfg.update(change)
    with pytest.raises(LaunchError) as info:
        train(TrainConfig(**cfg))
    assert needle in str(info.value)
