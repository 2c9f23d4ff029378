"""The cost model's byte formulas against hand-computed cases."""

import os

import pytest

import commpress
from commpress import Policy
from commpress.frontends.diloco import outer_policy
from commpress.plan import cost
from commpress.plan.cost import (
    ClusterSpec,
    JobSpec,
    all_to_all,
    compressed_all_reduce,
    plan,
    plan_policy,
    ring,
    wire_bytes,
)
from commpress.plan.models import MODELS, ModelShape, model_from_arg

# 2 nodes × 4 GPUs; 1 GB/s per node and per GPU so that seconds = GB
C = ClusterSpec(gpus=8, gpus_per_node=4, intra_GBps=1.0, inter_GBps=1.0, tflops=1.0, mfu=1.0,
                intra_latency_us=0.0, inter_latency_us=0.0)


def test_all_to_all_bytes():
    # 8 ranks, 4 per node, 100-byte chunks: 3 intra peers, 4 remote peers
    t = all_to_all(8, 4, 100.0, 4)
    assert t.intra_bytes == 300 and t.intra_msgs == 3
    assert t.inter_bytes == 4 * 4 * 100  # 4 GPUs of the node, 4 remote chunks each
    assert t.inter_msgs == 4


def test_ring_bytes():
    # one node: 7 steps of the chunk through NVLink
    t = ring(4, 4, 10.0, 4)
    assert (t.intra_bytes, t.inter_bytes, t.intra_msgs) == (30, 0, 3)
    # 8 ranks over 2 nodes, 4 per node: one ring per node leaves it, 7 chunks through it
    t = ring(8, 4, 10.0, 4)
    assert t.inter_bytes == 1 * 7 * 10 and t.intra_bytes == 70
    # one DP rank per node (tp·pp fills the node): 4 rings leave each node
    t = ring(2, 1, 10.0, 4)
    assert t.inter_bytes == 4 * 1 * 10 and t.intra_bytes == 0
    # all-reduce = two passes
    assert ring(4, 4, 10.0, 4, passes=2).intra_bytes == 60


def test_wire_bytes_of_codecs():
    assert wire_bytes("none", 1000, 4) == 4000
    assert wire_bytes("int4", 128 * 10, 4) == 128 * 10 * 4.25 / 8
    assert wire_bytes("int8", 1280, 2) == 1280 + 40
    assert wire_bytes("bf16", 1000, 4) == 2000
    assert wire_bytes("zfp:rate=8", 1000, 4) == 1000  # nominal rate: 8 bits per value


TINY = ModelShape(layers=2, hidden=64, heads=4, vocab=0, params_override=8 * 1024 * 1024)


def test_dp_only_none_and_sdp4bit_step_terms():
    job = JobSpec(model=TINY, dp=8, global_batch=8, seq=1, micro_batch=1)
    none = plan_policy(C, job, Policy.preset("none"))["breakdown"]
    shard = TINY.params / 8
    # fp32 ring reduce-scatter, 2 nodes × 4: node NIC carries 7 chunks of shard · 4 bytes
    assert none["dp_grad_s"] == pytest.approx(7 * shard * 4 / 1e9)
    # bf16 ring all-gather: the same with 2 bytes
    assert none["dp_param_s"] == pytest.approx(7 * shard * 2 / 1e9)
    assert none["compute_s"] == pytest.approx(6 * TINY.params * 8 / 8 / 1e12)
    sdp = plan_policy(C, job, Policy.preset("sdp4bit"))["breakdown"]
    # TLq-HS: intra a2a of 3 messages of 2 chunks at 8.25 bits, then inter a2a where
    # the node's 4 GPUs each send 1 chunk at 4.25 bits: max(intra, inter) per stage
    t1 = 3 * 2 * shard * 8.25 / 8 / 1e9
    t2 = 4 * 1 * shard * 4.25 / 8 / 1e9
    assert sdp["dp_grad_s"] == pytest.approx(t1 + t2)
    # qWD all-gather, two levels: each of the node's 4 GPUs sends its 4-bit shard (one
    # fp32 scale per 2048) to its peer on the other node, then the node shares the
    # updated bf16 weights: 3 steps of 2 shards · 2 bytes over NVLink
    inter = 4 * shard * (4 + 32 / 2048) / 8 / 1e9
    intra = 3 * 2 * shard * 2 / 1e9
    assert sdp["dp_param_s"] == pytest.approx(inter + intra)


def test_compressed_all_reduce_bytes():
    # two ranks on two nodes exchange their codes once
    t = compressed_all_reduce(2, 1, "int4", 1280, 4)
    assert t.inter_bytes == 4 * 1280 * 4.25 / 8 and t.inter_msgs == 1
    # four ranks, two per node: all-to-all of numel/4 chunks, then a ring of them
    w = 1280 * 4.25 / 8
    t = compressed_all_reduce(4, 2, "int4", 4 * 1280, 2)
    assert t.intra_bytes == 1 * w + 3 * w
    assert t.inter_bytes == 2 * 2 * w + 1 * 3 * w


