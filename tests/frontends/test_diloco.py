"""DiLoCo's outer synchronization on real Gloo ranks: each rank a site (or two ranks a
site), its own batches, different initial weights; gpt-tiny, AdamW inside."""

import numpy as np
import pytest

from commpress.frontends.diloco import DiLoCoConfig, outer_policy, outer_step
from commpress.launch import spawn
from commpress.validate import InputError
from tests.frontends import diloco_workers
from tests.frontends.diloco_workers import H

PG_TIMEOUT_S = 30.0
PRESETS = ["diloco", "diloco-int8", "diloco-int4", "diloco-int2ef", "diloco-sparse"]


def _spawn(fn, *args, world=2, ranks_per_node=1):
    return spawn(fn, world, args, ranks_per_node=ranks_per_node, pg_timeout_s=PG_TIMEOUT_S,
                 timeout=300)


def _assert_synced(ranks, name, steps, alpha_zero=True):
    for step in range(steps):
        records = [r[name]["steps"][step] for r in ranks]
        assert len({s["global"] for s in records}) == 1, (name, step)  # θ_global: bitwise
        if alpha_zero and (step + 1) % H == 0:  # just synced: the local weights too
            assert len({s["local"] for s in records}) == 1, (name, step)


def test_every_outer_codec_keeps_global_weights_bitwise_identical_and_trains():
    steps = 3 * H
    ranks = _spawn(diloco_workers.train, [(p, {"policy": p}) for p in PRESETS], steps)
    for name in PRESETS:
        _assert_synced(ranks, name, steps)
        record = ranks[0][name]["steps"]
        assert record[-1]["syncs"] == steps // H and record[-1]["skipped"] == 0
        assert record[-1]["loss"] < record[0]["loss"] - 0.3, (name, record)
        # each preset's own outer step (top-k's error feedback is its momentum)
        assert ranks[0][name]["outer step"] == ((1.0, 0.0) if name == "diloco-sparse"
                                                 else (0.7, 0.9)), name
    # bits per element between sites, as OUTER_PRESETS states them
    for name, bits in (("diloco-int8", 8.25), ("diloco-int4", 4.25), ("diloco-int2ef", 1.8),
                       ("diloco-sparse", 0.25)):
        stats = ranks[0][name]["stats"]
        inter = {k: s for k, s in stats.items() if k.startswith("outer.grad")}
        sent = sum(s["wire_bytes"] for s in inter.values())
        elements = sum(s["elements"] for s in inter.values())
        assert 8 * sent / elements <= bits, (name, inter)


def test_two_sites_of_two_ranks_exact_inside_coded_between():
    steps = 2 * H
    runs = [("int2ef", {"policy": "diloco-int2ef", "ranks_per_site": 2})]
    ranks = _spawn(diloco_workers.train, runs, steps, world=4, ranks_per_node=2)
    _assert_synced(ranks, "int2ef", steps)
    labels = set(ranks[0]["int2ef"]["stats"])
    assert any(k.endswith(".intra") for k in labels) and any(k.endswith(".inter")
                                                            for k in labels), labels


@pytest.mark.parametrize("options", [
    {"fragments": 2, "delay": 1, "policy": "diloco-int4"},
    pytest.param({"fragments": 4, "delay": 0, "alpha": 0.5, "policy": "diloco-int2ef"},
                 marks=pytest.mark.slow)])
def test_streaming_fragments_with_delay_stay_identical_and_train(options):
    steps = 3 * H
    ranks = _spawn(diloco_workers.train, [("streaming", options)], steps)
    _assert_synced(ranks, "streaming", steps, alpha_zero=False)
    record = ranks[0]["streaming"]["steps"]
    # a fragment every H / fragments steps, each applied `delay` steps after it started
    started = (steps - options["delay"]) // (H // options["fragments"])
    assert record[-1]["syncs"] == started
    assert record[-1]["loss"] < record[0]["loss"] - 0.3


def test_one_step_exact_diloco_is_sgd_on_the_averaged_gradient():
    steps = 3
    ranks = _spawn(diloco_workers.averaged_sgd, steps)
    single = diloco_workers.single_process_sgd(steps, 2)
    for step in range(steps):
        assert np.array_equal(ranks[0][step], ranks[1][step])
        np.testing.assert_allclose(ranks[0][step], single[step], rtol=0, atol=2e-6)


