"""TrainConfig refuses every number out of range where it is made: for the CLI and the
Python API alike, before a rank starts."""

import dataclasses
import math
import typing

import pytest

from commpress.train.config import TrainConfig

HINTS = typing.get_type_hints(TrainConfig)


def _numeric_fields() -> list[str]:
    """Every field typed int or float (optional or not), bools aside."""
    names = []
    for f in dataclasses.fields(TrainConfig):
        types = set(typing.get_args(HINTS[f.name])) or {HINTS[f.name]}
        if types & {int, float}:
            names.append(f.name)
    return names


NUMERIC = _numeric_fields()


def test_the_numeric_fields_are_the_ones_checked_here():
    assert set(NUMERIC) == {
        "dp", "tp", "pp", "ep", "nproc", "ranks_per_node", "steps", "batch_size", "seq_len",
        "micro_batches", "lr", "min_lr_ratio", "warmup", "weight_decay", "max_grad_norm",
        "seed", "max_data_bytes", "eval_every", "eval_batches", "checkpoint_every",
        "timeout_s", "bucket_numel", "sync_every", "fragments", "outer_delay", "outer_lr",
        "outer_momentum"}


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1, "8"])
def test_every_numeric_field_refuses_nan_inf_negative_and_text(name, bad):
    with pytest.raises(ValueError) as info:
        TrainConfig(**{name: bad})
    message = str(info.value)
    assert f"{name}={bad!r} is not allowed; allowed: " in message, message


@pytest.mark.parametrize("name", [n for n in NUMERIC if int in typing.get_args(HINTS[n])
                                  or HINTS[n] is int])
def test_integer_fields_refuse_fractions_and_bools(name):
    for bad in (1.5, True):
        with pytest.raises(ValueError, match=f"{name}={bad!r} is not allowed; allowed: an "
                                             "integer"):
            TrainConfig(**{name: bad})


@pytest.mark.parametrize(("kwargs", "needle"), [
    # each of these used to run: NaN weights from step 1, every later step skipped, exit 0
    (dict(weight_decay=math.nan), "weight_decay=nan is not allowed; allowed: a finite "
                                  "number >= 0"),
    (dict(min_lr_ratio=math.nan, warmup=0), "min_lr_ratio=nan is not allowed; allowed: a "
                                            "finite number in [0, 1]"),
    (dict(lr=math.inf), "lr=inf is not allowed; allowed: a finite number > 0"),
    (dict(lr=0.0), "lr=0.0 is not allowed"),
    (dict(warmup=-5), "warmup=-5 is not allowed; allowed: an integer >= 0"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio=1.5 is not allowed"),
    # these used to fail inside a rank with a traceback
    (dict(timeout_s=0.0), "timeout_s=0.0 is not allowed; allowed: a finite number in "
                          "(0, 1000000]"),
    (dict(timeout_s=math.nan), "timeout_s=nan is not allowed"),
    (dict(timeout_s=1e12), "timeout_s=1000000000000.0 is not allowed"),
    (dict(seed=2**32), "seed=4294967296 is not allowed; allowed: an integer in "
                       "[0, 4294967295]"),
    (dict(max_grad_norm=math.inf), "max_grad_norm=inf is not allowed; allowed: a finite "
                                   "number > 0 or none"),
    (dict(max_data_bytes=0), "max_data_bytes=0 is not allowed"),
    (dict(eval_every=-1), "eval_every=-1 is not allowed; allowed: an integer >= 0"),
    (dict(engine="ddp", ddp_hook="powersgd:0"), "ddp_hook='powersgd:0' is not allowed"),
    (dict(engine="ddp", ddp_hook="powersgd:4:1"), "ddp_hook='powersgd:4:1' is not allowed"),
])
def test_bad_numbers_name_the_field_the_value_and_the_range(kwargs, needle):
    with pytest.raises(ValueError) as info:
        TrainConfig(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(warmup=0, eval_every=0, checkpoint_every=0, min_lr_ratio=0.0, weight_decay=0.0),
    dict(min_lr_ratio=1.0, max_grad_norm=None, seed=2**32 - 1, timeout_s=1_000_000),
    dict(lr=1, timeout_s=5, engine="ddp", ddp_hook="powersgd:1"),
])
def test_edges_of_the_ranges_are_allowed(kwargs):
    cfg = TrainConfig(**kwargs)
    assert TrainConfig(**cfg.to_dict()) == cfg  # round-trips through a dict


def test_the_outer_step_is_resolved_from_the_preset_unless_given():
    sparse = TrainConfig(engine="ddp", policy="none", outer="diloco-sparse").resolved(2)
    assert (sparse.outer_lr, sparse.outer_momentum) == (1.0, 0.0)
    assert sparse.diloco_options()["outer_momentum"] == 0.0
    given = TrainConfig(engine="ddp", policy="none", outer="diloco-sparse",
                        outer_momentum=0.9).resolved(2)
    assert (given.outer_lr, given.outer_momentum) == (1.0, 0.9)
    plain = TrainConfig().resolved(4)
    assert (plain.outer_lr, plain.outer_momentum) == (0.7, 0.9)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(ep=2), "ep=2 needs a mixture-of-experts model; model='gpt-1m'"),
    (dict(model="moe-tiny", ep=3, seq_len=64), "ep=3 does not divide model 'moe-tiny'"),
    (dict(model="moe-tiny", ep=2, dp=3, seq_len=64), "ep=2 does not divide dp=3"),
    (dict(model="moe-tiny", tp=2, seq_len=64), "tensor parallelism of experts is not built"),
    (dict(model="moe-tiny", ep=2, engine="ddp", seq_len=64), "use engine=sharded"),
])
def test_expert_parallelism_refuses_what_it_cannot_run(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        TrainConfig(**kwargs)


def test_an_ep_that_does_not_divide_the_derived_dp_is_refused_when_resolved():
    with pytest.raises(ValueError, match="ep=4 does not divide dp=2"):
        TrainConfig(model="moe-tiny", ep=4, seq_len=64, nproc=2).resolved()
