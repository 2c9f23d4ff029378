"""Bad input gets a clear error naming the field, the value and what is allowed."""

import math

import pytest

from commpress import InputError
from commpress.cli import main
from commpress.launch import LaunchError, spawn
from commpress.train.config import TrainConfig
from tests.reliability import workers


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(dp=3, nproc=4), "world size 4 is not dp × tp × pp = 3 × 1 × 1"),
    (dict(nproc=4, ranks_per_node=3), "world size 4 is not divisible by ranks_per_node=3"),
    (dict(nproc=4, batch_size=6), "batch_size=6 is not divisible by dp × micro_batches"),
])
def test_layout_errors(kwargs, needle):
    with pytest.raises(InputError) as info:
        TrainConfig(**kwargs).resolved()
    assert needle in str(info.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(policy="fastest"), "unknown policy preset 'fastest'; allowed: none, naive"),
    (dict(model="gpt-huge"), "model='gpt-huge' is not allowed; allowed: gpt-tiny"),
    (dict(tp=0), "tp=0 is not allowed; allowed: an integer >= 1"),
    (dict(seq_len=4096), "seq_len=4096 exceeds model 'gpt-1m' block_size 128"),
    (dict(nonfinite="ignore"), "nonfinite='ignore' is not allowed; allowed: skip, raise"),
])
def test_config_errors(kwargs, needle):
    with pytest.raises(InputError) as info:
        TrainConfig(**kwargs)
    assert needle in str(info.value)


