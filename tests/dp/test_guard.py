"""The convergence guard: its policy field, its ladder, and a guarded ShardedOptimizer on
two Gloo ranks — an aggressive codec promoted, a healthy preset left alone, replicas
bitwise identical through each promotion, a resume that decides the same."""

import math

import pytest

from commpress.launch import spawn
from commpress.policy import Guard, Policy, promote_codec
from commpress.validate import InputError
from tests.dp import guard_workers

INT2 = {"name": "naive-int2", "dp": {"grad": "int2:hadamard=0"}}


def test_the_ladder_goes_up_one_rung_at_a_time_to_exact():
    assert promote_codec("int2").startswith("int4:group=128,hadamard=0")
    assert promote_codec("int4:hadamard=128").startswith("int8:group=128,hadamard=128")
    assert promote_codec("int8") == "none" and promote_codec("none") == "none"
    assert promote_codec("nf2") == "int4" and promote_codec("fp8") == "bf16"
    assert promote_codec("bf16") == "none" and promote_codec("sign") == "none"
    assert promote_codec("topk:ratio=0.02") == "topk:ratio=0.08"
    assert promote_codec("topk:ratio=0.08") == "none"
    assert promote_codec("chunktopk").startswith("chunktopk:chunk=4096,k=256")
    assert promote_codec("chunktopk:k=1024") == "none" or "k=4096" not in promote_codec(
        "chunktopk:k=1024")
    rule = Policy.from_dict({"dp": {"grad": {"codec": "int8", "error_feedback": True}}}
                            ).rules["dp.grad"]
    assert rule.promoted().codec == "none" and not rule.promoted().error_feedback


def test_a_guard_is_read_from_a_policy_and_bad_values_are_refused_by_name():
    p = Policy.from_dict({**INT2, "guard": {"max_rel_error": 0.3, "window": 2, "every": 5}})
    assert p.guard == Guard(0.3, 2, 5)
    assert Policy.from_dict(p.to_dict()) == p  # saved and read back alike
    assert Policy.resolve("tlq").with_guard(0.5).guard == Guard(0.5)
    for bad, field in [(0, "max_rel_error"), (-1.0, "max_rel_error"),
                       (math.inf, "max_rel_error"), (math.nan, "max_rel_error"),
                       ({"max_rel_error": 0.3, "window": 0}, "window"),
                       ({"max_rel_error": 0.3, "every": 1.5}, "every"),
                       ({"max_rel_error": 0.3, "max_memory_ratio": 0}, "max_memory_ratio"),
                       ({"max_rel_error": 0.3, "max_weight_gap": -1}, "max_weight_gap")]:
        with pytest.raises(InputError, match=f"guard.{field}"):
            Policy.resolve("tlq").with_guard(bad)
    with pytest.raises(InputError, match="guard=.*is not allowed; allowed: a mapping with "
                                         "max_rel_error"):
        Policy.from_dict({**INT2, "guard": {"budget": 0.3}})


@pytest.fixture(scope="module")
def naive():
    """int2 without Hadamard or error feedback, guarded at 0.3 over 2 samples every step."""
    guard = {"max_rel_error": 0.3, "window": 2, "every": 1}
    return spawn(guard_workers.guarded, 2, (INT2, guard, 8), timeout=300)


def test_an_aggressive_codec_is_promoted_on_every_rank_alike_and_replicas_stay_identical(naive):
    a, b = naive
    assert a["hashes"] == b["hashes"]  # bitwise replicas, through every promotion
    assert a["events"] == b["events"] and a["events"], a["signals"]
    first = a["events"][0]
    assert first["step"] == 1 and first["rel_error"] > 0.3  # 2 samples in a row: steps 0, 1
    assert "int2" in first["from"] and "int4" in first["to"]
    assert a["codecs"][0] != a["codecs"][-1]
    # once promoted, the signal falls under the budget: no further promotion
    promoted = {e["bucket"] for e in a["events"]}
    assert all(s[j] < 0.3 for s in a["signals"][4:] for j in promoted)
    assert len(a["said"]) == len(a["events"]) and not b["said"]  # logged once, by rank 0


def test_a_resumed_guarded_run_decides_the_same(naive):
    guard = {"max_rel_error": 0.3, "window": 2, "every": 1}
    resumed = spawn(guard_workers.guarded, 2, (INT2, guard, 8, 4), timeout=300)
    assert resumed[0]["hashes"] == naive[0]["hashes"]
    assert resumed[0]["events"] == naive[0]["events"]


