"""commpress inside DeepSpeed ZeRO-1/2, on real Gloo ranks, against the stock engine.

Each spawn of DeepSpeed ranks costs tens of seconds of imports, so one spawn of two
ranks runs every two-rank case (module fixture) and the tests read its results; a
second spawn runs two nodes of two ranks for the two-level paths.
"""

import pytest

import commpress
from commpress.launch import spawn
from tests.engines import deepspeed_workers as workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank

pytestmark = pytest.mark.engine

STEPS = 3
Z1_ACCUMULATE = dict(stage=1, accumulation=2, overlap=False, multi_rank=False)
CASES = [
    ("stock z2", {}, None),
    ("none z2", {}, "none"),
    ("stock z1", Z1_ACCUMULATE, None),
    ("none z1", Z1_ACCUMULATE, "none"),
    ("stock bf16 z2", {"bf16": True}, None),
    ("none bf16 z2", {"bf16": True}, "none"),
    ("zeropp z2", {}, "zeropp"),
    ("sdp4bit z1", Z1_ACCUMULATE, "sdp4bit"),
]


def bits(spec):
    """Bits per element on the wire of a codec, from its own wire size."""
    n = 1 << 16
    return 8 * commpress.codec(spec).wire_bytes(n) / n


def close(a, b, rel):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("deepspeed"))
    return spawn(workers.everything, 2, (CASES, directory, STEPS), timeout=900)


def test_codec_none_is_the_stock_engine_bit_for_bit(two_ranks):
    # ZeRO-2 with DeepSpeed's default all-reduce of buckets; ZeRO-1 with gradient
    # accumulation and one reduce per owner; bf16 ZeRO-2, whose reduced gradients also
    # go to an fp32 partition buffer: the same weights after every step
    for stage in ("z2", "z1", "bf16 z2"):
        for rank in two_ranks:
            stock, none = rank["cases"][f"stock {stage}"], rank["cases"][f"none {stage}"]
            assert none["hashes"] == stock["hashes"], stage
            assert none["losses"] == stock["losses"]


def test_compressed_runs_track_the_stock_engine_with_identical_replicas(two_ranks):
    cases = two_ranks[0]["cases"]
    # 4- and 8-bit gradients, 4-bit weight differences, 8-bit weights: within 2 % of the
    # loss along the way (measured: < 0.1 % over these steps)
    assert close(cases["zeropp z2"]["losses"], cases["stock z2"]["losses"], 0.02)
    assert close(cases["sdp4bit z1"]["losses"], cases["stock z1"]["losses"], 0.02)
    for name in ("zeropp z2", "sdp4bit z1"):
        assert two_ranks[0]["cases"][name]["hashes"] == two_ranks[1]["cases"][name]["hashes"]
        assert cases[name]["hashes"][-1] != cases[name.replace(name.split()[0], "stock")][
            "hashes"][-1]  # compression did change the bits


def test_each_rank_receives_only_its_partition(two_ranks):
    # a reduce-scatter moves each gradient element once: both ranks together send the
    # model once per reduction (DeepSpeed's default all-reduce sends it twice)
    for stage, reductions in (("z2", STEPS), ("z1", STEPS)):
        case = [r["cases"][f"none {stage}"] for r in two_ranks]
        numel = case[0]["numel"]
        assert sum(c["stats"]["dp.grad"]["elements"] for c in case) == numel * reductions
        # the weights: each rank sends its own partition once per step
        for c in case:
            assert c["stats"]["dp.param"]["elements"] == sum(c["partition"]) * STEPS


def test_bytes_per_label_are_the_policys_bits_per_element(two_ranks):
    def wire_bits(stats, label):
        return 8 * stats[label]["wire_bytes"] / stats[label]["elements"]

    exact = two_ranks[0]["cases"]["none z2"]["stats"]
    assert wire_bits(exact, "dp.grad") == 32 and wire_bits(exact, "dp.param") == 32
    exact_bf16 = two_ranks[0]["cases"]["none bf16 z2"]["stats"]
    assert wire_bits(exact_bf16, "dp.grad") == 16 and wire_bits(exact_bf16, "dp.param") == 16
    # one node: the two-level gradient policies use their intra-node codec
    zeropp = two_ranks[0]["cases"]["zeropp z2"]["stats"]
    assert wire_bits(zeropp, "dp.grad.intra") == bits("int4")
    assert wire_bits(zeropp, "dp.param") == bits("int8:group=4096")
    sdp4bit = two_ranks[0]["cases"]["sdp4bit z1"]["stats"]
    assert wire_bits(sdp4bit, "dp.grad.intra") == bits("int8:hadamard=128")
    assert wire_bits(sdp4bit, "dp.param") == bits("int4:group=2048")


