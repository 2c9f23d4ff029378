"""Error feedback at the edges: the memory never gets stuck non-finite on finite input,
and a non-finite step never poisons it."""

import pytest
import torch

import commpress
from commpress.codecs import ErrorFeedback, codec


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "int2", "sign", "int4:scale_dtype=fp16"])
def test_fp16_input_near_its_max_stays_finite_step_after_step(spec):
    ef, c = ErrorFeedback(), codec(spec)
    x = torch.full((512,), 60000.0, dtype=torch.float16)
    x[::3] = -65000.0
    for _ in range(20):
        y = c.decode(ef.encode(c, x, key="g"))
        # the residual grows past fp16's range; what is sent saturates there
        assert torch.isfinite(y).all(), spec
        assert torch.isfinite(ef.residuals["g"]).all(), spec


def test_a_non_finite_step_keeps_the_old_memory():
    ef, c = ErrorFeedback(), codec("int2")
    x = torch.randn(256)
    ef.encode(c, x, key="g")
    before = ef.residuals["g"].clone()
    bad = x.clone()
    bad[7] = float("nan")
    y = c.decode(ef.encode(c, bad, key="g"))
    assert y.isnan().any()  # the NaN is not hidden
    after = ef.residuals["g"]
    assert torch.isfinite(after).all()
    # the group with the NaN kept its old residual
    assert torch.equal(after[:128], before[:128])


def test_a_decay_fades_the_residual_before_it_is_added():
    # SparseLoCo's 0.95: send C(g + 0.95 e); what the code leaves behind for long fades
    c = codec("chunktopk:chunk=64,k=4")
    kept, faded = ErrorFeedback(), ErrorFeedback(decay=0.95)
    x = torch.randn(256)
    kept.encode(c, x, key="g")
    faded.encode(c, x, key="g")
    residual = kept.residuals["g"].clone()
    assert torch.equal(faded.residuals["g"], residual)  # the first step has nothing to fade
    y = torch.randn(256)
    sent = c.decode(faded.encode(c, y, key="g"))
    assert torch.equal(sent, c.decode(c.encode(y + 0.95 * residual)))
    assert faded.spec() == "ef:decay=0.95" and kept.spec() == "ef"


@pytest.mark.parametrize("decay", [0, -0.5, 1.5, float("nan"), True, "0.9"])
def test_a_bad_decay_is_refused_by_name(decay):
    with pytest.raises(commpress.InputError, match=r"decay=.* is not allowed; allowed: a "
                                                   r"number in \(0, 1\]"):
        ErrorFeedback(decay=decay)
