"""``compress``: one policy over a Megatron-core model's data-, tensor- and pipeline-parallel
traffic, and the handle that undoes it and checkpoints its codec state."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from commpress.collectives import CollectiveMismatchError, Topology
from commpress.collectives.agreement import agree_across
from commpress.dp import needs_node_levels
from commpress.dp.saved_state import check_resume, envelope
from commpress.engines.megatron import data_parallel, expert_parallel, model_parallel
from commpress.engines.megatron.data_parallel import BucketComm
from commpress.engines.megatron.layout import identical_mask
from commpress.engines.megatron.model_parallel import ActivationComm
from commpress.engines.megatron.seams import REGISTRY
from commpress.engines.seam import Seam
from commpress.ep import EPExchange
from commpress.frontends.parts.buckets import tensor_parallel_key
from commpress.frontends.parts.replica_sync import differing_ranks
from commpress.policy import Policy
from commpress.validate import InputError, check_saved_state

log = logging.getLogger(__name__)

STATE_FORMAT = "commpress.megatron/2"
# installed while any compression of a Megatron model is live; REGISTRY under its lock
SEAM = Seam("megatron", [*data_parallel.SWAPS, *model_parallel.TP_SWAPS,
                          *model_parallel.PP_SWAPS, *expert_parallel.EP_SWAPS])


class MegatronCompression:
    """What :func:`compress` installed for one model and optimizer.

    ``remove()`` (or leaving a ``with`` block) gives Megatron its own communication
    back. ``state_dict()`` / ``load_state_dict()`` hold this rank's codec state —
    error-feedback memory, stochastic-rounding counters, qWD references — keyed by
    bucket (``chunk<c>.buffer<b>.bucket<k>``, with its parameter names) and by axis:
    save it with each rank's checkpoint and load it after the model and optimizer, so a
    resumed run continues bit for bit.
    """

    def __init__(self, policy: Policy, buckets: dict[str, BucketComm],
                 tp: ActivationComm | None, pp: ActivationComm | None,
                 dgrad_layers: list[torch.nn.Module], ep: EPExchange | None = None) -> None:
        # hyperparameters
        self.policy = policy
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # internal state: the collectives' codecs (ep's keep none: nearest rounding only)
        self.buckets, self.tp, self.pp, self.ep = buckets, tp, pp, ep
        self._dgrad_layers = dgrad_layers
        self.removed = False

    @property
    def axes(self) -> list[str]:
        """The parallel axes covered: ``dp`` and, where their groups have peers, ``tp``,
        ``pp`` and (where the policy names it) ``ep``."""
        return ["dp"] + [a for a, c in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep))
                         if c is not None]

    def remove(self) -> None:
        """Restore Megatron's own communication for this model (idempotent)."""
        if self.removed:
            return
        with SEAM.lock:
            for comm in self.buckets.values():
                for t in (comm.bucket.grad_data, comm.bucket.param_data):
                    REGISTRY.buckets.pop(id(t), None)
            for comm, live in ((self.tp, REGISTRY.tp), (self.pp, REGISTRY.pp),
                               (self.ep, REGISTRY.ep)):
                if comm is not None:
                    live.pop(comm.group, None)
            SEAM.release(self)
        model_parallel.restore_dgrad(self._dgrad_layers)
        self.removed = True
        log.info("Removed commpress %s from Megatron-core", self.policy.name)

    def __enter__(self) -> MegatronCompression:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return envelope(STATE_FORMAT, self.policy, self.rank, self.world,
                        buckets={k: c.state_dict() for k, c in self.buckets.items()},
                        tp=None if self.tp is None else self.tp.state_dict(),
                        pp=None if self.pp is None else self.pp.state_dict())

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore a state saved by this rank of a run with the same policy, world size and
        model; anything else is refused with the difference named.

        ``elastic=True`` resumes on another number of ranks (Megatron's distributed
        checkpoints reshard the model and optimizer) from any rank's state, rank 0's say:
        the policy is still checked, and the codecs start fresh — their memory was laid out
        for the world that saved them (said once, on rank 0); qWD references follow the
        loaded weights at the next reduce-scatter, as after any load."""
        what = "commpress Megatron codec"
        advice = ("resume with the same policy, world size and model (each rank loads its "
                  "own state); on another number of ranks: load_state_dict(state, "
                  "elastic=True)")
        if not check_resume(state, STATE_FORMAT, what, self.policy, self.rank, self.world,
                            elastic, advice):
            for bucket in self.buckets.values():
                bucket.dp.fresh()
            for comm in (self.tp, self.pp):
                if comm is not None:
                    comm.fresh_codecs(self.policy)
            return
        # the buckets of the world that saved them (another world lays them out anew)
        check_saved_state(state, STATE_FORMAT, what, {"buckets": sorted(self.buckets)},
                          advice, views={"buckets": sorted})
        for key, comm in self.buckets.items():
            comm.load_state_dict(state["buckets"][key])
        for axis in ("tp", "pp"):
            comm = getattr(self, axis)
            if (state[axis] is None) != (comm is None):
                raise InputError(f"Megatron codec checkpoint was saved with another {axis} size; "
                                 "resume with the same parallel layout")
            if comm is not None:
                comm.load_state_dict(state[axis])


def compress(model: Any, optimizer: Any = None, policy: str | dict | Policy = "sdp4bit", *,
             ranks_per_node: int | None = None, fallback: str | None = None
             ) -> MegatronCompression:
    """Compress a Megatron-core model's communication with ``policy``.

    Covers the data-parallel gradient reduce-scatter (``dp.grad``; TLq-HS with
    ``intra``/``inter`` codecs) or all-reduce (without the distributed optimizer), the
    distributed optimizer's weight all-gather (``dp.param``; qWD with ``delta``), the
    tensor-parallel activation collectives and their gradients (``tp.act``,
    ``tp.act_grad``; sequence parallelism's all-gathers and reduce-scatters too) and the
    pipeline stages' transfers (``pp.act``, ``pp.act_grad``). Bytes per element are the
    codecs' (``commpress.stats()`` counts them under those labels). A configuration it
    cannot honour is refused with the reason.

    Args:
        model: the ``megatron.core.distributed.DistributedDataParallel`` model, or the list
            of its chunks (virtual pipeline stages), as Megatron's training loop holds it.
        optimizer: the optimizer built for it (checked against the model), or None.
        policy: preset name, policy file, dict or :class:`~commpress.Policy`.
        ranks_per_node: ranks that share a node (default ``LOCAL_WORLD_SIZE``); each
            data-parallel group's nodes follow from its members' global ranks.
        fallback: ``"measured"``: each bucket's collectives are timed compressed and
            exact in their first calls and stay compressed only where faster
            (:mod:`commpress.dp.fallback`); None: the policy's.

    Returns:
        a :class:`MegatronCompression`; ``.remove()`` undoes it, and it is a context
        manager.

    Example::

        model = DistributedDataParallel(config, ddp_config, gpt)
        optimizer = get_megatron_optimizer(opt_config, [model])
        comm = commpress.megatron.compress(model, optimizer, "sdp4bit")
    """
    policy = Policy.resolve(policy).with_fallback(fallback)
    chunks = _chunks(model)
    _check_config(chunks, optimizer, policy)
    rpn = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if not isinstance(rpn, int) or rpn < 1:
        raise InputError(f"commpress.megatron.compress: ranks_per_node={rpn!r} is not allowed; "
                         "allowed: a positive integer")
    config = chunks[0].config
    _agree_on_compress(chunks, policy)
    # Step 1: data parallelism, bucket by bucket (Megatron's buckets, as they are)
    buckets = _bucket_comms(chunks, policy, rpn)
    # Step 2: tensor parallelism (column-parallel input gradients move to mappings.py)
    tp = pp = None
    dgrad_layers: list[torch.nn.Module] = []
    if chunks[0].tp_group.size() > 1:
        tp = ActivationComm("tp", chunks[0].tp_group, policy)
    # Step 3: pipeline parallelism
    if chunks[0].pp_group.size() > 1:
        pp = ActivationComm("pp", chunks[0].pp_group, policy)
    # Step 4: expert parallelism, where the policy names ep rules
    ep_group = _expert_parallel_group(chunks)
    ep = None
    if ep_group is not None and policy.names("ep"):
        ep = EPExchange(policy, ep_group)
    with SEAM.lock:
        if any(id(c.bucket.grad_data) in REGISTRY.buckets for c in buckets.values()):
            raise InputError("commpress.megatron.compress: this model already has a policy "
                             "applied; call .remove() on its handle first")
        for axis, comm, live in (("tensor", tp, REGISTRY.tp), ("pipeline", pp, REGISTRY.pp),
                                 ("expert", ep, REGISTRY.ep)):
            if comm is not None and comm.group in live:
                raise InputError(f"commpress.megatron.compress: another model on the same "
                                 f"{axis}-parallel group already has a policy applied; apply one "
                                 "policy to all model chunks at once (pass the list)")
        for comm in buckets.values():
            for t in (comm.bucket.grad_data, comm.bucket.param_data):
                if t is not None:
                    REGISTRY.buckets[id(t)] = comm
        if tp is not None:
            REGISTRY.tp[tp.group] = tp
            dgrad_layers = model_parallel.route_dgrad_through_mappings(chunks)
        if pp is not None:
            REGISTRY.pp[pp.group] = pp
        if ep is not None:
            REGISTRY.ep[ep.group] = ep
        handle = MegatronCompression(policy, buckets, tp, pp, dgrad_layers, ep)
        SEAM.acquire(handle)
    log.info("Applied commpress %s to Megatron-core: %d buckets (%s optimizer), tp=%d, pp=%d, "
             "sequence parallel %s", policy.name, len(buckets),
             "distributed" if chunks[0].ddp_config.use_distributed_optimizer else "DDP",
             chunks[0].tp_group.size(), chunks[0].pp_group.size(),
             "on" if config.sequence_parallel else "off")
    return handle


def _chunks(model: Any) -> list[DistributedDataParallel]:
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    for c in chunks:
        if not isinstance(c, DistributedDataParallel):
            raise TypeError(f"commpress.megatron.compress: model must be megatron.core.distributed."
                            f"DistributedDataParallel (or a list of them); got {type(c).__name__}"
                            " — wrap the model first (Megatron FSDP is not covered)")
    if not chunks:
        raise InputError("commpress.megatron.compress: model is an empty list")
    if isinstance(chunks[0].pp_group, list):
        raise InputError("commpress.megatron.compress: a model with several pipeline groups is not "
                         "covered")
    return chunks


def _buffers(chunk: DistributedDataParallel) -> list[tuple[str, Any]]:
    """The chunk's gradient buffers by name: the dense ones (``buffer<b>``, over the
    data-parallel group) and the experts' (``expert_buffer<b>``, over the expert
    data-parallel group: the ranks holding the same experts)."""
    return ([(f"buffer{b}", buf) for b, buf in enumerate(chunk.buffers)]
            + [(f"expert_buffer{b}", buf) for b, buf in enumerate(chunk.expert_parallel_buffers)])


def _expert_parallel_group(chunks: list[DistributedDataParallel]) -> Any:
    """The expert-parallel group of the model's MoE layers (None: no MoE, or EP of 1)."""
    groups = {id(m.token_dispatcher.ep_group): m.token_dispatcher.ep_group
              for c in chunks for m in c.modules()
              if isinstance(getattr(m, "token_dispatcher", None),
                            expert_parallel.MoEAlltoAllTokenDispatcher)}
    if len(groups) > 1:
        raise _refuse("MoE layers on several expert-parallel groups", "use one EP group")
    group = next(iter(groups.values()), None)
    return group if group is not None and group.size() > 1 else None


