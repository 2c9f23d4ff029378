"""commpress.megatron inside Megatron-core 0.16 on CPU/Gloo (4 ranks, a tiny bf16 GPT).

Three process groups, one per layout — dp4 (2 nodes × 2 ranks), dp2 × tp2 and
dp2 × pp2 — each training stock Megatron and then every policy for 10 steps on fresh
models with the same initial weights and batches. ``none`` must equal stock Megatron
bit for bit; ``sdp4bit`` and ``hybrid`` stay within 2 % of its loss; replicas stay
identical; every label carries the policy's bits per element and no covered dimension
is missing; a resumed run equals the uninterrupted one. Megatron needs a CPU shim,
which lives in the workers (test-only).
"""

import subprocess
import sys

import pytest

from commpress.launch import spawn
from tests.engines import megatron_workers as workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank

pytestmark = pytest.mark.engine

STEPS = 10
POLICIES = ("none", "sdp4bit", "hybrid")
# codec state that a resume must carry: error feedback, stochastic counters, qWD references
STATEFUL = {"name": "stateful",
            "dp": {"grad": {"codec": "int4:rounding=stochastic", "error_feedback": True},
                   "param": {"codec": "int4:group=2048,rounding=stochastic", "delta": True}},
            "tp": {"act": "int8:rounding=stochastic", "act_grad": "int8:rounding=stochastic"},
            "pp": {"act": "int8:rounding=stochastic",
                   "act_grad": {"codec": "int8", "error_feedback": True}}}


def _train_jobs(prefix: str, **layout) -> list:
    runs = [(f"{prefix}stock", None)] + [(f"{prefix}{p}", p) for p in POLICIES]
    return [(name, "train", dict(policy=policy, steps=STEPS, **layout)) for name, policy in runs]


@pytest.fixture(scope="module")
def dp4():
    # distributed optimizer with the weight all-gather overlapped with the next forward;
    # then plain DDP (gradient all-reduce); two nodes, so both levels of TLq-HS run
    jobs = (_train_jobs("", overlap_param_gather=True)
            + _train_jobs("ddp-", distopt=False)
            + [("refusals", "refusals", {}),
               ("scoped", "scoped", dict(steps=2, overlap_param_gather=True)),
               ("fp32_accumulation", "fp32_accumulation", {})])
    return spawn(workers.scenario, 4, (1, 1, jobs), ranks_per_node=2, timeout=900)


@pytest.fixture(scope="module")
def dp2_tp2():
    sequence_parallel = [j for j in _train_jobs("sp-", sequence_parallel=True)
                         if j[0] != "sp-sdp4bit"]
    jobs = (_train_jobs("") + sequence_parallel
            + [("resume", "resume", dict(policy=STATEFUL, steps=STEPS)),
               ("one_disagrees", "one_disagrees", {})])
    return spawn(workers.scenario, 4, (2, 1, jobs), ranks_per_node=2, timeout=900)


@pytest.fixture(scope="module")
def dp2_pp2():
    jobs = _train_jobs("") + [("resume", "resume", dict(policy=STATEFUL, steps=STEPS))]
    return spawn(workers.scenario, 4, (1, 2, jobs), ranks_per_node=2, timeout=900)


LAYOUTS = {"dp4": ["", "ddp-"], "dp2_tp2": ["", "sp-"], "dp2_pp2": [""]}


def _runs(request, layout):
    ranks = request.getfixturevalue(layout)
    return ranks, [p for p in LAYOUTS[layout]]


def _losses(record):
    return [loss for step in record for loss in step["losses"]]


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2", "dp2_pp2"])
def test_none_equals_stock_megatron_bit_for_bit(request, layout):
    ranks, prefixes = _runs(request, layout)
    for prefix in prefixes:
        if f"{prefix}none" not in ranks[0]:
            continue
        for rank in ranks:
            stock, none = rank[f"{prefix}stock"]["record"], rank[f"{prefix}none"]["record"]
            assert len(none) == STEPS
            assert [s["hash"] for s in none] == [s["hash"] for s in stock], (prefix, rank["coords"])
            assert _losses(none) == _losses(stock)


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2", "dp2_pp2"])
def test_compressed_policies_track_the_exact_loss(request, layout):
    # same weights and batches: within 2 % of stock Megatron at every micro-batch of all
    # 10 steps, and the model trained
    ranks, prefixes = _runs(request, layout)
    for prefix in prefixes:
        for rank in ranks:
            exact = _losses(rank[f"{prefix}stock"]["record"])
            if not exact:  # first pipeline stage: the loss lives on the last
                continue
            assert exact[-1] < exact[0] - 0.5
            for policy in ("sdp4bit", "hybrid"):
                if f"{prefix}{policy}" not in rank:
                    continue
                losses = _losses(rank[f"{prefix}{policy}"]["record"])
                gaps = [abs(a - b) / b for a, b in zip(losses, exact)]
                assert max(gaps) < 0.02, (prefix, policy, losses, exact)


