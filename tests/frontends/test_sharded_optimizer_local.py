"""ShardedOptimizer on one rank (no process group): the same code path, no communication."""

import pytest
import torch

import commpress
from tests.frontends.workers import _data, _model


def _batches(data, n, bs=8):
    return [data.batch("train", bs, 32, 0, i) for i in range(n)]


@pytest.mark.parametrize(("cls", "kwargs"), [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                             (torch.optim.AdamW, {"lr": 3e-3}),
                                             (torch.optim.AdamW, {"lr": 3e-3,
                                                                  "weight_decay": 0.3})])
def test_matches_the_plain_torch_optimizer(cls, kwargs):
    # weight_decay means what it means in the wrapped optimizer: every parameter decays
    # (an explicit value used to leave biases and norms undecayed)
    data = _data()
    a, b = _model(), _model()
    opt_a = commpress.ShardedOptimizer(a, cls, "none", **kwargs)
    opt_b = cls(b.parameters(), **kwargs)
    for x, y in _batches(data, 5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_parameters_and_parameter_groups_as_torch_optimizers_take_them():
    """As ``torch.optim`` and ``ZeroRedundancyOptimizer`` do: a list of parameters, or
    groups with their own options (here lr and weight decay per group), driven by a
    scheduler, equal the torch optimizer over the same groups."""
    data = _data()
    a, b, c = _model(), _model(), _model()

    def groups(model):
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return [{"params": matrices, "weight_decay": 0.1},
                {"params": rest, "lr": 1e-3, "weight_decay": 0.0}]

    opts = [commpress.ShardedOptimizer(groups(a), torch.optim.AdamW, "none", lr=3e-3),
            torch.optim.AdamW(groups(b), lr=3e-3),
            commpress.ShardedOptimizer(c.parameters(), torch.optim.AdamW, "none", lr=3e-3)]
    reference = _model()
    plain = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in opts[:2]]
    for x, y in _batches(data, 4):
        for model, opt in ((a, opts[0]), (b, opts[1]), (c, opts[2]), (reference, plain)):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        for sched in scheds:
            sched.step()
    for mine, theirs in ((a, b), (c, reference)):
        for pa, pb in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert sorted({g["lr"] for g in opts[0].param_groups}) == [1e-3 / 16, 3e-3 / 16]


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
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, or an iterable"):
        commpress.ShardedOptimizer(torch.nn.Parameter(torch.ones(2)), torch.optim.SGD)
    with pytest.raises(TypeError, match="parameter group 0 item 0 is a Tensor"):
        commpress.ShardedOptimizer([torch.ones(2)], torch.optim.SGD)
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="group 1 item 0 is in an earlier group too"):
        commpress.ShardedOptimizer([{"params": [p]}, {"params": [p]}], torch.optim.SGD)
    with pytest.raises(ValueError, match=r"norm_weights names \['head.weight'\].*group<g>"):
        commpress.ShardedOptimizer([p], torch.optim.SGD, lr=0.1,
                                   norm_weights={"head.weight": 0.5})
    with pytest.raises(ValueError, match="init_sync='copy' is not allowed"):
        commpress.ShardedOptimizer(_model(), torch.optim.SGD, "none", lr=0.1, init_sync="copy")


def _one_backward(model, data, step=0):
    x, y = _batches(data, step + 1)[step]
    loss = model(x, y)[1]
    loss.backward()
    return loss


def test_clip_grad_norm_method_is_the_max_grad_norm_step_and_torchs_norm():
    data = _data()
    a, b, plain = _model(), _model(), _model()
    opt_a = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=1.0)
    opt_b = commpress.ShardedOptimizer(b, torch.optim.SGD, "none", lr=1.0, max_grad_norm=0.01)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=1.0)
    for step in range(3):
        _one_backward(a, data, step)
        norm = opt_a.clip_grad_norm_(0.01)
        opt_a.step()
        opt_a.zero_grad()
        _one_backward(b, data, step)
        opt_b.step()
        opt_b.zero_grad()
        _one_backward(plain, data, step)
        torch_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
        opt_plain.step()
        opt_plain.zero_grad()
        # the same clip as max_grad_norm, bit for bit; the norm torch reports, up to
        # the fp32 summation order (torch sums per tensor, we per bucket in fp64)
        assert norm.item() == pytest.approx(torch_norm.item(), rel=1e-5)
        assert norm.item() == pytest.approx(opt_a.last_grad_norm, rel=1e-6)
    for pa, pb, pp in zip(a.parameters(), b.parameters(), plain.parameters()):
        assert torch.equal(pa, pb)
        torch.testing.assert_close(pa, pp, rtol=1e-5, atol=1e-6)


def _two_linear_models():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)


