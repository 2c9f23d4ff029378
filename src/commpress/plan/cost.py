"""The cost model: bytes per link level and alpha-beta time of one training step.

Assumptions (also in BENCHMARKS.md and ``commpress plan --help``):

* Ranks are laid out as commpress lays them out: TP innermost, then PP, then DP;
  ``G`` GPUs per node. A DP group has ``n_local = G / (tp·pp)`` members per node
  (at least 1) and spans ``dp / n_local`` nodes.
* Every GPU of a node runs the same collective at the same time (all DP groups
  reduce together), so a node's NIC carries the sum of its GPUs' cross-node bytes:
  ``inter time = bytes per node / inter_bw`` (``inter_bw`` = the node's injection
  bandwidth, all NICs); ``intra time = bytes per GPU / intra_bw``. A stage of a
  collective takes ``max(intra, inter)`` plus one latency per message.
* Algorithms are the ones commpress runs: uncompressed (``none``) collectives are
  NCCL-style rings (with ``backend="gloo"`` the uncompressed reduce-scatter costs a
  ring all-reduce, two passes: what we measured on the testbed, where torch's Gloo
  reduce-scatter took as long as its all-reduce); compressed reduce-scatter is one
  all-to-all (every rank sends a
  chunk to every peer), compressed all-gather a ring of codes, the two-level
  reduce-scatter an intra-node all-to-all then an inter-node all-to-all, compressed
  all-reduce = all-to-all reduce-scatter + ring all-gather (two ranks: one exchange);
  with several nodes a compressed weight all-gather crosses nodes once (among ranks
  of the same local index) and is shared exactly inside the node; pipeline transfers
  are point-to-point.
* ``zero_stage=0`` is plain data parallelism (DDP): gradients are all-reduced, weights
  never gathered. Uncompressed: a ring all-reduce; with commpress's hook and a
  two-level policy: an exact all-to-all inside the node, a compressed all-reduce of
  the node's chunk across nodes, an exact all-gather inside the node.
* Compute = ``6·P·tokens`` (``8·P·tokens`` with activation recomputation) per step,
  spread over all GPUs at ``tflops · mfu``, stretched by the pipeline bubble
  ``(pp − 1) / micro_batches``.
* TP all-reduces (2 forward + 2 backward per layer and micro-batch) and pipeline
  transfers are on the critical path. DP traffic is exposed (``overlap=none``, as in
  the SDP4Bit measurements), or the gradient reduction is hidden behind the backward
  pass, ⅔ of compute (``overlap=dp``: DDP's buckets, ``ShardedOptimizer``'s buckets);
  the weight all-gather after the step stays exposed.
* A fraction ``link_efficiency`` of the node's link rate carries payload (1.0 by
  default; TCP/IP over Ethernet frames 1448 payload bytes in 1514 and sends ACKs the
  other way: about 0.94).
* Codec time = bytes read + written / measured throughput (``commpress bench codecs
  --json``) or the documented defaults (:mod:`commpress.plan.hardware`).
* A mixture of experts computes ``6 · active parameters · tokens``. With expert
  parallelism (``ep`` consecutive data-parallel ranks share one copy of the experts, as
  the trainer lays them out) each MoE layer runs four all-to-alls per micro-batch
  (dispatch, combine and their gradients; two more forward with recomputation), on the
  critical path, routing balanced: each rank sends ``tokens · top_k · hidden / ep``
  elements to every peer of its group, with the policy's ``ep`` codec of the link. The
  experts' gradients are reduced over their expert-data-parallel group (``dp / ep``
  ranks, ``ep`` apart), the dense weights' over the whole data-parallel group.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from commpress.codecs import codec as build_codec
from commpress.collectives.compressed_all_reduce import two_rank_exchange
from commpress.dp.grad_path import grad_levels
from commpress.dp.weight_gather import weight_gather_levels
from commpress.files import read_regular
from commpress.plan.hardware import CODEC_GBps
from commpress.plan.models import ModelShape
from commpress.policy import EP_KINDS, Policy, Rule
from commpress.validate import InputError, check_float, check_int


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    intra_GBps: float  # one GPU to its node peers, per direction
    inter_GBps: float  # one node's injection bandwidth (all NICs), per direction
    tflops: float  # peak per GPU
    mfu: float = 0.4
    intra_latency_us: float = 2.0
    inter_latency_us: float = 5.0
    link_efficiency: float = 1.0  # payload share of the inter-node link rate
    device: str = "gpu"  # which codec throughput defaults apply: gpu | cpu
    # nccl: ring reduce-scatter; gloo: its reduce-scatter costs an all-reduce
    backend: str = "nccl"
    codec_GBps: dict[str, tuple[float, float]] = field(default_factory=dict)  # spec → enc, dec

    def __post_init__(self) -> None:
        check_int("gpus", self.gpus, ge=1)
        check_int("gpus_per_node", self.gpus_per_node, ge=1)
        if self.gpus % self.gpus_per_node:
            raise InputError(f"--gpus {self.gpus} must be a positive multiple of "
                             f"--gpus-per-node {self.gpus_per_node}")
        if self.backend not in ("nccl", "gloo"):
            raise InputError(f"--backend {self.backend!r} is not allowed; allowed: nccl, gloo")
        for name in ("intra_GBps", "inter_GBps", "tflops"):
            check_float(name, getattr(self, name), gt=0)
        for name in ("mfu", "link_efficiency"):
            check_float(name, getattr(self, name), gt=0, le=1)
        for name in ("intra_latency_us", "inter_latency_us"):
            check_float(name, getattr(self, name), ge=0)
        for spec, speeds in self.codec_GBps.items():  # measured: a JSON may hold NaN or 0
            for direction, gbps in zip(("encode", "decode"), speeds, strict=True):
                check_float(f"codec_GBps[{spec!r}].{direction}", gbps, gt=0)

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


@dataclass(frozen=True)
class JobSpec:
    model: ModelShape
    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 1  # 0: plain data parallel (DDP), 1-3: ZeRO
    micro_batch: int = 1
    seq: int = 2048
    global_batch: int = 512
    recompute: bool = False
    overlap: str = "none"  # none | dp
    param_bytes: int = 2  # training dtype (bf16)
    grad_bytes: int = 4  # uncompressed gradient reduce-scatter in fp32
    act_bytes: int = 2
    ep: int = 1  # expert-parallel degree (a mixture of experts), borrowed from dp

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "seq", "global_batch", "param_bytes",
                     "grad_bytes", "act_bytes", "ep"):
            check_int(name, getattr(self, name), ge=1)
        if self.ep > 1 and not self.model.moe:
            raise InputError(f"--ep {self.ep} needs a mixture-of-experts model; allowed: "
                             "--ep 1, or a model with experts (moe-256m, mixtral-8x7b, "
                             "qwen3-30b-a3b)")
        if self.dp % self.ep or (self.model.moe and self.model.experts % self.ep):
            raise InputError(f"--ep {self.ep} must divide dp={self.dp} and the model's "
                             f"{self.model.experts} experts")
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"--zero-stage {self.zero_stage} is not allowed; allowed: 0 "
                             "(plain data parallel, DDP), 1, 2, 3")
        if self.overlap not in ("none", "dp"):
            raise InputError(f"--overlap {self.overlap!r} is not allowed; allowed: none, dp")
        if self.global_batch % (self.dp * self.micro_batch):
            raise InputError(f"--global-batch {self.global_batch} is not divisible by dp × "
                             f"micro-batch = {self.dp} × {self.micro_batch}")

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)


# -- bytes of each algorithm --------------------------------------------------------------

@dataclass
class Traffic:
    """One stage of a collective as seen by one GPU: bytes it puts on its intra-node
    link, bytes its node puts on the network, and messages at each level."""

    intra_bytes: float = 0.0  # per GPU
    inter_bytes: float = 0.0  # per node
    intra_msgs: int = 0
    inter_msgs: int = 0

    def time(self, c: ClusterSpec) -> float:
        t_intra = self.intra_msgs * c.intra_latency_us * 1e-6 + self.intra_bytes / (
            c.intra_GBps * 1e9)
        t_inter = self.inter_msgs * c.inter_latency_us * 1e-6 + self.inter_bytes / (
            c.inter_GBps * c.link_efficiency * 1e9)
        return max(t_intra, t_inter)


def all_to_all(n: int, n_local: int, chunk_bytes: float, gpus_per_node: int) -> Traffic:
    """Each of ``n`` ranks sends one chunk to every peer (commpress reduce-scatter)."""
    inter_peers = n - n_local
    return Traffic(intra_bytes=(n_local - 1) * chunk_bytes,
                   inter_bytes=gpus_per_node * inter_peers * chunk_bytes if inter_peers else 0,
                   intra_msgs=n_local - 1, inter_msgs=inter_peers)


def ring(n: int, n_local: int, chunk_bytes: float, gpus_per_node: int,
         passes: int = 1) -> Traffic:
    """A ring reduce-scatter or all-gather (``passes=2``: all-reduce): ``n − 1`` chunk
    sends per pass through every edge; one edge per ring leaves each node."""
    steps = passes * (n - 1)
    nodes_spanned = n // n_local
    if nodes_spanned <= 1:
        return Traffic(intra_bytes=steps * chunk_bytes, intra_msgs=steps)
    rings_per_node = gpus_per_node // n_local
    return Traffic(intra_bytes=steps * chunk_bytes if n_local > 1 else 0,
                   inter_bytes=rings_per_node * steps * chunk_bytes,
                   intra_msgs=steps if n_local > 1 else 0, inter_msgs=steps)


def p2p(bytes_: float, crosses_node: bool, gpus_per_node: int, concurrent: int) -> Traffic:
    if crosses_node:
        return Traffic(inter_bytes=concurrent * bytes_, inter_msgs=1)
    return Traffic(intra_bytes=bytes_, intra_msgs=1)


# -- codecs ---------------------------------------------------------------------------

def wire_bytes(spec: str, numel: float, in_bytes: int) -> float:
    """Bytes on the wire for ``numel`` elements (fixed-rate codecs exactly; variable-rate
    ones at their nominal rate)."""
    if spec == "none":
        return numel * in_bytes
    c = build_codec(spec)
    n = max(1, int(numel))
    wb = c.wire_bytes(n)
    if wb is None:  # zfp: rate bits per value; nvcomp: assume ratio 1.24 (DESIGN.md)
        rate = getattr(c, "rate", None)
        return numel * (rate / 8 if rate else in_bytes / 1.24)
    return wb * numel / n


def codec_seconds(c: ClusterSpec, spec: str, encoded: float, decoded: float,
                  in_bytes: int) -> float:
    """Time to encode ``encoded`` and decode ``decoded`` elements."""
    if spec == "none":
        return 0.0
    table = CODEC_GBps[c.device]
    enc, dec = c.codec_GBps.get(spec) or table.get(build_codec(spec).kernel, table["other"])
    w = wire_bytes(spec, 1 << 20, in_bytes) / (1 << 20)  # per element, padding amortized
    return (encoded * (in_bytes + w) / enc + decoded * (w + in_bytes) / dec) / 1e9


def rule_seconds(c: ClusterSpec, rule: Rule, encoded: float, decoded: float,
                 in_bytes: int) -> float:
    """:func:`codec_seconds` of a rule: error feedback also decodes what it encoded."""
    extra = encoded if rule.error_feedback else 0.0
    return codec_seconds(c, rule.codec, encoded, decoded + extra, in_bytes)


def compressed_all_reduce(n: int, n_local: int, spec: str, numel: float,
                          gpus_per_node: int) -> Traffic:
    """:func:`commpress.all_reduce` of ``numel`` elements on ``n`` ranks: two ranks
    exchange their codes once; more run an all-to-all reduce-scatter and a ring
    all-gather of ``numel / n``."""
    if two_rank_exchange(n):
        return all_to_all(n, n_local, wire_bytes(spec, numel, 4), gpus_per_node)
    w = wire_bytes(spec, numel / n, 4)
    a, r = all_to_all(n, n_local, w, gpus_per_node), ring(n, n_local, w, gpus_per_node)
    return Traffic(a.intra_bytes + r.intra_bytes, a.inter_bytes + r.inter_bytes,
                   a.intra_msgs + r.intra_msgs, a.inter_msgs + r.inter_msgs)


def load_codec_throughput(path: str, device: str) -> dict[str, tuple[float, float]]:
    """Codec throughputs from ``commpress bench codecs --json``, measured on ``device``
    (``gpu`` or ``cpu``): numbers of the other kind would be off by 1000×."""
    try:
        rows = json.loads(read_regular(path, 64 << 20, "--codec-throughput"))
    except (OSError, ValueError) as e:
        raise InputError(f"--codec-throughput {path!r} cannot be read: {e}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "codec" in r
                                             for r in rows):
        raise InputError(f"--codec-throughput {path!r} is not the JSON of 'commpress bench "
                         "codecs --json'")
    measured = {"cuda": "gpu"}.get(rows[0].get("device"), rows[0].get("device")) if rows else None
    if measured != device:
        raise InputError(f"--codec-throughput {path!r} was measured on {measured}, but the plan "
                         f"is for --device {device}; allowed: a measurement of the same kind "
                         f"(or --device {measured})")
    return {r["codec"]: (r["encode_GBps"], r["decode_GBps"]) for r in rows
            if r.get("encode_GBps")}


# -- one policy -------------------------------------------------------------------------

def _layout(c: ClusterSpec, j: JobSpec) -> tuple[int, int]:
    """(DP members per node, pipeline stage boundaries that cross a node boundary).

    Megatron's order puts TP innermost, then PP: a node of ``G`` GPUs holds ``G / tp``
    consecutive stages when ``tp < G``, so a pipeline of ``pp`` stages crosses
    ``ceil(pp · tp / G) − 1`` node boundaries (tp2 × pp4 on 4-GPU nodes: stages 1 → 2);
    with ``tp ≥ G`` every boundary crosses.
    """
    G, mp = c.gpus_per_node, j.tp * j.pp
    n_local = max(1, min(j.dp, G // mp)) if mp <= G else 1
    if j.pp == 1 or mp <= G:
        crossings = 0
    elif j.tp >= G:
        crossings = j.pp - 1
    else:
        crossings = -(-mp // G) - 1
    return n_local, crossings


def plan_policy(c: ClusterSpec, j: JobSpec, policy: Policy) -> dict[str, Any]:
    """Step time breakdown of one policy."""
    if j.dp * j.tp * j.pp != c.gpus:
        raise InputError(f"dp × tp × pp = {j.dp} × {j.tp} × {j.pp} must equal --gpus {c.gpus}")
    G, P = c.gpus_per_node, j.model.params
    m = j.micro_batches
    tokens = j.global_batch * j.seq
    flops = (8 if j.recompute else 6) * j.model.active_params * tokens
    compute = flops / c.gpus / (c.tflops * 1e12 * c.mfu) * (1 + (j.pp - 1) / m)
    n_local, pp_crossings = _layout(c, j)
    out: dict[str, float] = {"compute_s": compute, "dp_grad_s": 0.0, "dp_param_s": 0.0}
    codec_s = 0.0

    # DP gradients, then weights (ZeRO-3 gathers them for forward and again for
    # backward; DDP never): the dense weights over dp, experts over dp / ep
    gathers = {0: 0, 3: 2}.get(j.zero_stage, 1)
    for part, dp_job, dp_local in _dp_parts(j, n_local):
        p_local = part / (j.tp * j.pp)
        shard = p_local / dp_job.dp
        stages, secs = _dp_grad_cost(c, dp_job, policy, dp_local, shard, p_local)
        out["dp_grad_s"] += sum(t.time(c) for t in stages)
        codec_s += secs
        stages, secs = _dp_param_cost(c, dp_job, policy, dp_local, shard, p_local)
        out["dp_param_s"] += gathers * sum(t.time(c) for t in stages)
        codec_s += gathers * secs
    p_local = (P - j.model.expert_params * (j.ep > 1)) / (j.tp * j.pp)
    shard = p_local / j.dp

    # TP all-reduces: 2 forward (act) + 2 backward (act_grad) per layer and micro-batch
    act_elems = j.micro_batch * j.seq * j.model.hidden
    layers = j.model.layers / j.pp
    tp_s = 0.0
    if j.tp > 1:
        for kind, count in (("act", 2 * (2 if j.recompute else 1)), ("act_grad", 2)):
            spec = policy.rule("tp", kind).codec
            chunk = act_elems / j.tp
            if spec == "none":
                t = ring(j.tp, j.tp, chunk * j.act_bytes, G, passes=2).time(c)
            else:
                w = wire_bytes(spec, chunk, j.act_bytes)
                t = (all_to_all(j.tp, j.tp, w, G).time(c) + ring(j.tp, j.tp, w, G).time(c))
                codec_s += count * m * layers * codec_seconds(c, spec, 2 * act_elems,
                                                              2 * act_elems, j.act_bytes)
            tp_s += count * m * layers * t
    out["tp_s"] = tp_s

    # PP transfers on the critical path, per direction: each of the pp − 1 boundaries
    # once, and m − 1 more on the slowest (a node boundary if any: its GPUs, min(G, tp)
    # of them, share the node's link)
    pp_s = 0.0
    if j.pp > 1:
        for kind in ("act", "act_grad"):
            spec = policy.rule("pp", kind).codec
            b = wire_bytes(spec, act_elems, j.act_bytes)
            t_cross = p2p(b, True, G, min(G, j.tp)).time(c)
            t_local = p2p(b, False, G, 1).time(c)
            slowest = t_cross if pp_crossings else t_local
            pp_s += ((m - 1) * slowest + pp_crossings * t_cross
                     + (j.pp - 1 - pp_crossings) * t_local)
            codec_s += m * codec_seconds(c, spec, act_elems, act_elems, j.act_bytes)
    out["pp_s"] = pp_s

    # EP all-to-alls on the critical path: four per MoE layer and micro-batch
    ep_s, secs = _ep_cost(c, j, policy, n_local)
    out["ep_s"] = m * layers * ep_s
    codec_s += m * layers * secs
    out["codec_s"] = codec_s

    hidden = (2 / 3) * compute if j.overlap == "dp" else 0.0
    out["dp_exposed_s"] = max(0.0, out["dp_grad_s"] - hidden) + out["dp_param_s"]
    step = compute + tp_s + pp_s + out["ep_s"] + codec_s + out["dp_exposed_s"]
    return {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "tflops_per_gpu": 6 * P * tokens / step / c.gpus / 1e12,
        "breakdown": out,
        "break_even_inter_GBps": _break_even(c, j, policy, n_local, shard, p_local),
    }


Cost = tuple[list[Traffic], float]  # link stages (run one after another), codec seconds


def _dp_parts(j: JobSpec, n_local: int) -> list[tuple[float, JobSpec, int]]:
    """(parameters, the job as their data-parallel group sees it, its members per node):
    the whole model over dp; with expert parallelism the dense weights over dp and the
    experts over their expert-data-parallel group (dp / ep ranks, ep apart)."""
    if j.ep == 1:
        return [(j.model.params, j, n_local)]
    edp = dataclasses.replace(j, dp=j.dp // j.ep, ep=1)
    return [(j.model.params - j.model.expert_params, j, n_local),
            (j.model.expert_params, edp, max(1, n_local // j.ep))]


def _ep_cost(c: ClusterSpec, j: JobSpec, policy: Policy, n_local: int) -> tuple[float, float]:
    """Seconds of one MoE layer's all-to-alls in one micro-batch (link time, codec time):
    each rank sends ``tokens · top_k · hidden / ep`` elements to each peer, those inside
    its node with the ``intra`` codec, the rest with the ``inter`` one."""
    if j.ep == 1:
        return 0.0, 0.0
    G, shape = c.gpus_per_node, j.model
    chunk = j.micro_batch * j.seq * shape.top_k * shape.hidden / j.ep  # elements per peer
    ep_local = min(j.ep, n_local)
    inter_peers = j.ep - ep_local
    kinds = EP_KINDS + (("dispatch", "combine") if j.recompute else ())
    link_s = codec_s = 0.0
    for kind in kinds:
        intra, inter = (policy.rule("ep", kind, level) for level in ("intra", "inter"))
        link_s += Traffic(
            intra_bytes=(ep_local - 1) * wire_bytes(intra.codec, chunk, j.act_bytes),
            inter_bytes=G * inter_peers * wire_bytes(inter.codec, chunk, j.act_bytes),
            intra_msgs=ep_local - 1, inter_msgs=inter_peers).time(c)
        for rule, peers in ((intra, ep_local - 1), (inter, inter_peers)):
            codec_s += rule_seconds(c, rule, peers * chunk, peers * chunk, j.act_bytes)
    return link_s, codec_s


def _dp_grad_cost(c: ClusterSpec, j: JobSpec, policy: Policy, n_local: int, shard: float,
                  p_local: float) -> Cost:
    """The gradient reduction commpress runs: DDP's all-reduce (``zero_stage=0``) or
    ZeRO's reduce-scatter, one- or two-level."""
    G, nodes = c.gpus_per_node, j.dp // n_local
    if j.dp == 1:
        return [], 0.0
    used = grad_levels(policy, nodes * n_local, n_local)
    if len(used) == 2:
        intra = policy.rule("dp", "grad", "intra")
        inter = policy.rule("dp", "grad", "inter")
        if j.zero_stage == 0:  # node sums: exact-or-intra in, across nodes, exact out
            chunk = p_local / n_local
            stages = [all_to_all(n_local, n_local, wire_bytes(intra.codec, chunk, 4), G),
                      compressed_all_reduce(nodes, 1, inter.codec, chunk, G),
                      ring(n_local, n_local, chunk * 4, G)]
            return stages, (rule_seconds(c, intra, p_local, p_local, 4)
                            + rule_seconds(c, inter, chunk, 2 * chunk, 4))
        stages = [all_to_all(n_local, n_local, wire_bytes(intra.codec, nodes * shard, 4), G),
                  all_to_all(nodes, 1, wire_bytes(inter.codec, shard, 4), G)]
        return stages, (rule_seconds(c, intra, p_local, n_local * nodes * shard, 4)
                        + rule_seconds(c, inter, nodes * shard, nodes * shard, 4))
    rule = policy.rule("dp", "grad", None if used == ("single",) else used[0])
    if rule.exact:  # a ring; DDP's all-reduce and Gloo's reduce-scatter take two passes
        passes = 2 if j.zero_stage == 0 or c.backend == "gloo" else 1
        return [ring(j.dp, n_local, shard * j.grad_bytes, G, passes)], 0.0
    if j.zero_stage == 0:
        return ([compressed_all_reduce(j.dp, n_local, rule.codec, p_local, G)],
                rule_seconds(c, rule, p_local, 2 * p_local, 4))
    return ([all_to_all(j.dp, n_local, wire_bytes(rule.codec, shard, 4), G)],
            rule_seconds(c, rule, p_local, p_local, 4))


