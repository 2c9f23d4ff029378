"""EPExchange: the ``ep`` axis's dispatch and combine, differentiable, through the policy."""

import pytest

from commpress import InputError, Policy
from commpress.ep import EPExchange
from commpress.launch import spawn
from tests.ep import workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank


@pytest.mark.parametrize("world", [2, 4])
def test_none_is_torch_bit_for_bit_forward_and_backward(world):
    for r in spawn(workers.dispatch_and_combine, world, ("none",)):
        assert r["bitwise"], r


def test_each_preset_compresses_the_directions_it_names_and_stays_close():
    # fp32 tokens of 96 elements, each padded to 128: 128 codes and one fp32 scale
    fp8, int4 = (128 + 4) / (96 * 4), (64 + 4) / (96 * 4)
    for r in spawn(workers.dispatch_and_combine, 2, ("ep-fp8",)):
        assert r["rel"][0] < 0.05 and max(r["rel"][1:]) < 0.1, r
        # fp8 to the experts and for the combine's gradient; exact the other two ways
        assert r["ratio"] == {"ep.dispatch": fp8, "ep.combine_grad": fp8,
                              "ep.combine": 1.0, "ep.dispatch_grad": 1.0}, r
    for r in spawn(workers.dispatch_and_combine, 2, ("ep-int4",)):
        assert r["ratio"] == dict.fromkeys(["ep.dispatch", "ep.combine", "ep.dispatch_grad",
                                            "ep.combine_grad"], int4), r
        assert r["rel"][0] < 0.15, r


def test_the_ep_rules_a_policy_may_hold():
    with pytest.raises(InputError, match=r"ep.dispatch.codec='topk:ratio=0.1' is not "
                                         r"allowed; allowed: a fixed-rate codec"):
        Policy.from_dict({"ep": {"dispatch": "topk:ratio=0.1"}})
    with pytest.raises(InputError, match=r"ep.combine_grad.error_feedback=true is not allowed"):
        Policy.from_dict({"ep": {"combine_grad": {"codec": "int4", "error_feedback": True}}})
    with pytest.raises(InputError, match=r"ep.dispatch.codec='int8:rounding=stochastic' rounds "
                                         r"stochastically"):
        Policy.from_dict({"ep": {"dispatch": "int8:rounding=stochastic"}})
    with pytest.raises(InputError, match=r"unknown kind ep.router"):
        Policy.from_dict({"ep": {"router": "int8"}})
    assert Policy.preset("hybrid").rule("ep", "dispatch").codec == "int8"


def test_state_is_refused_under_another_policy():
    saved = EPExchange("ep-int8").state_dict()
    EPExchange("ep-int8").load_state_dict(saved)
    with pytest.raises(InputError, match="resume with the same policy"):
        EPExchange("ep-fp8").load_state_dict(saved)


@pytest.mark.slow
def test_a_rank_killed_mid_dispatch_is_named_by_the_survivors():
    ranks = spawn(workers.killed_mid_dispatch, 3, (1,), pg_timeout_s=5, timeout=120,
                  allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=5)


def test_levels_of_an_ep_kind():
    policy = Policy.from_dict({"ep": {"dispatch": {"intra": "none", "inter": "int8"}}})
    assert policy.rule("ep", "dispatch", "inter").codec == "int8"
    ep = EPExchange(policy)
    assert set(ep.codecs["dispatch"]) == {"intra", "inter", "topology"}
    assert set(ep.codecs["combine"]) == {"codec"}