def _groups(ranks, same):
    """Ranks grouped by the coordinates in ``same``."""
    out = {}
    for r in ranks:
        out.setdefault(tuple(r["coords"][k] for k in same), []).append(r)
    return out.values()


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2", "dp2_pp2"])
def test_replicas_stay_bitwise_identical(request, layout):
    ranks, prefixes = _runs(request, layout)
    for run in [k for k in ranks[0] if k not in ("coords", "refusals", "fp32_accumulation",
                                                 "resume", "scoped", "one_disagrees")]:
        # data-parallel replicas: every weight; TP peers: the weights both hold whole
        for same, key in ((("tp", "pp"), "hash"), (("dp", "pp"), "replicated")):
            for group in _groups(ranks, same):
                for step in range(STEPS):
                    assert len({r[run]["record"][step][key] for r in group}) == 1, \
                        (run, key, step)


def _bits(stats):
    # labels with no elements only timed a receive (a pipeline stage counts what it sends)
    return {label: 8 * s["wire_bytes"] / s["elements"] for label, s in stats.items()
            if s["elements"]}


QWD = 4 + 32 / 2048  # int4, group 2048, fp32 scales
INT8, INT4 = 8.25, 4.25  # group 128, fp32 scales
BF16 = 16.0
# Every label a run's traffic lands under, with its bits per element. A label missing
# means a covered dimension went unseen; one at 16 bits in a compressed policy means
# it went uncompressed.
EXPECTED = {
    # two nodes × two ranks: TLq-HS in two levels; weights cross nodes compressed
    ("dp4", "none"): {"dp.grad": BF16, "dp.param": BF16},
    ("dp4", "sdp4bit"): {"dp.grad.intra": INT8, "dp.grad.inter": INT4,
                         "dp.param.inter": QWD, "dp.param.intra": BF16},
    ("dp4", "hybrid"): {"dp.grad.intra": INT8, "dp.grad.inter": INT4,
                        "dp.param.inter": INT8, "dp.param.intra": BF16},
    ("dp4", "ddp-none"): {"dp.grad": BF16},
    ("dp4", "ddp-sdp4bit"): {"dp.grad.intra": INT8, "dp.grad.inter": INT4,
                             "dp.grad.gather.intra": BF16},
    ("dp4", "ddp-hybrid"): {"dp.grad.intra": INT8, "dp.grad.inter": INT4,
                            "dp.grad.gather.intra": BF16},
    # each data-parallel group has one rank per node: one level, across nodes
    ("dp2_tp2", "none"): {"dp.grad": BF16, "dp.param": BF16, "tp.act": BF16,
                          "tp.act_grad": BF16},
    ("dp2_tp2", "sdp4bit"): {"dp.grad.inter": INT4, "dp.param": QWD, "tp.act": BF16,
                             "tp.act_grad": BF16},
    ("dp2_tp2", "hybrid"): {"dp.grad.inter": INT4, "dp.param": INT8, "tp.act": INT8,
                            "tp.act_grad": INT8},
    ("dp2_tp2", "sp-none"): {"dp.grad": BF16, "dp.param": BF16, "tp.act": BF16,
                             "tp.act_grad": BF16},
    ("dp2_tp2", "sp-hybrid"): {"dp.grad.inter": INT4, "dp.param": INT8, "tp.act": INT8,
                               "tp.act_grad": INT8},
    # both data-parallel ranks share a node: one level, inside it
    ("dp2_pp2", "none"): {"dp.grad": BF16, "dp.param": BF16, "pp.act": BF16,
                          "pp.act_grad": BF16},
    ("dp2_pp2", "sdp4bit"): {"dp.grad.intra": INT8, "dp.param": QWD, "pp.act": BF16,
                             "pp.act_grad": BF16},
    ("dp2_pp2", "hybrid"): {"dp.grad.intra": INT8, "dp.param": INT8, "pp.act": INT8,
                            "pp.act_grad": INT8},
}


@pytest.mark.parametrize("layout, run", sorted(EXPECTED))
def test_every_label_sends_the_policys_bits(request, layout, run):
    ranks = request.getfixturevalue(layout)
    for rank in ranks:
        bits = _bits(rank[run]["stats"])
        expected = dict(EXPECTED[layout, run])
        if layout == "dp2_pp2":  # the first stage only sends activations, the last gradients
            expected.pop("pp.act_grad" if rank["coords"]["pp"] == 0 else "pp.act")
        assert bits == pytest.approx(expected), (run, rank["coords"])