def test_ddp_gradient_all_reduce():
    job = JobSpec(model=TINY, dp=8, zero_stage=0, global_batch=8, seq=1, micro_batch=1)
    P = TINY.params
    none = plan_policy(C, job, Policy.preset("none"))["breakdown"]
    # ring all-reduce: two passes of 7 chunks of P/8 fp32 through the node's NIC
    assert none["dp_grad_s"] == pytest.approx(2 * 7 * P / 8 * 4 / 1e9)
    assert none["dp_param_s"] == 0.0  # DDP never gathers weights
    low = plan_policy(C, job, Policy.preset("int2ef"))["breakdown"]
    chunk = P / 4  # the node's sum, one chunk per local rank
    exact_intra = 3 * chunk * 4 / 1e9  # all-to-all in, all-gather out: 3 chunks each
    # two nodes: each GPU exchanges its chunk's ternary codes (five per byte, fp16
    # scales: 1.75 bits) with its peer once
    across = 4 * chunk * 1.75 / 8 / 1e9
    assert low["dp_grad_s"] == pytest.approx(exact_intra + across + exact_intra)
    # break-even: bytes the node no longer sends / codec seconds; DDP gathers no weights
    sdp = plan_policy(C, job, Policy.preset("sdp4bit"))["break_even_inter_GBps"]
    assert list(sdp) == ["dp.grad=int4:hadamard=128"] and sdp["dp.grad=int4:hadamard=128"] > 0


def test_overlap_hides_gradients_not_weights_and_link_efficiency():
    job = JobSpec(model=TINY, dp=8, global_batch=8, seq=1, micro_batch=1)
    slow = JobSpec(model=TINY, dp=8, global_batch=8 * 1024, seq=1, micro_batch=1024,
                   overlap="dp")
    exposed = plan_policy(C, job, Policy.preset("none"))["breakdown"]
    assert exposed["dp_exposed_s"] == pytest.approx(exposed["dp_grad_s"] + exposed["dp_param_s"])
    hid = plan_policy(C, slow, Policy.preset("none"))["breakdown"]
    # backward (⅔ of a long compute) swallows the gradient reduction, not the all-gather
    assert hid["compute_s"] * 2 / 3 > hid["dp_grad_s"]
    assert hid["dp_exposed_s"] == pytest.approx(hid["dp_param_s"])
    # 94 % of the link carries payload: inter-node time grows by 1 / 0.94
    c94 = ClusterSpec(gpus=8, gpus_per_node=4, intra_GBps=1e9, inter_GBps=1.0, tflops=1.0,
                      mfu=1.0, intra_latency_us=0.0, inter_latency_us=0.0,
                      link_efficiency=0.94)
    c100 = ClusterSpec(gpus=8, gpus_per_node=4, intra_GBps=1e9, inter_GBps=1.0, tflops=1.0,
                       mfu=1.0, intra_latency_us=0.0, inter_latency_us=0.0)
    t94 = plan_policy(c94, job, Policy.preset("none"))["breakdown"]["dp_grad_s"]
    t100 = plan_policy(c100, job, Policy.preset("none"))["breakdown"]["dp_grad_s"]
    assert t94 == pytest.approx(t100 / 0.94)


def test_tp_and_pp_terms():
    job = JobSpec(model=TINY, dp=2, tp=2, pp=2, global_batch=4, micro_batch=1, seq=16)
    r = plan_policy(C, job, Policy.preset("none"))["breakdown"]
    act = 1 * 16 * 64  # micro_batch · seq · hidden elements, bf16
    m = 2  # micro-batches per step
    # TP: ring all-reduce on 2 ranks = 2 passes of 1 chunk of act/2 · 2 bytes, 4 per layer
    per = 2 * (act / 2) * 2 / 1e9
    assert r["tp_s"] == pytest.approx(4 * m * (2 / 2) * per)
    # PP: tp·2 = 4 ≤ 4 GPUs per node, so stages share a node: (m + pp − 2) per direction
    assert r["pp_s"] == pytest.approx(2 * (m + 2 - 2) * act * 2 / 1e9)


