"""The mean-|x| quantizers below two bits: their error on Gaussian data, and error
feedback carrying what they clip."""

import pytest
import torch

from commpress.codecs import ErrorFeedback, codec


def _mse(spec: str, x: torch.Tensor) -> float:
    c = codec(spec)
    return ((c.decode(c.encode(x)) - x) ** 2).mean().item() / x.var().item()


def test_gaussian_error_matches_lloyd_max_theory():
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    assert _mse("sign", x) == pytest.approx(1 - 2 / torch.pi, rel=0.03)  # 0.363
    assert _mse("nf2", x) == pytest.approx(0.1175, rel=0.05)
    # the absmax ternary int2 loses more at the same wire size
    assert _mse("nf2", x) < 0.25 * _mse("int2", x)
    assert _mse("sign", x) < _mse("int2", x)


@pytest.mark.parametrize("spec,bits", [("sign", 1.25), ("nf2", 2.25),
                                       ("sign:scale_dtype=fp16,group=256", 1.0625)])
def test_wire_bits(spec, bits):
    assert codec(spec).bits_per_element(128 * 64) == bits


def test_codes_pack_and_unpack_every_level():
    c = codec("nf2:group=8")
    x = torch.tensor([-3.0, -0.5, 0.5, 3.0, -3.0, -0.5, 0.5, 3.0])  # mean |x| = 1.75
    y = c.decode(c.encode(x))
    a = 1.75
    assert torch.allclose(y, torch.tensor([-1.8925, -0.5675, 0.5675, 1.8925] * 2) * a)


def test_last_partial_group_is_scaled_by_its_own_elements():
    x = torch.ones(130)  # 128 + 2: the last group's mean |x| is 1, not 2/128
    assert torch.equal(codec("sign").decode(codec("sign").encode(x)), x)


@pytest.mark.parametrize("spec", ["sign", "nf2"])
def test_error_feedback_sends_the_true_sum(spec):
    ef, c = ErrorFeedback(), codec(spec)
    g = torch.randn(4096, generator=torch.Generator().manual_seed(1)) ** 3  # heavy tails
    sent = torch.zeros_like(g)
    owed = []
    for _ in range(2):
        for _ in range(300):
            sent += c.decode(ef.encode(c, g, key="w"))
        owed.append(ef.residuals["w"].norm().item())
    # what was sent plus what is still owed is the true sum, and what is owed stops
    # growing (outliers wait until their group's scale has risen enough to carry them)
    assert torch.allclose(sent + ef.residuals["w"], 600 * g, rtol=1e-4, atol=0.05)
    assert owed[1] <= 1.05 * owed[0] and owed[1] < 0.1 * (600 * g).norm()