def test_save_load_continue_equals_an_uninterrupted_run(two_ranks):
    for rank in two_ranks:
        resume = rank["resume"]
        assert resume["resumed"] == resume["uninterrupted"]
        # the codecs' state is what makes it so: residuals were there, and without them
        # the same checkpoint continues differently
        assert resume["residuals"] > 0
        assert resume["fresh codecs"][1] != resume["uninterrupted"][1]
        assert "commpress-rank" in resume["refused"] and "load_module_only" in resume[
            "refused"]
        assert "commpress-rank1.pt" in resume["truncated"]
        assert "is truncated or corrupted" in resume["truncated"]
        assert ("it holds commpress_rank00000.pt, the state of an older commpress"
                in resume["older"]), resume["older"]


def test_what_is_not_covered_is_refused_and_undo_restores_deepspeed(two_ranks):
    refusals = two_ranks[0]["refusals"]
    assert "stage=3" in refusals["stage 3"] and "commpress.fsdp" in refusals["stage 3"]
    assert "stage=0" in refusals["stage 0"]
    assert "reduce_scatter" in refusals["reduce_scatter false"]
    assert "ZeRO++" in refusals["ZeRO++ qgZ"] and "zero_quantized_gradients" in refusals[
        "ZeRO++ qgZ"]
    # bf16 weights, fp32 accumulation, ZeRO-1: DeepSpeed picks another optimizer
    assert "BF16_Optimizer" in refusals["bf16 stage 1"] and "ZeRO-2" in refusals["bf16 stage 1"]
    assert refusals["undo"] == {"patched": True, "gather restored": True,
                                "methods restored": True, "checkpoints restored": True}


def test_two_nodes_two_levels_for_gradients_and_weights():
    cases = [("stock", {}, None), ("sdp4bit", {}, "sdp4bit")]
    ranks = spawn(workers.runs, 4, (cases, 2), ranks_per_node=2, timeout=900)
    stock, sdp4bit = ranks[0]["stock"], ranks[0]["sdp4bit"]
    assert close(sdp4bit["losses"], stock["losses"], 0.02)
    assert len({r["sdp4bit"]["hashes"][-1] for r in ranks}) == 1
    stats = sdp4bit["stats"]

    def wire_bits(label):
        return 8 * stats[label]["wire_bytes"] / stats[label]["elements"]

    # TLq-HS: 8 bits inside the node, 4 across; qWD: 4-bit differences cross nodes once,
    # the node shares the weights exactly
    assert wire_bits("dp.grad.intra") == bits("int8:hadamard=128")
    assert wire_bits("dp.grad.inter") == bits("int4:hadamard=128")
    assert wire_bits("dp.param.inter") == bits("int4:group=2048")
    assert wire_bits("dp.param.intra") == 32
    # across nodes each rank sends about a quarter of the model per step (its node's
    # sums for the one rank of its local index on the other node), padded to groups
    assert stock["numel"] / 4 <= stats["dp.grad.inter"]["elements"] / 2 <= stock["numel"] / 3


def test_an_elastic_resume_on_another_data_parallel_size_starts_the_codecs_fresh(tmp_path):
    """4 ranks → 2 → 4 through DeepSpeed's universal checkpoints: the codec state of
    another size (4 → 2: commpress's files copied beside) or none at all (2 → 4) is refused
    unless ``compress(..., elastic=True)``; then the run continues exactly as one
    compressed only after DeepSpeed's load (fresh codecs, qWD references from the loaded
    weights), with identical replicas, said once on rank 0."""
    directory = str(tmp_path)
    spawn(workers.elastic, 4, (directory, None, "four", 0, False), timeout=600)
    two = spawn(workers.elastic, 2, (directory, "four", "two", 2, True), timeout=600)
    four = spawn(workers.elastic, 4, (directory, "two", "again", 4, False), timeout=600)
    for ranks in (two, four):
        for r in ranks:
            assert r["loaded"] == ranks[0]["loaded"]
            assert r["elastic"] == r["control"] == ranks[0]["elastic"]
            assert "elastic=True" in r["strict"]
        assert all(r["logged"] == [] for r in ranks[1:])
    # 4 → 2: the files were written by the ranks of 4 (rank 0 reports for all)
    assert "was written by rank 0 of 4; this is rank 0 of 2" in two[0]["strict"]
    assert two[0]["logged"] == [
        "commpress.deepspeed: resuming state saved on 4 ranks on 2: error-feedback memory "
        "and rounding streams start fresh (they were laid out for the world that saved them)"]
    # 2 → 4: the universal checkpoint holds no commpress file
    assert "commpress-rank0.pt' is missing" in four[0]["strict"]
    assert len(four[0]["logged"]) == 1 and "no commpress state beside" in four[0]["logged"][0]