def test_torch_clip_grad_norm_refuses_part_of_an_optimizer_or_two_of_them():
    a, b = _two_linear_models()
    opt_a = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=0.1)
    opt_b = commpress.ShardedOptimizer(b, torch.optim.SGD, "none", lr=0.1)
    (a(torch.ones(2, 4)).sum() + b(torch.ones(2, 4)).sum()).backward()
    with pytest.raises(commpress.InputError, match="1 of the 2 parameters of a ShardedOptimizer"):
        torch.nn.utils.clip_grad_norm_([a.weight], 1.0)
    with pytest.raises(commpress.InputError, match="several ShardedOptimizers"):
        torch.nn.utils.clip_grad_norm_([*a.parameters(), *b.parameters()], 1.0)
    loose = torch.nn.Parameter(torch.ones(3))
    loose.grad = torch.ones(3)
    with pytest.raises(commpress.InputError, match="1 parameters with .grad outside it"):
        torch.nn.utils.clip_grad_norm_([*a.parameters(), loose], 1.0)
    with pytest.raises(commpress.InputError, match="mixed with its param_groups' master"):
        torch.nn.utils.clip_grad_norm_([a.weight, opt_a.param_groups[0]["params"][0]], 1.0)
    with pytest.raises(commpress.InputError, match="norm_type=1.0 is not allowed"):
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0, norm_type=1.0)
    # parameters no optimizer holds: torch's function, unchanged
    assert float(torch.nn.utils.clip_grad_norm_([loose], 100.0)) == pytest.approx(3 ** 0.5)
    # the held ones: the optimizer's norm (one rank: its own gradient's), never 0; the
    # same through its param_groups (fp32 masters), a tensor limit or inf (measure only)
    norm = float(torch.nn.utils.clip_grad.clip_grad_norm_(a.parameters(), 1e9))
    assert norm > 0 and norm == pytest.approx(float(opt_a.clip_grad_norm_(1e9)))
    masters = [p for g in opt_a.param_groups for p in g["params"]]
    assert float(torch.nn.utils.clip_grad_norm_(masters, torch.tensor(1e9))) == norm
    assert float(torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"))) == norm
    opt_a.step()
    opt_b.step()


def test_torch_clip_grad_norm_sees_grad_again_after_remove_and_stops_on_nonfinite():
    a, _ = _two_linear_models()
    opt = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=0.1)
    a(torch.full((2, 4), float("nan"))).sum().backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0, error_if_nonfinite=True)
    opt.zero_grad()
    opt.remove()
    a(torch.ones(2, 4)).sum().backward()  # into .grad again: torch's own norm
    want = torch.cat([p.grad.reshape(-1) for p in a.parameters()]).norm()
    assert float(torch.nn.utils.clip_grad_norm_(a.parameters(), 1e9)) == pytest.approx(
        float(want))


def test_clip_grad_norm_refuses_a_later_backward_and_bad_arguments():
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.SGD, "none", lr=0.1)
    for bad in (0, True, float("nan"), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="is not allowed; allowed: a number > 0"):
            opt.clip_grad_norm_(bad)
    with pytest.raises(ValueError, match="norm_type=inf is not allowed; allowed: 2.0"):
        opt.clip_grad_norm_(1.0, norm_type=float("inf"))
    _one_backward(model, data)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="after clip_grad_norm_"):
        _one_backward(model, data)
    opt.zero_grad()  # discards the step's gradients: a new backward is welcome
    _one_backward(model, data)
    assert opt.step() is True


def test_zero_grad_honours_set_to_none():
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.SGD, "none", lr=0.1)
    p = next(model.parameters())
    p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and not p.grad.any()
    opt.zero_grad()
    assert p.grad is None


def test_step_runs_the_closure_with_gradients_and_returns_its_loss():
    data = _data()
    a, b = _model(), _model()
    opt_a = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=0.1)
    opt_b = commpress.ShardedOptimizer(b, torch.optim.SGD, "none", lr=0.1)
    for step in range(2):
        def closure(step=step):
            opt_a.zero_grad()
            return _one_backward(a, data, step)  # backward needs gradients enabled

        loss = opt_a.step(closure)
        expected = _one_backward(b, data, step)
        assert opt_b.step() is True
        opt_b.zero_grad()
        assert torch.equal(loss, expected)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i)),
    # OneCycleLR also cycles AdamW's betas: they must reach the inner optimizer too
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2,
                                                                total_steps=6),
}


