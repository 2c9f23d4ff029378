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
                 "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data='/no/such/corpus' does not exist" in err and "Traceback" not in err


def test_dtype_mismatch_across_ranks():
    for msg in spawn(workers.mismatched_dtype, 2):
        assert "ranks disagree" in msg, msg
        assert "input.dtype differs (rank 0: float32; rank 1: bfloat16)" in msg, msg




BILLION_LAUGHS = """
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


@pytest.mark.parametrize(("text", "needle"), [
    (BILLION_LAUGHS, "aliases (*name) are not allowed"),
    ("x: " + "[" * 5000 + "]" * 5000, "nesting deeper than 20 levels"),
    ("dp:\n  grad: " + "x" * 70_000, "is larger than 65536 bytes"),
])
def test_hostile_policy_files_are_refused_cheaply(tmp_path, text, needle):
    import tracemalloc

    from commpress.policy import Policy

    path = tmp_path / "p.yaml"
    path.write_text(text)
    tracemalloc.start()
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*")):
        Policy.load(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 << 20  # refused before expanding


def test_huge_codec_options_are_refused_at_parse_time():
    from commpress.codecs import codec

    for spec in ("int4:group=100000000000", "fp8:group=0", "sign:group=99999999999"):
        with pytest.raises(ValueError, match="group=.* is not allowed; allowed: an integer"):
            codec(spec)


def test_data_reads_only_what_it_uses(tmp_path):
    import tracemalloc

    from commpress.train.data import load_tokens

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"x" * (64 << 20))
    tracemalloc.start()
    tokens = load_tokens(str(big), max_bytes=100_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tokens.numel() == 100_000 and peak < 8 << 20


def test_bad_data_is_a_message_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code = main(["train", "--data", str(empty), "--steps", "1", "--nproc", "1",
                 "--no-progress", "--model", "gpt-tiny", "--seq-len", "32", "--out",
                 str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "is empty" in err and "Traceback" not in err, err
    short = tmp_path / "short.txt"
    short.write_text("tiny corpus")
    code = main(["train", "--data", str(short), "--steps", "1", "--nproc", "1",
                 "--no-progress", "--model", "gpt-tiny", "--seq-len", "32", "--out",
                 str(tmp_path / "out2")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--seq-len" in err and "Traceback" not in err, err
