"""ShardedOptimizer on one rank (no process group): the same code path, no communication."""

import pytest
import torch

import commpress
from tests.integrations.workers import _data, _model


def _batches(data, n, bs=8):
    return [data.batch("train", bs, 32, 0, i) for i in range(n)]


@pytest.mark.parametrize(("cls", "kwargs"), [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                             (torch.optim.AdamW, {"lr": 3e-3})])
def test_matches_the_plain_torch_optimizer(cls, kwargs):
    data = _data()
    a, b = _model(), _model()
    opt_a = commpress.ShardedOptimizer(a, cls, "none", decay_1d=True, **kwargs)
    opt_b = cls(b.parameters(), **kwargs)
    for x, y in _batches(data, 5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_no_sync_accumulation_equals_one_big_batch():
    data = _data()
    a, b = _model(), _model()
    # SGD: the update is linear in the gradient, so only fp32 summation order differs
    # (AdamW's g/√v would magnify rounding in near-zero gradients)
    opt_a = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=0.1)
    opt_b = commpress.ShardedOptimizer(b, torch.optim.SGD, "none", lr=0.1)
    for x, y in _batches(data, 3, bs=8):
        with opt_a.no_sync():
            (a(x[:4], y[:4])[1] / 2).backward()
        (a(x[4:], y[4:])[1] / 2).backward()
        opt_a.step()
        opt_a.zero_grad()
        b(x, y)[1].backward()
        opt_b.step()
        opt_b.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_update():
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.SGD, "none", lr=1.0, max_grad_norm=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(data, 1)[0]
    model(x, y)[1].backward()
    opt.step()
    moved = torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(model.parameters(), before)))
    assert opt.last_grad_norm > 0.01
    assert moved.item() == pytest.approx(0.01, rel=1e-3)  # SGD lr 1: the step is the clipped grad


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nonfinite='ignore' is not allowed; allowed: skip, raise"):
        commpress.ShardedOptimizer(_model(), torch.optim.SGD, "none", lr=0.1, nonfinite="ignore")
    with pytest.raises(ValueError, match="max_grad_norm=0 is not allowed"):
        commpress.ShardedOptimizer(_model(), torch.optim.SGD, "none", lr=0.1, max_grad_norm=0)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        commpress.ShardedOptimizer(torch.nn.Linear(2, 2).requires_grad_(False), torch.optim.SGD,
                                   "none", lr=0.1)


def test_a_policy_or_an_optimizer_instance_in_the_wrong_place_is_named():
    with pytest.raises(TypeError, match="a policy name goes in the third argument"):
        commpress.ShardedOptimizer(_model(), "sdp4bit")
    model = _model()
    with pytest.raises(TypeError, match="pass the class, e.g. torch.optim.AdamW"):
        commpress.ShardedOptimizer(model, torch.optim.AdamW(model.parameters()), "none")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        commpress.ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD)
    with pytest.raises(ValueError, match="init_sync='copy' is not allowed"):
        commpress.ShardedOptimizer(_model(), torch.optim.SGD, "none", lr=0.1, init_sync="copy")