@pytest.mark.parametrize("schedule", SCHEDULERS)
def test_a_torch_lr_scheduler_drives_it_like_adamw(schedule):
    data = _data()
    a, b = _model(), _model()
    opt_a = commpress.ShardedOptimizer(a, torch.optim.AdamW, "none", decay_1d=True, lr=3e-3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=3e-3)
    assert isinstance(opt_a, torch.optim.Optimizer)
    sched_a, sched_b = SCHEDULERS[schedule](opt_a), SCHEDULERS[schedule](opt_b)
    for x, y in _batches(data, 5):
        for model, opt, sched in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        assert sched_a.get_last_lr()[0] == sched_b.get_last_lr()[0]
        # the groups a scheduler writes are the inner optimizer's, on the shards
        for g in opt_a.optimizer.param_groups:
            assert (g["lr"], g["betas"]) == (opt_b.param_groups[0]["lr"],
                                             opt_b.param_groups[0]["betas"])
    # a schedule that did not reach the shards would move the weights by lr·(1 - γ) more
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_param_groups_are_the_inner_optimizers_and_add_param_group_is_refused():
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.SGD, "none", lr=0.1)
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    with pytest.raises(ValueError, match="add_param_group is not supported"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert "ShardedOptimizer (" in repr(opt)


def test_step_hooks_of_torch_optim_run():
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.SGD, "none", lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    _one_backward(model, data)
    assert opt.step() is True
    assert calls == ["pre", "post"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_grad_norm": float("inf")},
     "max_grad_norm=inf is not allowed; allowed: a finite number > 0 or none"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm=nan is not allowed"),
    ({"bucket_numel": True}, "bucket_numel=True is not allowed; allowed: an integer >= 1"),
    ({"bucket_numel": 0}, "bucket_numel=0 is not allowed; allowed: an integer >= 1"),
    ({"broadcast_buffers": "yes"},
     "broadcast_buffers='yes' is not allowed; allowed: True, False"),
])
def test_bad_numbers_and_flags_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        commpress.ShardedOptimizer(_model(), torch.optim.SGD, "none", lr=0.1, **kwargs)


def test_a_scheduler_still_reaches_the_shards_after_load_state_dict():
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "none", lr=3e-3)
    _one_backward(model, data)
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())  # torch's load makes new group dicts
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _one_backward(model, data, 1)
    opt.step()
    sched.step()
    assert {g["lr"] for g in opt.optimizer.param_groups} == {1.5e-3}


def test_a_consolidated_state_is_refused_without_elastic_and_for_another_policy_or_model():
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, torch.optim.AdamW, "none", lr=0.1)
    _one_backward(model, data)
    opt.step()
    full = opt.consolidate_state_dict()
    assert full["steps"] == 1 and len(full["buckets"]) == len(opt.buckets)
    with pytest.raises(ValueError, match="format"):
        opt.load_state_dict(full)  # a consolidated state is not this rank's own
    with pytest.raises(ValueError, match="format"):
        opt.load_state_dict(opt.state_dict(), elastic=True)  # one rank's shard only
    with pytest.raises(ValueError, match="to=1"):
        opt.consolidate_state_dict(to=1)
    other = commpress.ShardedOptimizer(_model(), torch.optim.AdamW, "int2ef", lr=0.1)
    with pytest.raises(ValueError, match="policy"):
        other.load_state_dict(full, elastic=True)
    smaller = commpress.ShardedOptimizer(torch.nn.Linear(4, 4), torch.optim.AdamW, "none")
    with pytest.raises(ValueError, match="other parameters than this run's"):
        smaller.load_state_dict(full, elastic=True)
    fresh_model = _model(seed=1)
    fresh = commpress.ShardedOptimizer(fresh_model, torch.optim.AdamW, "none", lr=0.1)
    fresh.load_state_dict(full, elastic=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), model.parameters()))
    assert torch.equal(fresh.state_dict()["master"][0], opt.state_dict()["master"][0])


def test_an_old_optimizers_release_leaves_the_new_ones_routing():
    a, _ = _two_linear_models()
    old = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=0.1)
    old.remove()
    new = commpress.ShardedOptimizer(a, torch.optim.SGD, "none", lr=0.1)
    old.remove()  # again, after the new one took the parameters
    a(torch.ones(2, 4)).sum().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(a.parameters(), 1e9))
    assert norm > 0 and norm == pytest.approx(float(new.clip_grad_norm_(1e9)))


class _SGDWithHistory(torch.optim.SGD):
    """SGD that keeps a short history per parameter: state that is not elementwise."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("history", torch.zeros(3))
        return super().step(closure)


def test_consolidating_state_that_is_not_elementwise_is_refused():
    data = _data()
    model = _model()
    opt = commpress.ShardedOptimizer(model, _SGDWithHistory, "none", lr=0.1)
    _one_backward(model, data)
    opt.step()
    with pytest.raises(commpress.InputError, match="'history' has shape \\(3,\\), neither"):
        opt.consolidate_state_dict()
    adam = commpress.ShardedOptimizer(_model(), torch.optim.Adam, "none", lr=0.1)
    _one_backward(adam.model, data)
    adam.step()
    full = adam.consolidate_state_dict()  # moments elementwise, the step a scalar
    assert set(full["buckets"][0]["state"]) == {"exp_avg", "exp_avg_sq"}
    assert set(full["buckets"][0]["scalars"]) == {"step"}
    assert all(t.device.type == "cpu" for b in full["buckets"] for t in b["state"].values())