@pytest.mark.parametrize("layout", ["dp2_tp2", "dp2_pp2"])
def test_resume_equals_the_uninterrupted_run(request, layout):
    ranks = request.getfixturevalue(layout)
    half = STEPS // 2
    for rank in ranks:
        r = rank["resume"]
        assert [s["hash"] for s in r["first"]] == [s["hash"] for s in r["whole"][:half]]
        assert [s["hash"] for s in r["resumed"]] == [s["hash"] for s in r["whole"][half:]]
        assert _losses(r["resumed"]) == _losses(r["whole"][half:])
    # the codec state matters: resumed without it, some rank's weights differ
    assert any([s["hash"] for s in rank["resume"]["without_codec_state"]]
               != [s["hash"] for s in rank["resume"]["whole"][half:]] for rank in ranks)


def test_remove_restores_megatrons_functions(dp4):
    for rank in dp4:
        out = rank["refusals"]
        assert out["installed"] and out["restored"]
        assert "already has a policy applied" in out["twice"]


def test_refusals_name_the_reason(dp4):
    out = dp4[0]["refusals"]
    assert "fp32 master weights" in out["fp32_qwd"] and "bf16" in out["fp32_qwd"]
    assert out["not_ddp"].startswith("TypeError") and "DistributedDataParallel" in out["not_ddp"]
    assert "unknown policy preset 'sdp5bit'" in out["bad_policy"]


def test_ranks_compressing_with_other_policies_are_named_at_compress_on_every_rank(dp4):
    # before any collective of its own (a replica check would otherwise wait for
    # Megatron's 30-minute group timeout and end in raw Gloo errors)
    for rank in dp4:
        error = rank["refusals"]["disagreeing"]
        assert error.startswith("CollectiveMismatchError") and "policy differs" in error


def test_one_rank_on_another_policy_is_told_to_every_rank_of_the_mesh(dp2_tp2):
    # dp 2 × tp 2: rank 3 shares no group with rank 0; it used to pass its own groups'
    # checks and wait for its peers, which had raised, until Megatron's group timeout
    for rank in dp2_tp2:
        error = rank["one_disagrees"]
        assert error is not None and error.startswith("CollectiveMismatchError"), error
        assert "policy differs" in error or "other_groups_of_the_mesh differs" in error


def test_a_rank_that_never_compresses_is_named_within_the_groups_timeout():
    # Megatron's groups wait 30 minutes by default: its own timeout, set short here, is
    # the one commpress's agreement honours
    ranks = spawn(workers.compress_on_rank_0_only, 2, (10,), pg_timeout_s=120, timeout=300)
    error, seconds = ranks[0]
    assert error.startswith("CollectiveTimeoutError") and "ranks [1] never reached it" in error
    assert seconds < 10 + 20, seconds


def test_configurations_that_would_pass_uncompressed_are_refused(dp4):
    out = dp4[0]["refusals"]
    assert "num_distributed_optimizer_instances=2" in out["instances"]
    assert "reduce_scatter_with_fp32_accumulation=True" in out["fp32_accumulation"]
    assert "moe_token_dispatcher_type='allgather'" in out["moe"]
    assert "not built for this model" in out["other_optimizer"]


def test_a_model_without_a_policy_keeps_stock_megatron(dp4):
    # trained while another model's policy is installed: the same bits as stock, and
    # nothing of it is counted by commpress
    for rank in dp4:
        scoped, stock = rank["scoped"], rank["stock"]["record"]
        assert [s["hash"] for s in scoped["record"]] == [s["hash"] for s in stock[:2]]
        assert not any(s["elements"] for s in scoped["stats"].values())


def test_a_later_fp32_accumulation_swap_is_refused_at_the_next_sync(dp4):
    for rank in dp4:
        assert "reduce_scatter_with_fp32_accumulation" in rank["fp32_accumulation"]
        assert "dist_reduce_scatter_func" in rank["fp32_accumulation"]