def test_cli_reports_bad_input_without_traceback(capsys):
    assert main(["train", "--policy", "fastest"]) == 2
    assert "unknown policy preset 'fastest'" in capsys.readouterr().err
    assert main(["train", "--data", "/no/such/corpus", "--steps", "1", "--nproc", "1",
                 "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data='/no/such/corpus' does not exist" in err and "Traceback" not in err


def test_input_error_is_a_value_error():
    # callers that catch ValueError keep working
    assert issubclass(InputError, ValueError)


def test_a_bug_keeps_its_traceback_in_the_cli(monkeypatch):
    # only InputError is bad input; a ValueError from a bug propagates with its traceback
    import commpress.plan.cost

    def broken(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(commpress.plan.cost, "plan", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["plan", "--model", "gpt-125m", "--gpus", "8"])


@pytest.mark.parametrize(("kind", "bad_input"), [("input", True), ("bug", False)])
def test_a_rank_bug_is_not_reported_as_bad_input(kind, bad_input):
    with pytest.raises(LaunchError) as info:
        spawn(workers.raises, 2, (kind,), timeout=60)
    assert info.value.bad_input is bad_input
    assert ("Traceback" in str(info.value)) and "rank 1 failed" in str(info.value)


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


# -- numbers of the plan, bench and testbed APIs: the checks their CLI commands share -----

CLUSTER = dict(gpus=8, gpus_per_node=4, intra_GBps=100.0, inter_GBps=25.0, tflops=300.0)


@pytest.mark.parametrize(("field", "bad", "allowed"), [
    ("gpus", 0, "an integer >= 1"),
    ("gpus_per_node", 2.5, "an integer >= 1"),
    ("intra_GBps", math.inf, "a finite number > 0"),
    ("inter_GBps", math.nan, "a finite number > 0"),
    ("tflops", 0.0, "a finite number > 0"),
    ("mfu", 1.5, "a finite number in (0, 1]"),
    ("link_efficiency", math.nan, "a finite number in (0, 1]"),
    ("intra_latency_us", -1.0, "a finite number >= 0"),
    ("inter_latency_us", math.nan, "a finite number >= 0"),
    ("codec_GBps", {"int4": (10.0, math.nan)}, None),
])
def test_cluster_spec_refuses_bad_numbers(field, bad, allowed):
    from commpress.plan.cost import ClusterSpec

    with pytest.raises(ValueError) as info:
        ClusterSpec(**{**CLUSTER, field: bad})
    message = str(info.value)
    if allowed is None:  # a measured codec speed: named by codec and direction
        assert "codec_GBps['int4'].decode=nan is not allowed" in message
    else:
        assert f"{field}={bad!r} is not allowed; allowed: {allowed}" in message


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "micro_batch", "seq", "global_batch",
                                   "param_bytes", "grad_bytes", "act_bytes"])
def test_job_spec_refuses_sizes_below_one(field):
    from commpress.plan.cost import JobSpec
    from commpress.plan.models import MODELS

    with pytest.raises(ValueError, match=f"{field}=0 is not allowed; allowed: an integer >= 1"):
        JobSpec(**{"model": MODELS["gpt-125m"], "dp": 8, field: 0})


@pytest.mark.parametrize("arg", ["nan", "inf", "-5", "0", "-1B"])
def test_plan_model_sizes_must_be_positive_finite_counts(arg):
    from commpress.plan.models import model_from_arg

    with pytest.raises(ValueError, match=f"--model '{arg}' is not a preset or a parameter "
                                         "count; allowed: .* a positive number"):
        model_from_arg(arg)


@pytest.mark.parametrize(("argv", "needle"), [
    # each of these used to end in a traceback (ZeroDivisionError, OverflowError, TypeError)
    (["plan", "--tp", "0"], "tp=0 is not allowed"),
    (["plan", "--micro-batch", "0"], "micro_batch=0 is not allowed"),
    (["plan", "--global-batch", "0"], "global_batch=0 is not allowed"),
    (["plan", "--model", "inf"], "--model 'inf' is not a preset"),
    (["plan", "--model", "-5"], "--model '-5' is not a preset"),
    # 0 used to stand for "the default" here
    (["plan", "--intra-bw", "0"], "intra_GBps=0.0 is not allowed"),
    (["plan", "--tflops", "0"], "tflops=0.0 is not allowed"),
    (["plan", "--dp", "0"], "dp=0 is not allowed"),
    (["plan", "--gpus", "4", "--tp", "8"], "dp × tp × pp = 1 × 8 × 1 must equal --gpus 4"),
    (["bench", "codecs", "--numel", "0"], "numel=0 is not allowed"),
    (["bench", "codecs", "--iters", "0"], "iters=0 is not allowed"),
    (["bench", "collectives", "--sizes", "inf"], "--sizes 'inf' is not allowed: 'inf' is not a "
                                                "positive whole number"),
    (["bench", "collectives", "--sizes", "1024,nan"], "'nan' is not a positive whole number"),
    (["bench", "collectives", "--iters", "0"], "iters=0 is not allowed"),
    (["bench", "collectives", "--ranks-per-node", "0"], "ranks_per_node=0 is not allowed"),
    (["testbed", "--bandwidth", "0mbit", "--", "train"], "bandwidth '0mbit' is not allowed"),
    (["testbed", "--", "train", "--lr", "nan"], "lr=nan is not allowed"),
    (["train", "--timeout-s", "0"], "timeout_s=0.0 is not allowed"),
    (["train", "--timeout-s", "nan"], "timeout_s=nan is not allowed"),
    (["train", "--warmup", "-5"], "warmup=-5 is not allowed"),
])
def test_cli_bad_numbers_are_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in " ".join(err.split()) and "Traceback" not in err, err


def test_bench_and_testbed_functions_check_their_numbers_before_starting_anything():
    from commpress.bench.codecs import bench_codecs
    from commpress.bench.collectives import run_collectives_bench
    from commpress.testbed.netns import Cluster
    from commpress.testbed.run import run_on_testbed

    calls = [
        (lambda: bench_codecs(["int8"], numel=-4), "numel=-4 is not allowed"),
        (lambda: run_collectives_bench(nproc=2, ranks_per_node=0), "ranks_per_node=0"),
        (lambda: run_collectives_bench(nproc=2, sizes=[1024, 0]), "sizes[1]=0 is not allowed"),
        (lambda: run_collectives_bench(nproc=2, iters=2.5), "iters=2.5 is not allowed"),
        (lambda: Cluster(nodes=65), "nodes=65 is not allowed; allowed: an integer in [1, 64]"),
        (lambda: run_on_testbed(2, 0, ["train"]), "ranks_per_node=0 is not allowed"),
        (lambda: run_on_testbed(2, 2, ["train"], port=70_000), "port=70000 is not allowed"),
        (lambda: run_on_testbed(2, 2, ["train"], timeout=math.nan), "timeout=nan is not"),
    ]
    for call, needle in calls:
        with pytest.raises(ValueError) as info:
            call()
        assert needle in str(info.value)