@pytest.mark.parametrize("options, split", [
    ({"policy": "diloco-int2ef", "fragments": 2, "delay": 1}, H + 2),  # a fragment in flight
    pytest.param({"policy": "diloco-sparse"}, H + 1, marks=pytest.mark.slow)])
def test_resume_is_bitwise_the_uninterrupted_run_and_another_schedule_is_refused(options,
                                                                                 split):
    ranks = _spawn(diloco_workers.resume, options, 3 * H, split)
    for r in ranks:
        assert r["resumed"] == r["straight"]
        assert "DiLoCo checkpoint config.sync_every 4 does not match this run's 8" in r["refused"]
    if options.get("delay"):
        assert ranks[0]["pending"] == 1


def test_disagreeing_sites_are_refused_and_a_nan_site_skips_the_outer_step_everywhere():
    ranks = _spawn(diloco_workers.faults)
    for r in ranks:
        assert "config differs" in r["disagree"], r["disagree"]
        assert "policy differs" in r["codec options"] and "chunktopk:k=32" in r["codec options"]
        record = r["nan"]
        # the first sync saw rank 1's NaN: skipped on every rank, the sites restart from
        # θ_global and the next syncs apply
        assert [s["skipped"] for s in record[H - 2:H]] == [0, 1]
        assert record[-1]["syncs"] == 3 and record[-1]["skipped"] == 1
        assert r["finite"]
    for step in range(3 * H):
        assert ranks[0]["nan"][step]["global"] == ranks[1]["nan"][step]["global"]


@pytest.mark.parametrize("field, value, needle", [
    ("sync_every", 0, "sync_every=0 is not allowed"),
    ("fragments", 3, "allowed: a divisor of sync_every"),
    ("fragments", 64, "fragments=64 is not allowed"),
    ("delay", 32, "delay=32 is not allowed; allowed: an integer in [0, 31]"),
    ("outer_lr", float("nan"), "outer_lr=nan is not allowed"),
    ("outer_momentum", 1.0, "outer_momentum=1.0 is not allowed"),
    ("alpha", 2, "alpha=2 is not allowed"),
    ("nesterov", "yes", "nesterov='yes' is not allowed"),
])
def test_bad_options_name_the_field_value_and_allowed(field, value, needle):
    with pytest.raises(InputError, match=None) as e:
        DiLoCoConfig(**{field: value})
    assert needle in str(e.value)


def test_presets_and_policies():
    assert outer_policy("diloco").rule("outer", "grad").exact
    assert outer_policy("diloco-int2ef").rule("outer", "grad", "inter").error_feedback
    mine = outer_policy({"name": "mine", "outer": {"grad": "int4"}})
    assert mine.rule("outer", "grad").codec == "int4"
    with pytest.raises(InputError, match="allowed: diloco, diloco-int8"):
        outer_policy("diloco-int3")


def test_each_preset_has_its_outer_step_and_an_explicit_one_wins():
    assert outer_step("diloco-int2ef") == (0.7, 0.9)
    assert outer_step("diloco-sparse") == (1.0, 0.0)  # error feedback is its momentum
    assert outer_step("diloco-sparse", 0.5) == (0.5, 0.0)
    assert outer_step("diloco-sparse", momentum=0.9) == (1.0, 0.9)
    assert outer_step({"name": "mine", "outer": {"grad": "topk:ratio=0.02"}}) == (0.7, 0.9)
    assert outer_step("none") == (0.7, 0.9)  # the trainer without --outer
    # the preset however it is spelled: its name, its Policy, its dict
    assert outer_step(outer_policy("diloco-sparse")) == (1.0, 0.0)
    assert outer_step(outer_policy("diloco-sparse").to_dict()) == (1.0, 0.0)


def test_inner_optimizers_with_master_weights_and_sharded_parameters_are_refused():
    import torch

    from commpress.frontends.parts.outer_sites import check_inner

    class MasterKeeping(torch.optim.SGD):  # as ShardedOptimizer: buckets and a policy
        buckets, policy = [], None

    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(InputError, match="fp32 master shards would undo every sync"):
        check_inner(params, MasterKeeping(params, lr=0.1))

    class FlatParameter(torch.nn.Parameter):
        pass

    with pytest.raises(InputError, match=r"sharded \(FlatParameter: FSDP\)"):
        check_inner([FlatParameter(torch.ones(2))], None)
    check_inner(params, torch.optim.SGD(params, lr=0.1))  # a plain optimizer is fine


