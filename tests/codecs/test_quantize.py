"""Numerics of the group quantizers: error bound, unbiased stochastic rounding,
Hadamard smoothing on heavy-tailed data, error feedback and weight differences."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from commpress.bench.codecs import student_t
from commpress.codecs import ErrorFeedback, codec
from commpress.codecs.delta import apply_difference, difference
from commpress.kernels import reference as ref


def _rotated_error_and_scale(c, x):
    """|y - ŷ| and the per-element scale, in the (unnormalized) rotated domain."""
    packet = c.encode(x)
    codes, scales = packet.tensors
    n = x.numel()
    total = ref.padded_numel(n, c.bits, c.group, c.hadamard)
    y = torch.zeros(total)
    y[:n] = x.reshape(-1).float()
    y = ref.hadamard_transform(y, c.hadamard)
    y_hat = ref.dequantize_rotated(codes, scales, bits=c.bits, group=c.group)
    per_elem_scale = scales.float().repeat_interleave(c.group)
    return (y - y_hat).abs(), per_elem_scale, y


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([1, 3, 16, 100, 128, 256]),
    hadamard=st.sampled_from([0, 16, 128]),
    numel=st.integers(1, 3000),
    scale_dtype=st.sampled_from(["fp32", "fp16"]),
    log_mag=st.floats(-6, 6),
    seed=st.integers(0, 2**31),
)
def test_nearest_rounding_error_is_at_most_half_a_step(bits, group, hadamard, numel,
                                                       scale_dtype, log_mag, seed):
    c = codec(f"int{bits}", group=group, hadamard=hadamard, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10.0**log_mag
    err, scale, y = _rotated_error_and_scale(c, x)
    # fp16 scales cover group absmax up to 65504·qmax; beyond, the scale saturates at
    # 65504 and values clip (the overflow test covers that)
    if scale_dtype == "fp16":
        assume(bool((scale < torch.finfo(torch.float16).max).all()))
    # |y − q·s| ≤ s/2, plus fp32 rounding of y·(1/s) and of q·s (a few ulps of |y|)
    slack = 4 * torch.finfo(torch.float32).eps * y.abs() + 1e-30
    assert torch.all(err <= scale / 2 * (1 + 1e-6) + slack)


def test_fp16_scale_beyond_its_range_saturates():
    c = codec("int4:scale_dtype=fp16")
    x = torch.cat([torch.full((128,), 1e6), torch.full((128,), -1e9)])
    y = c.decode(c.encode(x))
    # finite in, finite out: the scale stops at fp16's 65504, the codes at ±7
    assert torch.equal(y, torch.cat([torch.full((128,), 7 * 65504.0),
                                     torch.full((128,), -7 * 65504.0)]))
    assert torch.allclose(codec("int4").decode(codec("int4").encode(x)), x)  # fp32 scales fit


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "int8:hadamard=128",
                                  "int4:hadamard=256", "int4:hadamard=16,scale_dtype=fp16",
                                  "int2:packing=trits,hadamard=32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_values_near_the_dtype_max_decode_finite(spec, dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([top, -top, top / 2, 1.0, 1e37 if dtype != torch.float16 else 6e4] * 64,
                     dtype=dtype)
    y = codec(spec).decode(codec(spec).encode(x))
    assert torch.isfinite(y).all(), (spec, dtype)
    if "fp16" not in spec and "int2" not in spec:  # nothing saturates after the rotation
        assert (y[::5] > 0).all() and (y[1::5] < 0).all()


@pytest.mark.parametrize("spec", ["int4", "int8:group=64", "int2:group=32", "int4:hadamard=128"])
def test_stochastic_rounding_is_unbiased(spec):
    x = torch.randn(4096) * 0.3
    c = codec(spec, rounding="stochastic", seed=11)
    trials = 400
    total = torch.zeros_like(x)
    for _ in range(trials):
        total += c.decode(c.encode(x))
    mean_err = total / trials - x
    # each trial's error per element is bounded by one step s, variance ≤ s²/4; the
    # mean of `trials` draws has std ≤ s/(2√trials): allow 5 standard deviations
    step = x.abs().max() / ref.qmax_for_bits(c.bits)
    if c.hadamard:
        step = step * math.sqrt(c.hadamard)  # absmax of a rotated block grows ≤ √h
    bound = 5 * step / (2 * math.sqrt(trials))
    assert mean_err.abs().max() <= bound
    # and on average, far below the nearest-rounding bias scale
    assert mean_err.abs().mean() <= bound / 3


def test_stochastic_rounding_is_reproducible_and_seeded():
    x = torch.randn(2000)
    a = codec("int4:rounding=stochastic,seed=7")
    b = codec("int4:rounding=stochastic,seed=7")
    other = codec("int4:rounding=stochastic,seed=8")
    pa, pb, po = a.encode(x), b.encode(x), other.encode(x)
    assert torch.equal(pa.tensors[0], pb.tensors[0])
    assert not torch.equal(pa.tensors[0], po.tensors[0])
    # successive calls use different streams; different stream ids differ too
    assert not torch.equal(a.encode(x).tensors[0], pa.tensors[0])
    other_stream = codec("int4:rounding=stochastic,seed=7").encode(x, rng_stream=1)
    assert not torch.equal(other_stream.tensors[0], pa.tensors[0])


def _student_t(n, df=2.0, seed=0):
    return student_t(n, df, "cpu", torch.Generator().manual_seed(seed))


def test_student_t_is_reproducible_from_its_seed():
    assert torch.equal(_student_t(1000, seed=3), _student_t(1000, seed=3))
    assert not torch.equal(_student_t(1000, seed=3), _student_t(1000, seed=4))


def test_hadamard_halves_int4_error_on_heavy_tails():
    x = _student_t(128 * 2048)
    plain, smooth = codec("int4"), codec("int4:hadamard=128")
    rel = lambda c: ((c.decode(c.encode(x)) - x).norm() / x.norm()).item()  # noqa: E731
    assert rel(smooth) <= 0.5 * rel(plain)


def test_error_feedback_accumulates_to_the_true_sum():
    ef, c = ErrorFeedback(), codec("topk:ratio=0.05")
    g = torch.randn(2000)
    sent = torch.zeros(2000)
    steps = 200
    for _ in range(steps):
        sent += c.decode(ef.encode(c, g, key="w"))
    # sum of what was sent = steps·g − final residual: the residual stays bounded
    assert torch.allclose(sent + ef.residuals["w"], steps * g, rtol=1e-4, atol=1e-3)
    assert ef.residuals["w"].norm() < 0.2 * (steps * g).norm()


def test_error_feedback_keeps_memory_finite_and_checkpoints():
    ef, c = ErrorFeedback(), codec("int2")
    ef.encode(c, torch.randn(300), key="a")
    before = ef.residuals["a"].clone()
    bad = torch.randn(300)
    bad[3] = float("nan")
    ef.encode(c, bad, key="a")
    assert torch.isfinite(ef.residuals["a"]).all()
    state = ef.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    x = torch.randn(300)
    assert torch.equal(c.decode(ef.encode(c, x, key="a")), c.decode(other.encode(c, x, key="a")))
    assert not torch.equal(before, state["residuals"]["a"])


def test_delta_reconstructs_the_reference_plus_difference():
    w = torch.randn(5000).to(torch.bfloat16)
    new = (w.float() + 1e-3 * torch.randn(5000)).to(torch.bfloat16)
    c = codec("int4:group=2048")
    sent = c.decode(c.encode(difference(new, w)))
    out = w.clone()
    apply_difference(out, sent, out=out)  # in place, as every rank does in qWD
    assert out.dtype == torch.bfloat16
    diff_err = (out.float() - new.float()).norm() / (new.float() - w.float()).norm()
    direct = codec("int4:group=2048")
    w_err = (direct.decode(direct.encode(new)).float() - new.float()).norm()
    # quantizing the small difference is far more accurate than quantizing the weights
    assert (out.float() - new.float()).norm() < 0.05 * w_err
    assert diff_err < 0.5


@pytest.mark.parametrize("opts", ["", ",hadamard=128", ",rounding=stochastic,seed=3",
                                  ",group=100,scale_dtype=fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int2_trit_packing_decodes_the_same_values_in_fewer_bytes(opts, dtype):
    x = torch.randn(5000).to(dtype)
    x[17] = float("nan")
    bits, trits = codec("int2" + opts.replace(",", ":", 1)), codec("int2:packing=trits" + opts)
    a, b = bits.decode(bits.encode(x)), trits.decode(trits.encode(x))
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    group = bits.group
    assert trits.wire_bytes(x.numel()) == (
        -(-x.numel() // group) * (-(-group // 5) + bits.torch_scale_dtype.itemsize))