def _refuse(what: str, fix: str) -> InputError:
    return InputError(f"commpress.megatron.compress: {what} is not covered; {fix}")


def _check_config(chunks: list[DistributedDataParallel], optimizer: Any, policy: Policy) -> None:
    """Refuse what would leave covered traffic uncompressed or break an invariant."""
    ddp, config = chunks[0].ddp_config, chunks[0].config
    if ddp.reduce_scatter_with_fp32_accumulation:
        raise _refuse("reduce_scatter_with_fp32_accumulation=True (it replaces the gradient "
                      "reduce-scatter itself)", "set it to False")
    if ddp.num_distributed_optimizer_instances > 1:
        raise _refuse(f"num_distributed_optimizer_instances="
                      f"{ddp.num_distributed_optimizer_instances} (its all-reduce between "
                      "instances calls torch.distributed directly)",
                      "use 1 instance and a two-level dp.grad (intra/inter) for the same "
                      "hierarchy")
    if getattr(config, "num_moe_experts", None):
        if config.moe_token_dispatcher_type != "alltoall":
            raise _refuse(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} "
                          "(its exchanges are not the all-to-alls commpress covers)",
                          "use moe_token_dispatcher_type='alltoall'")
        if (config.expert_tensor_parallel_size or 1) > 1:
            raise _refuse(f"expert_tensor_parallel_size={config.expert_tensor_parallel_size} "
                          "(the experts' tensor-parallel gathers around the all-to-all)",
                          "use expert_tensor_parallel_size=1")
    distopt = ddp.use_distributed_optimizer
    param_lossy = policy.rule("dp", "param").lossy
    for c in chunks:
        for _, buffer in _buffers(c):
            if buffer.param_dtype == torch.uint8:
                raise _refuse("fp8 parameters", "train in bf16 or fp16")
            if distopt and param_lossy and buffer.param_dtype == torch.float32:
                raise InputError(
                    f"commpress.megatron.compress: dp.param={policy.rule('dp', 'param').codec!r} "
                    "would overwrite the distributed optimizer's fp32 master weights: for fp32 "
                    "parameters they are the model's own; train in bf16 or fp16 "
                    "(TransformerConfig(bf16=True)) or set dp.param to none")
    if not distopt and param_lossy:
        log.info("commpress.megatron: no distributed optimizer, so no weight all-gather: "
                 "dp.param=%s has nothing to compress", policy.rule("dp", "param").codec)
    if chunks[0].tp_group.size() > 1:
        if config.tp_comm_overlap:
            raise _refuse("tp_comm_overlap=True (Transformer Engine's userbuffers)",
                          "set it to False")
        te = [type(m).__name__ for c in chunks for m in c.modules()
              if type(m).__module__.startswith("megatron.core.extensions.transformer_engine")]
        if te:
            raise _refuse(f"Transformer Engine layers ({te[0]}) with tensor parallelism (they "
                          "communicate inside TE)", "build the model with the local layer spec")
        for kind in model_parallel.KINDS:
            if policy.rule("tp", kind).error_feedback:
                raise _refuse(f"error feedback on tp.{kind} (one memory per call site, which "
                              "Megatron's shared mappings do not identify)",
                              f"drop error_feedback from tp.{kind}")
    if chunks[0].pp_group.size() > 1:
        if config.use_ring_exchange_p2p:
            raise _refuse("use_ring_exchange_p2p=True", "set it to False")
        if not config.batch_p2p_comm:
            raise _refuse("batch_p2p_comm=False (overlap_p2p_comm)", "set batch_p2p_comm=True")
    # the distributed optimizer knows its model chunks; the others (and None) only their
    # parameters
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    covered = {id(m) for o in parts for m in getattr(o, "model_chunks", [])}
    if covered and not covered & {id(c) for c in chunks}:
        raise InputError("commpress.megatron.compress: the optimizer was not built for this model "
                         "(its model_chunks hold other modules); pass the model and the "
                         "optimizer get_megatron_optimizer built for it")


