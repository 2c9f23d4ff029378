"""Bad input gets a clear error naming the field, the value and what is allowed."""

import pytest

from commpress.cli import main
from commpress.launch import spawn
from commpress.train.config import TrainConfig
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