def test_one_rank_compressing_and_the_other_not_is_named_within_the_timeout():
    """The stock rank goes on to DeepSpeed's own all-reduce on the data-parallel group,
    which commpress's apply-time header exchange used to meet: both ranks hung past 200 s
    (DeepSpeed's cloned group waits 30 minutes). The compressing rank now names the other
    within the launch timeout; the other fails as it leaves."""
    ranks = spawn(workers.one_rank_compresses, 2, (), pg_timeout_s=10, timeout=300)
    assert "CollectiveTimeoutError: commpress.deepspeed.compress" in ranks[0]["error"]
    assert "ranks [1] never reached it" in ranks[0]["error"]
    assert ranks[1]["error"] is not None
    assert all(r["seconds"] < 60 for r in ranks)


def test_a_rank_killed_mid_step_is_named_by_the_survivor():
    ranks = spawn(workers.killed_mid_step, 2, (1,), pg_timeout_s=15, timeout=300,
                  allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=1, timeout_s=15)


# every ep rule exact: the adapter's exchanges are in place, sending tokens as they are
EP_EXACT = {"name": "ep-exact", "ep": {k: "none" for k in
                                       ("dispatch", "combine", "dispatch_grad", "combine_grad")}}


@pytest.fixture(scope="module")
def moe_ranks():
    cases = [("stock", None), ("none", "none"), ("ep exact", EP_EXACT), ("hybrid", "hybrid")]
    return spawn(workers.moe_runs, 4, (cases, STEPS, 2), timeout=900)


def test_mixture_of_experts_tokens_and_expert_gradients(moe_ranks):
    """DeepSpeed's MoE, 4 experts over ep 2 on 4 ranks (experts replicated over ranks 0, 2
    and 1, 3): exact ep rules exchange tokens bit for bit as DeepSpeed's all-to-all does;
    hybrid sends int8 tokens and compresses the experts' gradients over their
    expert-data-parallel group, tracks stock, and keeps every replica identical."""
    for rank in moe_ranks:
        # the exchanges in place with exact codecs: the same bits as without them
        assert rank["ep exact"]["hashes"] == rank["none"]["hashes"]
        # over 4 ranks commpress sums in rank order, DeepSpeed's all-reduce in its ring's:
        # the same values up to fp32 rounding (2 ranks: the same bits, tested above)
        assert close(rank["none"]["losses"], rank["stock"]["losses"], 1e-5)
    hybrid = [rank["hybrid"] for rank in moe_ranks]
    assert close(hybrid[0]["losses"], moe_ranks[0]["stock"]["losses"], 0.02)
    assert hybrid[0]["hashes"][-1] != moe_ranks[0]["stock"]["hashes"][-1]
    assert len({r["dense"] for r in hybrid}) == 1
    assert hybrid[0]["experts"] == hybrid[2]["experts"] != hybrid[1]["experts"]
    assert hybrid[1]["experts"] == hybrid[3]["experts"]
    stats = hybrid[0]["stats"]
    for kind in ("dispatch", "combine", "dispatch_grad", "combine_grad"):
        assert stats[f"ep.{kind}"]["wire_bytes"] < stats[f"ep.{kind}"]["raw_bytes"] / 1.8
    assert "ep.dispatch" not in moe_ranks[0]["ep exact"]["stats"] or (
        moe_ranks[0]["ep exact"]["stats"]["ep.dispatch"]["wire_bytes"]
        == moe_ranks[0]["ep exact"]["stats"]["ep.dispatch"]["raw_bytes"])
