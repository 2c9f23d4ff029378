"""The mixture-of-experts MLP: every token reaches its top-k experts (dropless), the
grouped matmul equals a per-token loop, and the load-balancing loss trains the router."""

import pytest
import torch
import torch.nn.functional as F

from commpress.model.gpt import GPT, GPTConfig, config_from_preset
from commpress.model.moe import MoE
from commpress.validate import InputError


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the renormalized top-k probabilities times each expert's MLP."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.softmax(moe.router(tokens).float(), dim=-1)
    out = torch.zeros_like(tokens)
    for n, t in enumerate(tokens):
        w, e = probs[n].topk(moe.top_k)
        w = w / w.sum()
        for weight, expert in zip(w, e.tolist()):
            out[n] += weight * (F.gelu(t @ moe.w_in[expert]) @ moe.w_out[expert])
    return out.view_as(x)


@pytest.mark.parametrize(("n_expert", "top_k"), [(8, 2), (4, 1), (3, 3)])
def test_grouped_experts_equal_a_per_token_loop(n_expert, top_k):
    torch.manual_seed(0)
    moe = MoE(16, 24, n_expert, top_k, aux_loss_coef=0.0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), _reference(moe, x), rtol=1e-5, atol=1e-5)


def test_an_expert_no_token_chose_gets_a_zero_gradient_and_the_router_learns():
    torch.manual_seed(0)
    moe = MoE(8, 8, 4, 1, aux_loss_coef=0.01)
    torch.nn.init.normal_(moe.w_in)
    torch.nn.init.normal_(moe.w_out)
    with torch.no_grad():  # every token prefers expert 2
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    x = torch.rand(2, 6, 8) + 0.1
    (moe(x) * torch.randn(2, 6, 8)).sum().backward()
    assert moe.w_in.grad[2].abs().sum() > 0
    assert moe.w_in.grad[[0, 1, 3]].abs().sum() == 0
    # the load-balancing loss alone pushes the router away from its one expert
    moe.zero_grad()
    moe(x).mul(0).sum().backward()
    assert moe.router.weight.grad[2].sum() > 0  # descent lowers expert 2's logits
    assert moe.last_aux_loss == pytest.approx(0.01 * 4 * 1.0 * moe_probs(moe, x)[:, 2].mean(),
                                              rel=1e-5)


def moe_probs(moe, x):
    return F.softmax(moe.router(x.reshape(-1, x.shape[-1])), dim=-1).detach()


def test_kept_experts_are_a_slice_of_the_full_set():
    torch.manual_seed(0)
    moe = MoE(8, 8, 8, 2, 0.0)
    torch.nn.init.normal_(moe.w_in)
    full = moe.w_in.detach().clone()
    moe.keep_experts(4, 2)
    assert torch.equal(moe.w_in, full[4:6]) and moe.n_local == 2 and moe.first_expert == 4


def test_a_moe_gpt_counts_its_parameters_and_trains():
    torch.manual_seed(0)
    cfg = config_from_preset("moe-tiny")
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    x = torch.randint(0, 256, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_non_finite_tokens_stay_non_finite():
    torch.manual_seed(0)
    moe = MoE(8, 8, 4, 2, 0.0)
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(1, 4, 8)
    x[0, 1, 3] = float("nan")
    assert torch.isnan(moe(x)[0, 1]).any()


@pytest.mark.parametrize(("field", "value"), [("n_expert", -1), ("top_k", 0),
                                              ("expert_hidden", -2), ("aux_loss_coef", -1.0)])
def test_bad_moe_shapes_name_the_field(field, value):
    with pytest.raises(InputError, match=field):
        GPTConfig(**{"n_expert": 4, field: value})


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(InputError, match="top_k=5"):
        GPTConfig(n_expert=4, top_k=5)