def test_importing_commpress_does_not_import_megatron():
    code = ("import sys, commpress; assert 'megatron' not in sys.modules; "
            "assert callable(commpress.megatron.compress); assert 'megatron.core' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("rows, unit", [(1, 8), (2, 128), (4, 16)])
def test_wire_layout_round_trips_and_never_mixes_kinds_in_a_group(rows, unit):
    import torch

    from commpress.engines.megatron.layout import Layout

    g = torch.Generator().manual_seed(rows * unit)
    numel = rows * 300
    identical = torch.rand(numel, generator=g) < 0.3
    values = torch.randn(numel, generator=g)
    layout = Layout(identical, rows, unit)
    wire = layout.to_wire(values)  # (rows, width)
    assert wire.shape == (rows, layout.width) and layout.width % unit == 0
    kind = layout.to_wire(identical.float() + 1)  # 2: identical, 1: other, 0: padding
    for group in kind.view(rows, -1, unit).reshape(-1, unit):
        assert len(set(group[group > 0].tolist())) <= 1  # one kind per group, pads aside
    out = torch.empty_like(values)
    layout.from_wire(wire, out)
    assert torch.equal(out, values)
    for r in range(rows):
        assert torch.equal(layout.row_to_wire(values.view(rows, -1)[r], r), wire[r])
        row = torch.empty(numel // rows)
        layout.row_from_wire(wire[r], r, row)
        assert torch.equal(row, values.view(rows, -1)[r])


def test_an_elastic_resume_on_another_number_of_ranks_starts_the_codecs_fresh(tmp_path):
    """4 ranks → 2 → 4 (data-parallel sizes 4, 2, 4): the codec state of another world is
    refused unless ``load_state_dict(state, elastic=True)``; then the run continues exactly
    as one applied with no codec state (fresh codecs; qWD references follow the loaded
    weights), replicas identical, said once on rank 0."""
    def run(world, load_tag, save_tag, start):
        job = ("elastic", "elastic", dict(policy=STATEFUL, directory=str(tmp_path),
                                          load_tag=load_tag, save_tag=save_tag, start=start))
        ranks = [r["elastic"] for r in spawn(workers.scenario, world, (1, 1, [job]),
                                             ranks_per_node=2, timeout=900)]
        for r in ranks:  # the steps' losses and weights, not their times
            for run_ in ("elastic", "control"):
                r[run_] = [(s["losses"], s["hash"]) for s in r.get(run_, [])]
        return ranks

    run(4, None, "four", 0)
    for ranks, saved, world in ((run(2, "four", "two", 2), 4, 2),
                                (run(4, "two", "again", 4), 2, 4)):
        for r in ranks:
            assert f"world_size {saved} does not match this run's {world}" in r["strict"]
            assert "elastic=True" in r["strict"]
            assert r["elastic"] == r["control"]
            assert [h for _, h in r["elastic"]] == [h for _, h in ranks[0]["elastic"]]
        assert ranks[0]["logged"] == [
            f"commpress Megatron codec: resuming state saved on {saved} ranks on {world}: "
            "error-feedback memory and rounding streams start fresh (they were laid out for "
            "the world that saved them)"]
        assert all(r["logged"] == [] for r in ranks[1:])


def test_a_rank_killed_mid_step_is_named_by_the_survivor():
    ranks = spawn(workers.killed_mid_step, 2, (1,), pg_timeout_s=15, timeout=300,
                  allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=15)


def test_mixture_of_experts_over_expert_parallelism():
    """A GPT with MoE layers (4 experts, top-2, Megatron's all-to-all dispatcher) on 4 ranks
    with EP 2: the tokens go through ``ep``, the experts' gradients through ``dp.grad`` over
    their own data-parallel group (ranks 0, 2 and 1, 3 hold the same experts)."""
    jobs = [(name, "train", {"policy": policy, "steps": 3, "experts": 4})
            for name, policy in (("stock", None), ("none", "none"), ("ep-int8", "ep-int8"),
                                 ("hybrid", "hybrid"))]
    ranks = spawn(workers.scenario, 4, (1, 1, jobs, 2), ranks_per_node=2, timeout=900)
    for r in ranks:
        stock, none = r["stock"]["record"], r["none"]["record"]
        assert [s["losses"] for s in none] == [s["losses"] for s in stock]
        assert [s["hash"] for s in none] == [s["hash"] for s in stock]
        for name in ("ep-int8", "hybrid"):
            stats = r[name]["stats"]
            assert {k: v["calls"] for k, v in stats.items() if k.startswith("ep.")} == (
                dict.fromkeys(["ep.dispatch", "ep.combine", "ep.dispatch_grad",
                               "ep.combine_grad"], 2 * 3)), stats  # MoE layers × steps
            for got, want in zip(r[name]["record"], stock):
                for a, b in zip(got["losses"], want["losses"]):
                    assert abs(a - b) < 0.02 * abs(b), (name, got["losses"], want["losses"])
        # the experts' buckets are covered too (dp.grad over their own group)
        assert any(".expert_buffer" in k for k in r["hybrid"]["buckets"]), r["hybrid"]["buckets"]
    # the ranks that hold the same experts hold the same weights, bit for bit
    for name in ("ep-int8", "hybrid"):
        hashes = [r[name]["record"][-1]["hash"] for r in ranks]
        assert hashes[0] == hashes[2] and hashes[1] == hashes[3], (name, hashes)