def dp_topology(group: dist.ProcessGroup, ranks_per_node: int) -> Topology | None:
    """How many of ``group``'s ranks share each node (node = global rank // ranks_per_node),
    or None when they are spread unevenly or out of node order."""
    ranks = dist.get_process_group_ranks(group)
    nodes = [r // ranks_per_node for r in ranks]
    per = nodes.count(nodes[0])
    if nodes != sorted(nodes) or any(nodes.count(n) != per for n in set(nodes)):
        return None
    return Topology(per)


def _agree_on_compress(chunks: list[DistributedDataParallel], policy: Policy) -> None:
    """Before any collective of its own, on every data-, tensor- and pipeline-parallel
    group: a rank that applies another policy, or none, is named on every rank of the
    mesh, rather than left waiting in a replica check, a bucket or a peer's next group."""
    checks = [(buffer.data_parallel_group, {"label": f"chunk{c}.{name}",
                                            "policy": policy.to_dict(),
                                            "buckets": len(buffer.buckets)})
              for c, chunk in enumerate(chunks) for name, buffer in _buffers(chunk)]
    for axis, group in (("tp", chunks[0].tp_group), ("pp", chunks[0].pp_group),
                        ("ep", _expert_parallel_group(chunks))):
        if group is not None and group.size() > 1:
            checks.append((group, {"label": axis, "policy": policy.to_dict()}))
    agree_across("megatron.compress", checks)


def _bucket_comms(chunks: list[DistributedDataParallel], policy: Policy,
                  ranks_per_node: int) -> dict[str, BucketComm]:
    distopt = chunks[0].ddp_config.use_distributed_optimizer
    config = chunks[0].config
    needs_nodes = needs_node_levels(policy)
    mixed_tp = chunks[0].tp_group.size() > 1
    out: dict[str, BucketComm] = {}
    for c, chunk in enumerate(chunks):
        names = {p: n for n, p in chunk.module.named_parameters()}
        for buffer_name, buffer in _buffers(chunk):
            group = buffer.data_parallel_group
            topology = dp_topology(group, ranks_per_node)
            if topology is None:
                if needs_nodes:
                    raise InputError(
                        f"commpress.megatron.compress: the data-parallel group of ranks "
                        f"{dist.get_process_group_ranks(group)} spreads unevenly over nodes of "
                        f"{ranks_per_node} ranks; allowed: the same number of its ranks on "
                        "every node (set ranks_per_node, or a one-level policy)")
                topology = Topology(1)
            for bucket in buffer.buckets:
                key = f"chunk{c}.{buffer_name}.bucket{bucket.bucket_id}"
                positions = {p: (buffer.param_index_map[p][0] - bucket.offset,
                                 buffer.param_index_map[p][1] - bucket.offset)
                             for p in bucket.params_list}
                identical = {"grad": None, "param": None}
                if mixed_tp:
                    replicated = {p: not tensor_parallel_key(names[p], p)
                                  for p in bucket.params_list}
                    identical["param"] = identical_mask(bucket, positions, replicated)
                    identical["grad"] = identical_mask(bucket, positions, {
                        p: replicated[p] and not _tp_summed_later(names[p], p, config)
                        for p in bucket.params_list})
                out[key] = BucketComm(key, [names[p] for p in bucket.params_list], bucket, group,
                                      policy, topology, identical, distopt)
            if distopt and policy.rule("dp", "param").delta:
                _check_replicas(buffer, group)
    return out


def _tp_summed_later(name: str, p: torch.nn.Parameter, config: Any) -> bool:
    """Whether Megatron sums this replicated parameter's gradient across TP ranks after the
    data-parallel reduction (``finalize_model_grads``): its parts differ between them."""
    return bool((config.sequence_parallel and getattr(p, "sequence_parallel", False))
                or getattr(p, "average_gradients_across_tp_domain", False)
                or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)))


@torch.no_grad()
def _check_replicas(buffer: Any, group: dist.ProcessGroup) -> None:
    """qWD sends only differences, which never close a gap: the replicas must agree."""
    if group.size() == 1:
        return
    differ, _ = differing_ranks([bk.param_data for bk in buffer.buckets], group,
                                buffer.param_data.device)
    if differ:
        ranks = dist.get_process_group_ranks(group)
        raise CollectiveMismatchError(
            f"commpress.megatron.compress: data-parallel ranks {[ranks[r] for r in differ]} hold "
            f"other weights than rank {ranks[0]}; qWD (dp.param delta) sends differences only "
            "and would never close the gap: call model.broadcast_params() (or load the same "
            "checkpoint everywhere) before compress")