def test_pipeline_stages_across_node_boundaries():
    # 16 GPUs as tp2 × pp4 × dp2: a 4-GPU node holds 2 stages, so stage 1 → 2 crosses
    # nodes (one of three boundaries); on 8-GPU nodes the whole pipeline fits in a node
    job = JobSpec(model=TINY, dp=2, tp=2, pp=4, global_batch=8, micro_batch=1, seq=16)
    act_bytes = 1 * 16 * 64 * 2
    m = job.micro_batches
    slow = ClusterSpec(gpus=16, gpus_per_node=4, intra_GBps=1e6, inter_GBps=1.0, tflops=1.0,
                       mfu=1.0, intra_latency_us=0.0, inter_latency_us=0.0)
    r = plan_policy(slow, job, Policy.preset("none"))["breakdown"]
    # per direction: the crossing boundary's transfer m − 1 + 1 times, 2 GPUs (tp) sharing
    # the node's link; the two boundaries inside nodes are free at this intra bandwidth
    assert r["pp_s"] == pytest.approx(2 * m * 2 * act_bytes / 1e9, rel=1e-3)
    fits = ClusterSpec(gpus=16, gpus_per_node=8, intra_GBps=1e6, inter_GBps=1.0, tflops=1.0,
                       mfu=1.0, intra_latency_us=0.0, inter_latency_us=0.0)
    assert plan_policy(fits, job, Policy.preset("none"))["breakdown"]["pp_s"] < 1e-6


def test_plan_output_shape_and_speedups():
    c = ClusterSpec(gpus=64, gpus_per_node=4, intra_GBps=300, inter_GBps=12.5, tflops=312)
    job = JobSpec(model=MODELS["gpt-6.7b"], dp=64, global_batch=256)
    out = plan(c, job, ["sdp4bit", "zeropp"])
    assert set(out["policies"]) == {"none", "sdp4bit", "zeropp"}
    assert out["policies"]["none"]["speedup_vs_none"] == 1.0
    assert out["policies"]["sdp4bit"]["speedup_vs_none"] > 1.2
    for r in out["policies"].values():
        assert set(r) >= {"step_time_s", "tflops_per_gpu", "tokens_per_s", "speedup_vs_none",
                          "breakdown"}
    # a faster network shrinks what compression buys
    fast = ClusterSpec(gpus=64, gpus_per_node=4, intra_GBps=300, inter_GBps=400, tflops=312)
    fast_out = plan(fast, job, ["sdp4bit"])
    assert (fast_out["policies"]["sdp4bit"]["speedup_vs_none"]
            < out["policies"]["sdp4bit"]["speedup_vs_none"])


def test_bad_plan_inputs():
    with pytest.raises(ValueError, match="link_efficiency=1.5 is not allowed"):
        ClusterSpec(gpus=4, gpus_per_node=4, intra_GBps=1, inter_GBps=1, tflops=1,
                    link_efficiency=1.5)
    with pytest.raises(ValueError, match="must be a positive multiple of --gpus-per-node"):
        ClusterSpec(gpus=6, gpus_per_node=4, intra_GBps=1, inter_GBps=1, tflops=1)
    with pytest.raises(ValueError, match="must equal --gpus 8"):
        plan_policy(C, JobSpec(model=TINY, dp=4, global_batch=4), Policy.preset("none"))
    with pytest.raises(ValueError, match="is not a preset or a parameter count"):
        model_from_arg("gpt-huge")
    assert model_from_arg("1.3B").params == 1.3e9


def test_codec_throughput_of_another_device_is_refused(tmp_path):
    from commpress.plan.cost import load_codec_throughput

    path = tmp_path / "cpu.json"
    path.write_text('[{"codec": "int4", "device": "cpu", "encode_GBps": 7.0, '
                    '"decode_GBps": 6.0}]')
    assert load_codec_throughput(str(path), "cpu") == {"int4": (7.0, 6.0)}
    with pytest.raises(ValueError, match="was measured on cpu, but the plan is for --device gpu"):
        load_codec_throughput(str(path), "gpu")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        load_codec_throughput(str(path), "cpu")


def test_codec_throughput_that_is_a_fifo_is_refused_at_once(tmp_path):
    """A FIFO given as --codec-throughput would block in open(); it is refused instead."""
    fifo = tmp_path / "throughput.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="codec-throughput"):
        cost.load_codec_throughput(str(fifo), "gpu")


def test_diloco_utilization_bytes_and_the_delay_that_hides_a_sync():
    c = ClusterSpec(gpus=4, gpus_per_node=1, intra_GBps=300, inter_GBps=0.0125, tflops=312,
                    inter_latency_us=0)
    j = JobSpec(model=model_from_arg("gpt-1.3b"), dp=4, global_batch=64)
    exact = cost.plan_outer(c, j, outer_policy("diloco"), 32)
    # one rank per site: a ring all-reduce of the fp32 pseudo-gradient, 2 (S − 1) / S of it
    # per node, once every H steps
    p = j.model.params
    assert exact["inter_bytes_per_step_node"] == pytest.approx(2 * 3 / 4 * 4 * p / 32)
    coded = {name: cost.plan_outer(c, j, outer_policy(name), 32)
             for name in ("diloco-int4", "diloco-int2ef")}
    assert exact["utilization"] < coded["diloco-int4"]["utilization"] \
        < coded["diloco-int2ef"]["utilization"] < 1
    assert cost.plan_outer(c, j, outer_policy("diloco"), 128)["utilization"] \
        > exact["utilization"]
    streaming = cost.plan_outer(c, j, outer_policy("diloco-int2ef"), 32, fragments=4, delay=7)
    assert streaming["exposed_sync_s"] < coded["diloco-int2ef"]["exposed_sync_s"] / 4
    with pytest.raises(ValueError, match="at least 2 nodes"):
        cost.plan_outer(ClusterSpec(gpus=4, gpus_per_node=4, intra_GBps=300, inter_GBps=1,
                                    tflops=312), j, outer_policy("diloco"), 32)