def _dp_param_cost(c: ClusterSpec, j: JobSpec, policy: Policy, n_local: int, shard: float,
                   p_local: float) -> Cost:
    """One all-gather of the weights; with several nodes a compressed one crosses them
    once per shard and shares the updated weights inside the node."""
    G, nodes = c.gpus_per_node, j.dp // n_local
    if j.dp == 1 or j.zero_stage == 0:
        return [], 0.0
    rule: Rule = policy.rule("dp", "param")
    pbytes = wire_bytes(rule.codec, shard, j.param_bytes)
    if len(weight_gather_levels(rule, nodes, n_local)) == 1:
        return ([ring(j.dp, n_local, pbytes, G)],
                rule_seconds(c, rule, shard, p_local, j.param_bytes))
    return ([ring(nodes, 1, pbytes, G),
             ring(n_local, n_local, nodes * shard * j.param_bytes, G)],
            rule_seconds(c, rule, shard, nodes * shard, j.param_bytes))


def _break_even(c: ClusterSpec, j: JobSpec, policy: Policy, n_local: int, shard: float,
                p_local: float) -> dict[str, float | None]:
    """Per compressed DP collective: the node injection bandwidth below which it beats
    the uncompressed one — the bytes it saves per node over its codec seconds, with the
    algorithms :func:`plan_policy` charges."""
    out: dict[str, float | None] = {}
    none = Policy.preset("none")
    rules = {"dp.grad": (policy.rule("dp", "grad", "inter"), _dp_grad_cost),
             "dp.param": (policy.rule("dp", "param"), _dp_param_cost)}
    for label, (rule, cost) in rules.items():
        stages, secs = cost(c, j, policy, n_local, shard, p_local)
        if rule.exact or not stages:
            continue
        base, _ = cost(c, j, none, n_local, shard, p_local)
        saved = sum(t.inter_bytes for t in base) - sum(t.inter_bytes for t in stages)
        out[f"{label}={rule.codec}"] = _bandwidth(saved, secs)
    return out


