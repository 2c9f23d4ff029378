"""DPBucket: one bucket's codecs and their state, in one shape for every front-end."""

import pytest
import torch

from commpress import InputError, Policy, Topology
from commpress.codecs.error_feedback import encode
from commpress.dp import DPBucket

STATEFUL = Policy.from_dict({
    "name": "stateful",
    "dp": {"grad": {"codec": "int4:rounding=stochastic", "error_feedback": True},
           "param": {"codec": "int4:group=2048,rounding=stochastic", "delta": True}}})


def _used(dp: DPBucket) -> DPBucket:
    """Advance every codec's state: memory, rounding counters."""
    x = torch.randn(4096)
    encode(dp.grad.codecs["single"], x, rng_stream=0, key="g", memory=dp.grad.memories["single"])
    dp.param.encode(x)
    return dp


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_alignment_covers_both_codecs():
    sdp4bit = DPBucket(Policy.resolve("sdp4bit"), Topology(2), weights=True)
    assert sdp4bit.alignment % 2048 == 0 and sdp4bit.alignment % 128 == 0
    assert DPBucket(Policy.resolve("sdp4bit"), Topology(2)).alignment == 128  # no weights


def test_state_round_trips_and_fresh_forgets_it():
    dp = _used(DPBucket(STATEFUL, Topology(1), weights=True))
    state = dp.state_dict()
    assert set(state) == {"grad", "param"}
    other = DPBucket(STATEFUL, Topology(1), weights=True)
    other.load_state_dict(state)
    assert _same(other.state_dict(), state)
    fresh = DPBucket(STATEFUL, Topology(1), weights=True)
    other.load_state_dict(state, memory=False)  # another world: checked, then fresh
    assert _same(other.state_dict(), fresh.state_dict())
    assert not _same(other.state_dict(), state)


def test_a_reference_is_saved_and_refused_when_it_does_not_fit():
    dp = DPBucket(STATEFUL, Topology(1), weights=True)
    dp.reference = torch.arange(8.0)
    state = dp.state_dict()
    other = DPBucket(STATEFUL, Topology(1), weights=True)
    other.reference = torch.zeros(8)
    other.load_state_dict(state)
    assert torch.equal(other.reference, dp.reference)
    other.reference = torch.zeros(9)
    with pytest.raises(InputError, match="reference of shape"):
        other.load_state_dict(state)
    no_reference = DPBucket(STATEFUL, Topology(1), weights=True)
    with pytest.raises(InputError, match="same policy"):
        no_reference.load_state_dict(state)


def test_state_of_another_shape_is_refused_naming_the_parts():
    dp = DPBucket(STATEFUL, Topology(1), weights=True)
    grad_only = DPBucket(STATEFUL, Topology(1)).state_dict()
    with pytest.raises(InputError, match=r"has \['grad'\].*has \['grad', 'param'\]"):
        dp.load_state_dict(grad_only)
    with pytest.raises(InputError, match="codec state has list"):
        dp.load_state_dict([])
