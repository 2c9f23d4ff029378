"""DeepSpeed ZeRO-1/2 with commpress on its gradient and weight paths.

``commpress.deepspeed.compress(engine, "sdp4bit")`` applies a policy inside one engine:

* **Gradients, a real reduce-scatter.** DeepSpeed reduces a gradient bucket in
  ``DeepSpeedZeroOptimizer.average_tensor``: it cuts the bucket into the slices each
  data-parallel rank owns, divides by the world size, and hands the slices to
  ``allreduce_and_scatter`` (its default, ``use_multi_rank_bucket_allreduce``: an
  all-reduce of the whole bucket) or ``allreduce_no_retain`` (one ``dist.reduce`` per
  owner). The adapter lets DeepSpeed's own code cut and divide, takes the slices it
  hands over instead of sending them, and moves them in one compressed reduce-scatter
  with uneven parts (:func:`commpress.reduce_scatter_parts`): each slice is encoded once with
  the ``dp.grad`` codec and sent to its owner only, who decodes and sums the ranks'
  slices in fp32, in rank order, and writes them where DeepSpeed's reduction would
  have. With ``intra``/``inter`` codecs and several nodes, two levels: the node's
  parts meet on one local rank first, and only their sum crosses the slow link.
* **Weights.** DeepSpeed's step gathers the new partitions with the module function
  ``all_gather_dp_groups``; for this engine they go through
  :func:`~commpress.dp.weight_gather.gather_weights` with the
  ``dp.param`` rule instead: a codec, two levels, or qWD differences (each rank keeps
  its own partition as last gathered, since DeepSpeed overwrites it with the new
  weights before the gather).
* **Checkpoints.** ``engine.save_checkpoint`` also writes each rank's codec state
  (error-feedback residuals, stochastic-rounding counters) beside DeepSpeed's files,
  ``<save_dir>/<tag>/commpress-rank<global rank>.pt``; ``engine.load_checkpoint``
  reads it back, so a resumed run continues bit for bit.

DeepSpeed keeps everything else: its buckets and when they are reduced
(``overlap_comm``, ``contiguous_gradients``, gradient accumulation), the slices'
offsets, clipping, loss scaling, the optimizer. The optimizer's methods are patched on
the instance; ``all_gather_dp_groups`` is a module function, so it is replaced by a
dispatcher that sends this engine's gathers to commpress and every other call to
DeepSpeed's function. :meth:`DeepSpeedCompression.remove` takes it all out.

The alternative we rejected — overriding ``gradient_reduction_w_predivide`` with
``reduce_scatter: false`` — is shorter but gives every rank the whole bucket: an
all-reduce, twice the bytes of a reduce-scatter.

* **Mixtures of experts** (``deepspeed.moe.layer.MoE`` with ``ep_size > 1``). The
  experts' gradient slices, which DeepSpeed reduces over each expert's
  expert-data-parallel group, are reduce-scattered there with ``dp.grad`` (their own
  codec state); their parameter groups gather weights over the same groups. Where the
  policy names ``ep`` rules, each ``MOELayer``'s two token all-to-alls — the dispatch of
  its capacity-padded ``(experts, capacity, model)`` buffer and the combine of the
  experts' outputs, both cut evenly over the expert-parallel group — go through a
  :class:`commpress.ep.EPExchange` (each token row encoded on its own; the backward of
  each with the ``*_grad`` codec). ``MOELayer.forward`` reads the module's ``_AllToAll``
  at each call: the layer's ``forward`` is wrapped to put the exchange there for the
  call (one thread at a time, as DeepSpeed's forward runs).

Not covered, and refused by :func:`compress`: ZeRO-3 (its parameters are gathered per
module inside ``partition_parameters``; compressed fully sharded training is
``commpress.fsdp`` on FSDP2), ZeRO++'s own quantized paths (``zero_quantized_weights``,
``zero_quantized_gradients``, ``zero_hpz_partition_size``: one engine compresses once),
``reduce_scatter: false`` and ``contiguous_gradients: false`` (DeepSpeed all-reduces
there), CPU offload and Muon (their gradients go through other reductions), experts
split by tensor parallelism. Written against DeepSpeed 0.19.8.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives import Topology
from commpress.collectives.agreement import agree, rendezvous
from commpress.dp import DPBucket
from commpress.dp.saved_state import check_resume, envelope
from commpress.engines import rank_state
from commpress.engines.seam import Seam, Swap, install, restore
from commpress.ep import EPExchange
from commpress.policy import Policy
from commpress.validate import InputError, check_bool

try:
    import deepspeed
    from deepspeed.moe import sharded_moe
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import stage_1_and_2
except ImportError as e:  # pragma: no cover - the engine tests require it
    raise ImportError("commpress.deepspeed needs DeepSpeed: pip install -r "
                      "requirements-engines.txt (deepspeed==0.19.8)") from e

log = logging.getLogger(__name__)
WHAT = "commpress.deepspeed"  # names this adapter in messages

STATE_FORMAT = "commpress.deepspeed/3"
TESTED_VERSION = "0.19.8"
STAGES = (1, 2)


class DeepSpeedCompression:
    """commpress inside one DeepSpeed ZeRO-1/2 engine (made by :func:`compress`).

    Slots: hyperparameters (``policy``, ``topology``, the engine's data-parallel
    ``group``); internal state (a :class:`DPBucket` of gradient codecs for each of
    DeepSpeed's buckets — its buckets keep their parameters from step to step —, keyed
    by their first and last parameter's names; one of weight codecs per parameter group,
    holding with qWD this rank's partition of the weights as last gathered); stats
    (``buckets_reduced``).
    """

    def __init__(self, engine: DeepSpeedEngine, policy: Policy, topology: Topology,
                 elastic: bool = False) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        # hyperparameters
        self.policy = policy
        self.topology = topology
        self.elastic = elastic
        self.group = self.optimizer.dp_process_group
        # internal state: DeepSpeed reduces gradients in buckets it forms as they come and
        # gathers weights per parameter group: one DPBucket each, gradients or weights
        self.grad_buckets: dict[str, DPBucket] = {}
        self.weight_groups = [DPBucket(policy, topology, grads=False, weights=True)
                              for _ in self.optimizer.bit16_groups_flat]
        self._pending: dict[str, dict] = {}  # loaded codec states of buckets not yet seen
        self._take_references()
        self._names = {id(p): n for n, p in engine.module.named_parameters()}
        self._pieces: list | None = None  # slices DeepSpeed hands over while collecting
        # an MoE's experts reduce over these groups (DeepSpeed's, by expert group name)
        self._expert_groups = list((getattr(self.optimizer, "expert_dp_process_group", None)
                                    or {}).values())
        self.ep_exchanges: list[EPExchange] = []
        self._loading = False
        self._swaps: list[Swap] = []  # on this engine and its optimizer
        # stats
        self.buckets_reduced = 0

    # -- install / remove ----------------------------------------------------------------
    def _install(self) -> None:
        opt, engine = self.optimizer, self.engine
        self._swaps = install([Swap(opt, "average_tensor", self.reduce_bucket),
                               Swap(opt, "allreduce_and_scatter", self._collect_scatter),
                               Swap(opt, "allreduce_no_retain", self._collect_reduce),
                               Swap(engine, "save_checkpoint", self._save_checkpoint),
                               Swap(engine, "load_checkpoint", self._load_checkpoint),
                               Swap(engine, "commpress", self), *self._expert_swaps()])
        SEAM.acquire(self)

    def _expert_swaps(self) -> list[Swap]:
        """Each expert-parallel ``MOELayer``'s forward, wrapped to send its tokens through
        an :class:`EPExchange` of its group — where the policy names ``ep`` rules."""
        if not self.policy.names("ep"):
            return []
        exchanges: dict[int, EPExchange] = {}  # one per expert-parallel group
        swaps = []
        for layer in moe_layers(self.engine.module):
            exchange = exchanges.get(id(layer.ep_group))
            if exchange is None:
                exchange = exchanges[id(layer.ep_group)] = EPExchange(
                    self.policy, layer.ep_group, topology=self.topology)
            swap = Swap(layer, "forward", None)
            swap.replacement = functools.partial(_exchanging_forward, swap, exchange)
            swaps.append(swap)
        self.ep_exchanges = list(exchanges.values())
        return swaps

    def _original(self, name: str) -> Any:
        return next(s.original for s in self._swaps if s.name == name)

    def remove(self) -> None:
        """Give the engine back DeepSpeed's own reductions, gathers and checkpoints
        (idempotent)."""
        if not self._swaps:
            return
        restore(self._swaps)
        self._swaps = []
        SEAM.release(self)
        log.info("Removed commpress from the DeepSpeed engine")

    # -- gradients -----------------------------------------------------------------------
    def reduce_bucket(self, tensor: torch.Tensor, comm_dtype: torch.dtype) -> None:
        """DeepSpeed's ``average_tensor``, with the slices it would send reduce-scattered:
        over the data-parallel group, and an MoE's expert slices over their
        expert-data-parallel group."""
        pieces: list = []
        self._pieces = pieces
        try:
            self._original("average_tensor")(tensor, comm_dtype)
        finally:
            self._pieces = None
        groups: dict[int, list] = {}  # the bucket's groups, in the order DeepSpeed met them
        for piece in pieces:
            groups.setdefault(id(piece[0]), []).append(piece)
        for group_pieces in groups.values():
            self._reduce_pieces(tensor, comm_dtype, group_pieces)
        if pieces:
            self.buckets_reduced += 1

    def _reduce_pieces(self, tensor: torch.Tensor, comm_dtype: torch.dtype,
                       pieces: list) -> None:
        group = pieces[0][0]
        world, me = dist.get_world_size(group), dist.get_rank(group)
        by_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for _, dst, view, _ in pieces:
            by_rank[dst].append(view.reshape(-1))
        parts = [torch.cat(views) if views else tensor.new_empty(0) for views in by_rank]
        # DeepSpeed has divided by the world size already: a sum, as its reduction
        bucket = self._grad_bucket(tensor, comm_dtype, experts=group is not self.group)
        reduced = bucket.reduce_scatter_parts(parts, group, op="sum").to(comm_dtype)
        # as DeepSpeed's reduction: the owner's slices (and its fp32 partition buffer, if
        # any) receive the reduced values; other ranks' slices are left as they are
        offset = 0
        for _, dst, view, output in pieces:
            if dst != me:
                continue
            value = reduced[offset:offset + view.numel()]
            offset += view.numel()
            if output is not None:
                output.add_(value.to(output.dtype).view_as(output))
            view.copy_(value.view_as(view))

    def _grad_bucket(self, tensor: torch.Tensor, comm_dtype: torch.dtype,
                     experts: bool) -> DPBucket:
        params = self.optimizer.ipg_buckets[comm_dtype].params
        first, last = (self._names[id(self.optimizer.bit16_groups[i][j])]
                       for i, j, _ in (params[0], params[-1]))
        key = (f"{str(comm_dtype).removeprefix('torch.')}:{first}..{last}:{tensor.numel()}"
               + (":experts" if experts else ""))
        bucket = self.grad_buckets.get(key)
        if bucket is None:
            bucket = self.grad_buckets[key] = DPBucket(self.policy, self.topology)
            if key in self._pending:
                bucket.load_state_dict(self._pending.pop(key))
        return bucket

    def collect(self, dst: int, view: torch.Tensor, output: torch.Tensor | None,
                group: dist.ProcessGroup | None) -> None:
        group = self.group if group is None else group
        if group is not self.group and group not in self._expert_groups:
            raise RuntimeError("commpress.deepspeed: a gradient slice is reduced over a group "
                               "that is neither the engine's data-parallel group nor an "
                               "expert-data-parallel one; not supported")
        self._pieces.append((group, dst, view, output))

    # DeepSpeed calls these two as methods of its optimizer: bound to this compression
    def _collect_scatter(self, bucket, communication_data_type, numel_per_bucket=500000000,
                         log=None, divide=True, process_group=None):
        if self._pieces is None:
            return self._original("allreduce_and_scatter")(
                bucket, communication_data_type, numel_per_bucket=numel_per_bucket, log=log,
                divide=divide, process_group=process_group)
        for item in bucket:
            ranks, view, output = item if len(item) == 3 else (*item, None)
            if not isinstance(ranks, frozenset) or len(ranks) != 1:
                shown = sorted(ranks) if isinstance(ranks, frozenset) else ranks
                raise RuntimeError("commpress.deepspeed: a gradient slice is copied to several "
                                   f"ranks ({shown}; Muon's split matrices?); not supported")
            self.collect(next(iter(ranks)), view, output, process_group)

    def _collect_reduce(self, bucket, communication_data_type, numel_per_bucket=500000000,
                        rank=None, log=None, divide=True, process_group=None,
                        output_bucket=None):
        if self._pieces is None or rank is None:
            return self._original("allreduce_no_retain")(
                bucket, communication_data_type, numel_per_bucket=numel_per_bucket, rank=rank,
                log=log, divide=divide, process_group=process_group, output_bucket=output_bucket)
        for view, output in zip(bucket, output_bucket or [None] * len(bucket)):
            self.collect(rank, view, output, process_group)

    # -- weights ------------------------------------------------------------------------
    def gather(self, groups_flat: list[torch.Tensor], partitions: list[list[torch.Tensor]],
               groups: list[dist.ProcessGroup]) -> None:
        """The step's weight all-gather, each parameter group with the ``dp.param`` rule."""
        for i, (flat, parts) in enumerate(zip(groups_flat, partitions)):
            if dist.get_world_size(groups[i]) == 1:
                continue
            mine = parts[dist.get_rank(groups[i])]  # DeepSpeed wrote the new weights here
            weights = self.weight_groups[i]
            weights.gather_weights(flat, weights.take_new_weights(mine), groups[i])
            weights.weights_gathered(mine)

    def _take_references(self) -> None:
        """qWD's references: this rank's partitions as DeepSpeed now holds them (at
        compress, and after DeepSpeed loads a checkpoint)."""
        opt = self.optimizer
        for i, (weights, parts) in enumerate(zip(self.weight_groups,
                                                 opt.parallel_partitioned_bit16_groups)):
            weights.follow(parts[dist.get_rank(opt.real_dp_process_group[i])])

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (the weights themselves are in DeepSpeed's files)."""
        return envelope(STATE_FORMAT, self.policy, dist.get_rank(self.group),
                        dist.get_world_size(self.group),
                        grad_buckets={**self._pending, **{k: b.state_dict() for k, b in
                                                          self.grad_buckets.items()}},
                        weight_groups=[w.state_dict() for w in self.weight_groups],
                        buckets_reduced=self.buckets_reduced)

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore codec state saved by the same data-parallel rank of the same run.

        ``elastic=True`` accepts a state of another data-parallel size or rank (DeepSpeed's
        universal checkpoints reshard its own state): the policy
        and parameter groups are still checked, and the codecs start fresh — their memory
        was laid out for the world that saved them (said once, on rank 0)."""
        if not check_resume(
                state, STATE_FORMAT, WHAT, self.policy,
                dist.get_rank(self.group), dist.get_world_size(self.group), elastic,
                "resume with the same policy, data-parallel size and parameter groups; on "
                "another data-parallel size: compress(engine, policy, elastic=True)",
                {"weight_groups": len(self.weight_groups)}, views={"weight_groups": len}):
            self._fresh_codecs()
            self.buckets_reduced = state["buckets_reduced"]
            return
        for weights, saved in zip(self.weight_groups, state["weight_groups"]):
            weights.load_state_dict(saved)
        self.grad_buckets = {}
        self._pending = dict(state["grad_buckets"])  # applied as each bucket comes
        self.buckets_reduced = state["buckets_reduced"]

    def _fresh_codecs(self) -> None:
        self.grad_buckets, self._pending = {}, {}
        for weights in self.weight_groups:
            weights.fresh()

    def _save_checkpoint(self, save_dir: str, tag: Any = None, *args, **kwargs) -> Any:
        # DeepSpeed's default tag, fixed here so both files land in one directory
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        # written before DeepSpeed's files: its 'latest' never names a tag without it
        # every rank saves (and loads): refused on all of them together, not per dp group
        rank_state.save_in(self.state_dict(), os.path.join(save_dir, tag), WHAT)
        return self._original("save_checkpoint")(save_dir, tag, *args, **kwargs)

    def _load_checkpoint(self, load_dir: str, tag: Any = None, *args, **kwargs) -> Any:
        self._loading = True  # a gather DeepSpeed makes while loading stays its own
        try:
            load_path, client_state = self._original("load_checkpoint")(load_dir, tag, *args,
                                                                        **kwargs)
        finally:
            self._loading = False
        if load_path is None:
            return load_path, client_state
        self._take_references()  # DeepSpeed has replaced the weights
        if kwargs.get("load_module_only"):
            return load_path, client_state
        checkpoint_dir = os.path.dirname(load_path)
        state = self._saved_state(checkpoint_dir)
        if state is None:
            self._fresh_codecs()
        else:
            self.load_state_dict(state, self.elastic)
        return load_path, client_state

    def _saved_state(self, checkpoint_dir: str) -> dict[str, Any] | None:
        """This rank's saved state; with ``elastic``, :func:`rank_state.load_elastic`'s
        (None: the checkpoint holds none, as a universal one made by ``ds_to_universal``,
        which copies only DeepSpeed's own files)."""
        missing = ("save it with a compressed engine, load with load_module_only=True, or, "
                   "on another data-parallel size (a universal checkpoint), compress(engine, "
                   "policy, elastic=True)")
        older = os.path.join(checkpoint_dir, f"commpress_rank{dist.get_rank():05d}.pt")
        if os.path.exists(older):  # the file name of format commpress.deepspeed/2
            missing = (f"it holds {os.path.basename(older)}, the state of an older commpress "
                       "(commpress.deepspeed/2), which this one does not read: resume with "
                       "the version that saved it, or load with load_module_only=True")
        return rank_state.resume_from(checkpoint_dir, WHAT, missing, self.elastic,
                                      "compress(engine, policy, elastic=True)")


def _gather_dispatch(groups_flat, partitioned_param_groups, dp_process_group,
                     start_alignment_factor, allgather_bucket_size):
    """``all_gather_dp_groups`` for every engine: compressed ones go to commpress."""
    for compression in list(SEAM.owners):
        if compression.optimizer.bit16_groups_flat is groups_flat and not compression._loading:
            return compression.gather(groups_flat, partitioned_param_groups, dp_process_group)
    return _DEEPSPEED_GATHER.original(groups_flat, partitioned_param_groups, dp_process_group,
                                      start_alignment_factor, allgather_bucket_size)


def moe_layers(module: torch.nn.Module) -> list:
    """The expert-parallel ``MOELayer``s of ``module`` (``ep_size > 1``)."""
    return [m for m in module.modules()
            if isinstance(m, sharded_moe.MOELayer) and m.ep_size > 1]


class _LayerExchange:
    """Stands in for DeepSpeed's ``_AllToAll`` during one ``MOELayer.forward``, which calls
    it twice: the dispatch of its ``(experts, capacity, model)`` buffer, then the combine
    of the experts' outputs, each cut evenly over the expert-parallel group."""

    def __init__(self, exchange: EPExchange) -> None:
        self.exchange = exchange
        self.kinds = iter(("dispatch", "combine"))

    def apply(self, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        kind = next(self.kinds, None)
        if kind is None or group is not self.exchange.group:
            raise RuntimeError("commpress.deepspeed: an MOELayer's forward made an all-to-all "
                               "other than its dispatch and combine on its expert-parallel "
                               f"group ({'a third one' if kind is None else 'another group'}); "
                               f"the adapter is written for DeepSpeed {TESTED_VERSION}")
        rows = x.reshape(-1, x.shape[-1])  # a token (capacity slot) per row
        world = dist.get_world_size(group)
        splits = [rows.shape[0] // world] * world
        return getattr(self.exchange, kind)(rows, splits, splits).view(x.shape)


def _exchanging_forward(swap: Swap, exchange: EPExchange, *args: Any, **kwargs: Any) -> Any:
    """An ``MOELayer``'s own forward, its two all-to-alls through ``exchange``."""
    stock = sharded_moe._AllToAll
    sharded_moe._AllToAll = _LayerExchange(exchange)
    try:
        return swap.original(*args, **kwargs)
    finally:
        sharded_moe._AllToAll = stock


# the step's weight gather is a module function: one dispatcher for every engine
_DEEPSPEED_GATHER = Swap(stage_1_and_2, "all_gather_dp_groups", _gather_dispatch)
SEAM = Seam("deepspeed", [_DEEPSPEED_GATHER])


def compress(engine: DeepSpeedEngine, policy: str | dict | Policy = "none",
             topology: Topology | None = None, *, elastic: bool = False,
             fallback: str | None = None) -> DeepSpeedCompression:
    """Compress a DeepSpeed ZeRO-1/2 engine's gradient reduce-scatter and weight
    all-gather with ``policy``; returns the :class:`DeepSpeedCompression` (``remove()``).

    Gradients: each rank receives only the slices it owns, ``bits(dp.grad)`` per element
    (two levels when the policy names ``intra``/``inter`` codecs and the group spans
    several nodes); weights: ``bits(dp.param)`` per element of each rank's partition.

    Args:
        engine: what ``deepspeed.initialize`` returned first (ZeRO stage 1 or 2).
        policy: preset name, policy file, dict or :class:`~commpress.Policy`.
        topology: node layout for two levels (default from ``LOCAL_WORLD_SIZE``).
        elastic: let ``engine.load_checkpoint`` resume a checkpoint saved on another
            data-parallel size (DeepSpeed reshards its own state through a universal
            checkpoint: ``ds_to_universal``, ``checkpoint.load_universal``): the codecs
            then start fresh, said once. Without it such a checkpoint is refused by name.
        fallback: ``"measured"``: each bucket's collectives are timed compressed and
            exact in their first calls and stay compressed only where faster
            (:mod:`commpress.dp.fallback`); None: the policy's.

    Example::

        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          model_parameters=model.parameters())
        commpress.deepspeed.compress(engine, "sdp4bit")
    """
    _check_engine(engine)
    check_bool("elastic", elastic)
    policy = Policy.resolve(policy).with_fallback(fallback)
    # a rank that does not compress goes on to DeepSpeed's own collectives on this group:
    # meet through the store first, then agree over the group
    rendezvous(engine.optimizer.dp_process_group, "deepspeed.compress")
    agree(engine.optimizer.dp_process_group, "deepspeed.compress", label="dp",
          policy=policy.to_dict(), groups=len(engine.optimizer.bit16_groups_flat))
    compression = DeepSpeedCompression(engine, policy, topology or Topology(), elastic)
    compression._install()
    log.info("Applied commpress to DeepSpeed ZeRO-%d: policy %s (%s)",
             engine.zero_optimization_stage(), compression.policy.name,
             compression.policy.describe() or "exact")
    return compression


def _check_engine(engine: Any) -> None:
    """Refuse, with the reason and the way out, what the adapter cannot honour."""
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"commpress.deepspeed.compress: engine must be the DeepSpeedEngine "
                        f"deepspeed.initialize returns; got {type(engine).__name__}")
    if getattr(engine, "commpress", None) is not None:
        raise InputError("commpress.deepspeed.compress: this engine is compressed already; "
                         "call engine.commpress.remove() first")
    stage = engine.zero_optimization_stage()
    if stage not in STAGES:
        hint = (" ZeRO-3 is not covered: its parameters are gathered per module inside "
                "DeepSpeed's partition_parameters; for compressed fully sharded training use "
                "FSDP2 with commpress.fsdp.compress" if stage == 3 else
                " Without ZeRO, DeepSpeed all-reduces gradients: use ZeRO stage 1 or 2")
        raise InputError(f"commpress.deepspeed.compress: zero_optimization.stage={stage} is "
                         f"not allowed; allowed: {', '.join(map(str, STAGES))}.{hint}")
    zeropp = [name for name in ("zero_quantized_weights", "zero_quantized_gradients")
              if getattr(engine, name)()]
    if engine.zero_hpz_partition_size() > 1:
        zeropp.append("zero_hpz_partition_size")
    if zeropp:
        raise InputError(f"commpress.deepspeed.compress: ZeRO++'s own quantized paths "
                         f"({', '.join(zeropp)}) are not allowed with commpress; turn them "
                         "off (commpress's policy compresses the same collectives)")
    opt = engine.optimizer
    if not isinstance(opt, stage_1_and_2.DeepSpeedZeroOptimizer):
        why = (" (DeepSpeed's choice at ZeRO-1 for bf16 weights with fp32 gradient "
               "accumulation: use ZeRO-2, or data_types.grad_accum_dtype bf16)"
               if type(opt).__name__ == "BF16_Optimizer" else "")
        raise InputError(f"commpress.deepspeed.compress: the engine's optimizer is "
                         f"{type(opt).__name__}{why}; allowed: DeepSpeedZeroOptimizer")
    missing = [n for n in ("average_tensor", "allreduce_and_scatter", "allreduce_no_retain")
               if not hasattr(opt, n)]
    if missing or not hasattr(stage_1_and_2, "all_gather_dp_groups"):
        raise RuntimeError(f"commpress.deepspeed: DeepSpeed {deepspeed.__version__} lacks "
                           f"{missing or ['all_gather_dp_groups']}; the adapter is written "
                           f"for DeepSpeed {TESTED_VERSION}")
    for field, bad, fix in (
            ("reduce_scatter", not opt.reduce_scatter, "set zero_optimization.reduce_scatter "
             "to true (DeepSpeed's default)"),
            ("contiguous_gradients", not opt.contiguous_gradients, "set zero_optimization."
             "contiguous_gradients to true (DeepSpeed's default)"),
            ("offload_optimizer", opt.cpu_offload, "CPU offload is not covered"),
            ("zenflow", getattr(opt, "zenflow", False), "ZenFlow is not covered"),
            ("optimizer", type(opt.optimizer).__name__.startswith("Muon"),
             "Muon's split matrices are all-reduced; not covered")):
        if bad:
            raise InputError(f"commpress.deepspeed.compress: {field} as configured is not "
                             f"allowed: {fix}")
    experts = getattr(opt, "is_moe_param_group", None) or [False] * len(
        opt.real_dp_process_group)
    if any(g is not opt.dp_process_group and not moe
           for g, moe in zip(opt.real_dp_process_group, experts, strict=True)):
        raise InputError("commpress.deepspeed.compress: parameter groups reduce over other "
                         "groups than the data-parallel group (and, for an MoE's experts, "
                         "their expert-data-parallel groups); not covered")
    if any(getattr(m, "enable_expert_tensor_parallelism", False)
           for m in engine.module.modules()):
        raise InputError("commpress.deepspeed.compress: experts split by tensor parallelism "
                         "(enable_expert_tensor_parallelism) are not covered; allowed: "
                         "experts whole on each rank")
    if deepspeed.__version__ != TESTED_VERSION:
        log.warning("commpress.deepspeed is written for DeepSpeed %s; this is %s",
                    TESTED_VERSION, deepspeed.__version__)