@pytest.mark.parametrize("options", [
    {"fragments": 2, "delay": 0}, pytest.param({"fragments": 1}, marks=pytest.mark.slow),
    pytest.param({"fragments": 2, "delay": 1}, marks=pytest.mark.slow)])
def test_a_site_whose_weights_and_optimizer_went_nonfinite_recovers_and_it_is_said(options):
    # rank 1's NaN gradient poisons its AdamW moments, then every weight: the next sync
    # is skipped everywhere, the site restarts from θ_global with that state dropped, and
    # every later sync applies (before, with fragments, every later sync was skipped)
    steps, nan_step = 6 * H, H + 1
    ranks = _spawn(diloco_workers.nonfinite_site, {"policy": "diloco-int4", **options},
                   steps, nan_step)
    for step in range(steps):
        assert ranks[0]["steps"][step]["global"] == ranks[1]["steps"][step]["global"], step
    record = ranks[0]["steps"]
    assert 1 <= record[-1]["skipped"] <= 2, record[-1]
    assert record[3 * H]["skipped"] == record[-1]["skipped"]  # the last syncs all applied
    assert record[-1]["syncs"] > record[3 * H]["syncs"]
    for r in ranks:
        assert r["finite"]
    assert any("is not finite" in m and "skipped on every site" in m for m in ranks[0]["said"])
    said = " ".join(ranks[1]["said"])
    assert "this site's weights were non-finite" in said
    assert "inner optimizer's non-finite state" in said