def test_each_codec_names_the_kernel_family_its_throughput_is_measured_under():
    from commpress.plan.hardware import CODEC_GBps

    expected = {"int8": "int8", "int4": "int4", "int2": "int2", "int4:hadamard=128":
                "int_hadamard", "int2:packing=trits": "trits", "bf16": "cast", "fp16": "cast",
                "fp8": "fp8", "topk": "topk", "sign": "other", "nf2": "other"}
    for spec, kernel in expected.items():
        assert commpress.codec(spec).kernel == kernel, spec
        for device in ("gpu", "cpu"):
            assert kernel in CODEC_GBps[device], (device, kernel)


# a mixture of experts: 8 experts of width 2h, top-2
MOE = ModelShape(2, 64, 2, vocab=256, experts=8, top_k=2, expert_ffn_mult=2.0)


def test_a_mixture_of_experts_computes_with_its_active_weights():
    assert MOE.expert_params == 2 * 8 * 2 * 2 * 64 * 64
    assert MOE.params - MOE.active_params == pytest.approx(MOE.expert_params * 6 / 8)
    job = JobSpec(model=MOE, dp=8, global_batch=8, seq=1)
    got = plan_policy(C, job, Policy.preset("none"))["breakdown"]
    assert got["compute_s"] == pytest.approx(6 * MOE.active_params * 8 / 8 / 1e12)
    assert got["ep_s"] == 0  # ep 1: every expert on every rank, no all-to-all


def test_expert_parallel_all_to_alls_and_the_experts_gradients():
    """ep 8 over 2 nodes × 4: each rank sends seq · top_k · h / 8 elements to each of 7
    peers, 4 of them on the other node; the experts' gradients go nowhere (edp 1)."""
    seq = 16
    job = JobSpec(model=MOE, dp=8, global_batch=8, seq=seq, ep=8)
    chunk = seq * 2 * 64 / 8
    for name, bits in (("none", 16), ("ep-int8", None)):
        got = plan_policy(C, job, Policy.resolve(name))["breakdown"]
        per_kind = []
        for kind in ("dispatch", "combine", "dispatch_grad", "combine_grad"):
            codec = Policy.resolve(name).rule("ep", kind).codec
            b = chunk * bits / 8 if bits else wire_bytes(codec, chunk, 2)
            # intra: 3 peers' chunks per GPU; inter: the node's 4 GPUs × 4 peers each
            per_kind.append(max(3 * b, 4 * 4 * b) / 1e9)
        assert got["ep_s"] == pytest.approx(2 * sum(per_kind))  # 2 MoE layers
    # only the dense weights are reduced over dp; ep = dp leaves each expert one replica
    dense = JobSpec(model=MOE, dp=8, global_batch=8, seq=seq)
    assert (plan_policy(C, job, Policy.preset("none"))["breakdown"]["dp_grad_s"]
            == pytest.approx(plan_policy(C, dense, Policy.preset("none"))["breakdown"]
                             ["dp_grad_s"] * (MOE.params - MOE.expert_params) / MOE.params))


def test_ep_codecs_shorten_the_all_to_alls_by_their_bytes():
    job = JobSpec(model=MOE, dp=8, global_batch=8, seq=64, ep=8)
    none, int4 = (plan_policy(C, job, Policy.resolve(p))["breakdown"]["ep_s"]
                  for p in ("none", "ep-int4"))
    assert int4 / none == pytest.approx(wire_bytes("int4:hadamard=128", 1 << 20, 2)
                                        / (2 << 20), rel=1e-3)


@pytest.mark.parametrize(("model", "ep", "needle"), [
    (TINY, 2, "--ep 2 needs a mixture-of-experts model"),
    (MOE, 3, "--ep 3 must divide dp=8 and the model's 8 experts"),
    (ModelShape(2, 64, 2, experts=6, top_k=2, expert_ffn_mult=1.0), 4, "6 experts"),
])
def test_bad_expert_parallel_layouts_are_refused(model, ep, needle):
    with pytest.raises(ValueError, match=needle):
        JobSpec(model=model, dp=8, global_batch=8, ep=ep)