def test_a_healthy_preset_is_left_alone():
    ranks = spawn(guard_workers.guarded, 2, ("sdp4bit", 0.5, 10), timeout=300)
    assert ranks[0]["events"] == [] and ranks[0]["hashes"] == ranks[1]["hashes"]
    assert all(0 < s < 0.5 for s in ranks[0]["signals"][0])  # measured, under budget
    # qWD's weights: the gap of the gathered weights to the master ones, recorded
    gaps = [r["weight_gap"] for r in ranks[0]["records"] if r is not None]
    assert gaps[0] == [0.0] * len(gaps[0])  # the first step: nothing gathered lossily yet
    assert all(0 < g < 0.05 for g in gaps[-1]), gaps  # int4 differences: a small gap


def test_ranks_with_different_guards_are_refused_on_every_rank():
    for message in spawn(guard_workers.differing_guards, 2, (), timeout=120):
        assert message is not None and "guard" in message, message


def test_weights_gathered_too_coarsely_are_promoted_and_a_resume_keeps_them():
    """``naive`` gathers the weights themselves in int4 (SDP4Bit's qW): their gap to the
    master weights is ~0.1, over the 0.05 budget in the samples of steps 1 and 2 (step 0
    gathered nothing yet), so dp.param goes to int8 at step 2 on both ranks — replicas
    identical throughout — and the gap falls under budget; the gradients' int4 stays
    (under 0.5). A run resumed at step 5 holds the same codecs and weights."""
    guard = {"max_rel_error": 0.5, "window": 2, "every": 1}
    a, b = spawn(guard_workers.guarded, 2, ("naive", guard, 8), timeout=300)
    assert a["hashes"] == b["hashes"] and a["events"] == b["events"]
    assert {(e["kind"], e["step"]) for e in a["events"]} == {("dp.param", 2)}, a["records"]
    assert all("int4" in e["from"] and "int8" in e["to"] and e["weight_gap"] > 0.05
               for e in a["events"])
    assert all(0 < gap < 0.05 for gap in a["records"][-1]["weight_gap"])
    resumed = spawn(guard_workers.guarded, 2, ("naive", guard, 8, 5), timeout=300)
    assert resumed[0]["hashes"] == a["hashes"] and resumed[0]["events"] == a["events"]


def _one_bucket_guard(policy, weights=False):
    from commpress.collectives import Topology
    from commpress.dp.bucket import DPBucket
    from commpress.dp.guard import GradGuard

    bucket = DPBucket(Policy.resolve(policy), Topology(1), weights=weights)
    return GradGuard(Guard(0.3, window=3), [bucket], "test", weights=weights), bucket


def test_codes_that_decode_non_finite_from_finite_input_promote_at_once_ef_or_not():
    """What a watch sums for each case (as the encode measures it): codes decoded to inf
    from a finite gradient promote at the first sample — with error feedback too, whose
    memory stays finite while what it sent (decoded + memory) is not — and a gradient
    that was non-finite already decides nothing; weights gathered non-finite from finite
    masters promote dp.param at once."""
    import torch

    x = torch.ones(256)
    bad = torch.full((256,), math.inf)
    for policy, memory in [(INT2, None),
                           ({"dp": {"grad": {"codec": "int2", "error_feedback": True}}},
                            torch.zeros(256))]:
        guard, bucket = _one_bucket_guard(policy)
        if memory is None:
            guard.watches[0].add(x, bad)
        else:
            guard.watches[0].add(bad + memory, bad, memory, given=x)
        [event] = guard.decide(0, None)
        assert event["reason"] == "non-finite codes" and "int4" in event["to"], policy
        # a gradient that was non-finite already: no promotion, however long
        guard, bucket = _one_bucket_guard(policy)
        for step in range(5):
            if memory is None:
                guard.watches[0].add(bad, bad)
            else:
                guard.watches[0].add(bad + memory, bad, memory, given=bad)
            assert guard.decide(step, None) == []
        # ... and reads NaN, never a finite number
        assert all(math.isnan(r["rel_error"][0]) or math.isnan(r["memory_ratio"][0])
                   for r in guard.take_records())
    guard, bucket = _one_bucket_guard("naive", weights=True)
    guard.watches[0].add(x, x)
    [event] = guard.decide(0, None, weights=[torch.tensor([math.inf, 4.0], dtype=torch.float64)])
    assert event["kind"] == "dp.param" and event["reason"] == "non-finite codes"
    assert "int8" in event["to"] and "int4" in event["from"]
    assert guard.decide(1, None, weights=[torch.tensor([math.inf, math.inf],
                                                       dtype=torch.float64)]) == []


@pytest.mark.slow
def test_a_consolidated_state_carries_the_promotions_to_any_number_of_ranks():
    guard = {"max_rel_error": 0.3, "window": 2, "every": 1}
    a, b = spawn(guard_workers.consolidated, 2, (INT2, guard, 3), timeout=300)
    assert a["events"] and a["after"] == a["before"] == b["after"]
    assert all("int4" in codecs for codecs in a["after"])