@pytest.mark.parametrize("scenario", ["unfreeze", "freeze", "add"])
def test_the_synchronized_parameters_follow_the_model_on_every_site(scenario):
    steps, at = 4 * H, H + 1
    ranks = _spawn(diloco_workers.parameter_set_changes, scenario, steps, at)
    for step in range(steps):  # θ_global bitwise on every site, every step
        assert ranks[0]["steps"][step]["global"] == ranks[1]["steps"][step]["global"], step
    changed = [r["changed"] for r in ranks]
    # a fragment starts every H / 2 steps: the next start after the change takes it in
    first_sync = next(s for s in range(at + 1, steps) if (s + 1) % (H // 2) == 0)
    assert changed[0][first_sync] == changed[1][first_sync]  # the sites agree on it
    if scenario == "freeze":  # frozen: never moved again (no outer momentum on it)
        assert len({c for c in changed[0][first_sync:]}) == 1
    else:  # trained from then on: it moves, and every sync keeps the sites together
        assert changed[0][-1] != changed[0][first_sync]
    said = " ".join(ranks[0]["said"])
    assert "the trained parameters changed by inner step" in said
    assert ("1 left" if scenario == "freeze" else "1 joined") in said


def test_tensors_replaced_under_the_optimizer_are_refused_and_a_rebuilt_one_syncs():
    stale = _spawn(diloco_workers.replaced_tensors, False)
    for r in stale:
        assert "the inner optimizer steps" in r["error"], r
        assert "not parameters of the model" in r["error"] and "assign=True" in r["error"]
    rebuilt = _spawn(diloco_workers.replaced_tensors, True)
    assert rebuilt[0]["error"] is None and rebuilt[0]["syncs"] == 2
    assert rebuilt[0]["global"] == rebuilt[1]["global"]
    assert rebuilt[0]["local"] == rebuilt[1]["local"]  # the new tensors are the synced ones


@pytest.mark.parametrize("how", [pytest.param("per-rank", marks=pytest.mark.slow),
                                 "rank0-model", "rank0-all",
                                 pytest.param("rank0-elastic", marks=pytest.mark.slow)])
def test_a_checkpoint_of_rank_0_alone_is_refused_or_converted_as_asked(how, tmp_path):
    ranks = _spawn(diloco_workers.rank0_checkpoint, str(tmp_path), how)
    if how == "per-rank":  # each rank its own: bitwise the uninterrupted run
        for r in ranks:
            assert r["resumed"] == r["straight"]
    elif how == "rank0-model":  # told at the next sync, on every rank
        for r in ranks:
            assert "this site's model weights and inner optimizer state are not those" \
                in r["error"], r
            assert "save_rank_state" in r["error"]
    elif how == "rank0-all":  # rank 1 refuses rank 0's state, with the way out: everywhere
        for r in ranks:
            assert "DiLoCo checkpoint rank 0 does not match this run's 1" in r["error"], r
            assert "elastic=True" in r["error"] and "save_rank_state" in r["error"]
    else:  # asked for: every site restarts from θ_global, together
        for step in range(len(ranks[0]["resumed"])):
            assert ranks[0]["resumed"][step]["global"] == ranks[1]["resumed"][step]["global"]


@pytest.mark.parametrize("layout", ["world-ddp", "world-ddp-inner",
                                    pytest.param("site-ddp", marks=pytest.mark.slow)])
def test_ddp_across_sites_is_refused_or_said_and_ddp_inside_a_site_trains(layout):
    ranks = _spawn(diloco_workers.ddp_and_sites, layout, world=4, ranks_per_node=2)
    if layout == "world-ddp":
        for r in ranks:
            assert "model is a DistributedDataParallel over ranks [0, 1, 2, 3]" in r["error"]
            assert "spans sites [0, 1, 2, 3]" in r["error"]
        return
    assert all(r["error"] is None for r in ranks)
    assert len({r["global"] for r in ranks}) == 1
    said = " ".join(ranks[0]["said"])
    identical = "every site's local weights are identical at the first sync"
    assert (identical in said) == (layout == "world-ddp-inner"), said


def test_a_state_of_the_former_sparse_preset_is_refused_by_name_or_loaded_as_diloco_topk():
    from commpress.dp.saved_state import check_resume, envelope
    from commpress.frontends.diloco import STATE_FORMAT, _former_sparse
    from commpress.policy import Policy

    former = Policy.from_dict({**Policy.preset("diloco-topk").to_dict(),
                               "name": "diloco-sparse"})
    saved = envelope(STATE_FORMAT, former, 0, 2)
    now = Policy.preset("diloco-sparse")  # SparseLoCo's chunked top-k
    with pytest.raises(InputError, match="policy.outer.grad.inter .*topk:ratio=0.02.* does "
                       "not match this run.s .*chunktopk"):
        check_resume(_former_sparse(saved, now), STATE_FORMAT, "DiLoCo", now, 0, 2, False,
                     "advice")
    topk = Policy.preset("diloco-topk")  # the explicit name of the former codec
    assert check_resume(_former_sparse(saved, topk), STATE_FORMAT, "DiLoCo", topk, 0, 2,
                        False, "advice")


NAIVE_OUTER = {"name": "naive-outer", "outer": {"grad": "int2:hadamard=0"}}


def test_a_guarded_sync_promotes_each_fragment_on_every_site_alike():
    """Pseudo-gradients in int2 without Hadamard, 2 fragments, the all-reduce delayed one
    inner step (the decision runs on the communication thread): each fragment is promoted
    at its second sync (window 2), on both sites alike, and the sites keep identical
    θ_global; the decisions are recorded per fragment at the inner step that began them."""
    options = {"policy": NAIVE_OUTER, "fragments": 2, "delay": 1,
               "guard": {"max_rel_error": 0.2, "window": 2, "every": 2}}
    a, b = spawn(diloco_workers.guarded, 2, (options, 12), timeout=300)
    assert a["global"] == b["global"] and a["events"] == b["events"]
    assert [(e["bucket"], e["step"]) for e in a["events"]] == [(0, 6), (1, 8)], a["records"]
    assert all("int4" in e["to"] and e["rel_error"] > 0.2 for e in a["events"])
    assert all("int4" in c for c in a["codecs"])
    assert [(r["step"], r["buckets"]) for r in a["records"]][:4] == [
        (2, [0]), (4, [1]), (6, [0]), (8, [1])]
    assert len(a["said"]) == 2 and not b["said"]  # logged once, by rank 0


@pytest.mark.slow
def test_a_guarded_sync_resumes_with_its_promotions():
    options = {"policy": NAIVE_OUTER, "fragments": 2, "delay": 1,
               "guard": {"max_rel_error": 0.2, "window": 2, "every": 2}}
    ranks = spawn(diloco_workers.resume, 2, (options, 14, 9), timeout=300)
    for r in ranks:
        assert r["resumed"] == r["straight"]
