"""Fuzzing codecs and collectives with hypothesis: shapes, dtypes, groups, extreme values."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commpress.codecs import codec
from commpress.launch import spawn
from tests.reliability import workers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIALS = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e-40, 1e-8, 65504.0,
            -65504.0, 1e30, -1e30, 3.4e38, -3.4e38, 1e37]
SPECS = st.sampled_from(["none", "bf16", "fp8", "int8", "int4", "int2", "topk:ratio=0.3",
                         "zfp:rate=16"]) | st.builds(
    lambda bits, group, had, sd: f"int{bits}:group={group},hadamard={had},scale_dtype={sd}",
    st.sampled_from([2, 4, 8]), st.sampled_from([1, 7, 32, 128, 1000]),
    st.sampled_from([0, 16, 128]), st.sampled_from(["fp32", "fp16"]))


def _limit(spec: str, dtype: torch.dtype) -> float:
    """Largest magnitude a codec decodes finite: every codec saturates finite values but
    the ``fp16`` cast, whose overflow is visible as ±Inf (as torch's fp16 hook)."""
    return 65504.0 if spec == "fp16" else float("inf")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=SPECS, dtype=st.sampled_from(list(DTYPES)), shape=st.lists(st.integers(0, 40),
       min_size=1, max_size=3), specials=st.lists(st.sampled_from(SPECIALS), max_size=6),
       seed=st.integers(0, 2**16))
def test_codec_fuzz(spec, dtype, shape, specials, seed):
    dt = DTYPES[dtype]
    c = codec(spec)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 10).to(dt)
    flat = x.view(-1)
    for j, v in enumerate(specials):
        if flat.numel():
            flat[(j * 31) % flat.numel()] = v
    y = c.decode(c.encode(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    nonfinite = ~torch.isfinite(x)
    # never turns a non-finite value finite
    assert (~torch.isfinite(y[nonfinite])).all()
    # never turns finite data within the codec's range non-finite, unless the same
    # group held a non-finite value (the whole group then decodes to NaN)
    biggest = x.abs().max().item() if x.numel() else 0.0
    if not nonfinite.any() and biggest <= _limit(spec, dt):
        assert torch.isfinite(y).all(), spec
    if c.lossless and not nonfinite.any():
        assert torch.equal(y, x)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(list(DTYPES)),
                                SPECS, st.lists(st.sampled_from(SPECIALS), max_size=3)),
                      min_size=12, max_size=12),
       world=st.sampled_from([2, 3]))
@pytest.mark.slow
def test_collective_fuzz(cases, world):
    ranks = spawn(workers.fuzz_collectives, world, (cases,), timeout=300)
    for i in range(len(cases)):
        assert all(r[i]["shape"] for r in ranks)
        assert all(r[i]["nonfinite_kept"] for r in ranks), cases[i]
        # bitwise identical on every rank, whatever the input
        assert len({r[i]["digest"] for r in ranks}) == 1, cases[i]