def _bandwidth(saved_bytes: float, codec_s: float) -> float | None:
    """GB/s at which ``saved_bytes`` take ``codec_s`` to send (None: nothing saved)."""
    if saved_bytes <= 0:
        return None
    return saved_bytes / codec_s / 1e9 if codec_s > 0 else math.inf


def plan_outer(c: ClusterSpec, j: JobSpec, policy: Policy, sync_every: int,
               fragments: int = 1, delay: int = 0) -> dict[str, Any]:
    """DiLoCo across the nodes (:class:`commpress.DiLoCo`): each node a site whose
    data-parallel ranks run DDP among themselves (exact, on the fast links) on its share
    of the global batch; every ``sync_every / fragments`` inner steps one fragment's
    pseudo-gradient is all-reduced — exactly inside the node, each local rank's chunk
    across the sites with the policy's ``outer.grad.inter`` codec, shared back inside —
    and what ``delay`` inner steps do not hide is exposed. Utilization: compute over wall
    time."""
    sites, G = c.nodes, c.gpus_per_node
    n_local = max(1, G // (j.tp * j.pp))
    if sites < 2 or j.dp % sites:
        raise InputError(f"DiLoCo across {sites} node(s) of dp {j.dp}: allowed: at least 2 "
                         "nodes, dp a multiple of them")
    site = ClusterSpec(**{**c.__dict__, "gpus": G})
    inner_job = JobSpec(**{**j.__dict__, "dp": j.dp // sites, "zero_stage": 0,
                           "global_batch": j.global_batch // sites})
    inner = plan_policy(site, inner_job, Policy.preset("none"))
    chunk = j.model.params / (j.tp * j.pp) / fragments / n_local  # one local rank's share
    rule = policy.rule("outer", "grad", "inter")
    stages = [ring(n_local, n_local, chunk * 4, G)] if n_local > 1 else []  # reduce-scatter
    if rule.codec == "none":
        stages.append(ring(sites, 1, chunk / sites * 4, G, passes=2))
    else:
        stages.append(compressed_all_reduce(sites, 1, rule.codec, chunk, G))
    if n_local > 1:
        stages.append(ring(n_local, n_local, chunk * 4, G))  # the exact all-gather inside
    codec_s = rule_seconds(c, rule, 2 * chunk, 2 * chunk, 4)
    sync_s = sum(t.time(c) for t in stages) + codec_s
    step_s = inner["step_time_s"]
    exposed = max(0.0, sync_s - delay * step_s)
    wall = sync_every * step_s + fragments * exposed
    return {"inner_step_s": step_s, "sync_s": sync_s, "exposed_sync_s": exposed,
            "utilization": sync_every * inner["breakdown"]["compute_s"] / wall,
            "mean_step_s": wall / sync_every,
            "inter_bytes_per_step_node": fragments * sum(t.inter_bytes for t in stages)
            / sync_every}


def plan(c: ClusterSpec, j: JobSpec, policies: list[str]) -> dict[str, Any]:
    """``{"policies": {name: {...}}}`` for ``none`` and every requested policy."""
    names = ["none"] + [p for p in policies if p != "none"]
    result = {name: plan_policy(c, j, Policy.resolve(name)) for name in names}
    base = result["none"]["step_time_s"]
    for r in result.values():
        r["speedup_vs_none"] = base / r["step_time_s"]
    return {"policies": result}
