"""A Watch measures the error of what compressed collectives send: on a real model's
gradients, against each codec's own round trip, with error feedback, across threads, and
in a real two-rank all-reduce."""

import threading

import pytest
import torch

import commpress
from commpress.codecs import ErrorFeedback, codec
from commpress.collectives import chunks
from commpress.launch import spawn
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens
from tests.collectives import watch_workers


@pytest.fixture(scope="module")
def gradients():
    """gpt-tiny's gradient on one batch of real text, flat: (2, n) as two ranks' parts."""
    torch.manual_seed(0)
    model = GPT(config_from_preset("gpt-tiny", block_size=32))
    x, y = TextData(load_tokens(max_bytes=200_000)).batch("train", 8, 32, 0, 0)
    model(x, y)[1].backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    n = flat.numel() // 256 * 256
    return flat[:n].view(2, -1)


def _watched(spec, x, memory=None):
    watch = commpress.Watch()
    with watch.watching():
        chunks.encode_rows(codec(spec), x, rng_stream=0, key="g", memory=memory)
    return watch.read()


def test_each_codecs_error_is_its_own_round_trip_and_fewer_bits_err_more(gradients):
    errors = {}
    for spec in ("int2", "int4", "int8", "int4:hadamard=128", "topk:ratio=0.05"):
        read = _watched(spec, gradients)
        c = codec(spec)
        flat = gradients.reshape(-1)
        if chunks.splittable(c):
            back = c.decode(c.encode(flat, rng_stream=0))
        else:  # chunk by chunk, as the rows are encoded
            back = torch.cat([c.decode(c.encode(part, rng_stream=0)) for part in gradients])
        flat, back = flat.double(), back.reshape(-1).double()
        direct = ((flat - back).norm() / flat.norm()).item()
        assert read["rel_error"] == pytest.approx(direct, rel=1e-6), spec
        assert read["elements"] == flat.numel() and read["memory_ratio"] == 0
        assert read["plain_rel_error"] == read["rel_error"]  # no memory: all of it is lost
        errors[spec] = read["rel_error"]
    assert errors["int2"] > errors["int4"] > errors["int8"] > 0
    # exact values add nothing, and nothing is measured outside a watch
    assert _watched("none", gradients) == {"rel_error": 0.0, "plain_rel_error": 0.0,
                                            "memory_ratio": 0.0, "elements": 0}


def test_with_error_feedback_the_memory_and_the_compensated_value_are_measured(gradients):
    memory = ErrorFeedback()
    x = gradients.reshape(-1)
    first = _watched("int2", gradients, memory)
    # the first call sends the input itself: what it leaves behind is its error
    assert first["memory_ratio"] == pytest.approx(first["rel_error"], rel=1e-6)
    e1 = memory.residuals["g"].reshape(-1).clone()
    second = _watched("int2", gradients, memory)
    # then the codec is given input + memory: its error is the new memory, relative to
    # that sum; the memory ratio is relative to the input (the gradient)
    e2 = memory.residuals["g"].reshape(-1)
    assert second["rel_error"] == pytest.approx((e2.norm() / (x + e1).norm()).item(), rel=1e-5)
    assert second["memory_ratio"] == pytest.approx((e2.norm() / x.norm()).item(), rel=1e-5)
    # the memory carries that error on: none of it counts as lost
    assert first["plain_rel_error"] == second["plain_rel_error"] == 0


def test_a_watch_sees_its_own_threads_calls_only(gradients):
    watch = commpress.Watch()
    other = threading.Thread(target=lambda: chunks.encode_rows(
        codec("int4"), gradients, rng_stream=0, key="g"))
    with watch.watching():
        other.start()
        other.join()
    assert watch.read()["elements"] == 0
    with watch.watching():
        chunks.encode_rows(codec("int4"), gradients, rng_stream=0, key="g")
    assert watch.read()["elements"] == gradients.numel() and watch.calls == 1
    watch.reset()
    assert watch.read()["elements"] == 0


def test_nonfinite_values_read_as_nonfinite_not_zero(gradients):
    bad = gradients.clone()
    bad[0, 5] = float("nan")
    assert _watched("int8", bad)["rel_error"] != _watched("int8", bad)["rel_error"]  # NaN


def test_an_asynchronous_all_reduce_is_measured_during_the_call(gradients):
    ranks = spawn(watch_workers.watched_all_reduce, 2, (gradients,), timeout=120)
    for r in ranks:
        assert r["before"]["elements"] >= gradients.shape[1]  # its input, encoded in the call
        assert 0 < r["before"]["rel_error"] < 0.3  # int4 on real gradients
        assert r["after"]["elements"] >= r["before"]["elements"]
