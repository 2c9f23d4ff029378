"""FSDP2 integration: compressed all-gather of weights and reduce-scatter of gradients.

``commpress.fsdp.compress(model, policy)`` installs, on every ``FSDPModule`` of
``model``, a custom ``AllGather`` (the policy's ``dp.param`` codec applied to the
weights themselves) and ``ReduceScatter`` (``dp.grad``: TLq-HS when the policy names
``intra``/``inter`` codecs). FSDP2 frees the gathered weights after use, so there is
no persistent copy to take differences against: a ``delta`` (qWD) rule cannot apply
here and the weights are gathered exactly instead (logged) — use
:class:`~commpress.ShardedOptimizer` for qWD.

Both run inside FSDP's communication streams and return ``None``.

HSDP (``fully_shard(mesh=...)`` on a 2-D ``(replicate, shard)`` mesh): torch 2.13 has
no custom-comm seam for the gradient all-reduce across replicas — ``foreach_reduce``
calls ``dist.all_reduce`` on the replicate group itself. ``compress`` therefore shows
each HSDP parameter group's FSDP machinery a shard-only view of its mesh (FSDP then
reduce-scatters over the shard group and all-reduces nothing) and runs the replicate
all-reduce inside its reduce-scatter, through the policy's inter-node ``dp.grad``
codec (label ``dp.grad.inter``); on CPU its transfer overlaps the rest of backward and
finishes when backward ends (where FSDP leaves the gradients untouched until the optimizer
step). Parameters keep their 2-D DTensor placements. Not
covered, refused by name: a shard dimension of size 1 (that is DDP: use
:func:`commpress.ddp_hook`), and ``set_requires_all_reduce(False)`` (deferred
replicate all-reduce for gradient accumulation).

``compress`` returns an :class:`FSDPCompression`: the installed collectives by FSDP
module name, and their codec state (error-feedback residuals, stochastic-rounding
counters) as a ``torch.distributed.checkpoint`` ``Stateful``. Without it a resumed
run restarts the codecs from zero and drifts from the uninterrupted one.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

from commpress.collectives import Topology
from commpress.collectives.agreement import agree, agree_across, rendezvous
from commpress.collectives.comm import all_gather_single
from commpress.dp import DPBucket
from commpress.dp.fallback import tally
from commpress.dp.saved_state import check_resume, envelope
from commpress.engines.seam import Swap, install, restore
from commpress.policy import Policy, Rule
from commpress.validate import InputError, check_saved_state

log = logging.getLogger(__name__)

STATE_FORMAT = "commpress.fsdp/2"


class _Allocate:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedAllGather(_Allocate, AllGather):
    """FSDP2 all-gather of the sharded weights through its :class:`DPBucket`'s weight
    codec."""

    def __init__(self, dp: DPBucket, label: str = "dp.param") -> None:
        self.dp = dp
        self.label = label

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        if input_tensor.is_floating_point():
            self.dp.gather_weights(output_tensor, input_tensor, group)
        else:  # mixed-dtype parameters travel as raw bytes: nothing to quantize
            agree(group, "all_gather", label=self.label, bytes=input_tensor.numel())
            all_gather_single(output_tensor, input_tensor, group)


class CompressedReduceScatter(_Allocate, ReduceScatter):
    """FSDP2 reduce-scatter of gradients (one- or two-level) through commpress codecs.

    Accepts ``ReduceOp.AVG``, ``ReduceOp.SUM`` and ``ReduceOp.PREMUL_SUM(factor)``
    (FSDP passes it for a custom gradient divide factor): the input is scaled by
    ``factor`` and summed. With HSDP it then all-reduces its output across the
    replicas (``replicate``).
    """

    def __init__(self, dp: DPBucket, replicate: ReplicateAllReduce | None = None) -> None:
        self.dp = dp
        self.replicate = replicate

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        if self.replicate is not None:
            self.replicate.check()
        self.dp.reduce_scatter(output_tensor, input_tensor, group,
                               op=_op_name(op, input_tensor))
        if self.replicate is not None:
            self.replicate(output_tensor)


class ReplicateAllReduce:
    """HSDP's gradient all-reduce across replicas, through the inter-node codec.

    FSDP, seeing only the shard group, picks the reduce-scatter op as if the shard group
    were the whole data-parallel world; what it leaves to this all-reduce is then: the
    mean across replicas when no gradient divide factor is set (FSDP averages or divides
    by the shard size alone), the sum when one is (FSDP already divided by it). Every
    rank decodes the same bytes, so replicas stay bitwise identical.
    """

    def __init__(self, dp: DPBucket, group: dist.ProcessGroup, param_group: Any,
                 in_flight: InFlight) -> None:
        self.dp = dp  # the inter-node rule alone, one level over the replicate group
        self.group = group
        self.param_group = param_group
        self.in_flight = in_flight

    def check(self) -> None:
        if not self.param_group.all_reduce_grads:
            raise RuntimeError(
                "commpress.fsdp: set_requires_all_reduce(False) (a deferred replicate "
                "all-reduce) is not covered with compressed HSDP; use "
                "set_requires_gradient_sync(False) for gradient accumulation instead")

    def __call__(self, tensor: torch.Tensor) -> None:
        """All-reduce ``tensor`` (the reduce-scatter's output, which FSDP then hands out as
        the sharded gradients). On CPU, when FSDP leaves that output untouched until the
        optimizer step, the transfer runs while backward goes on and finishes at its end
        (:class:`InFlight`); otherwise it finishes here."""
        op = "avg" if self.param_group.gradient_divide_factor is None else "sum"
        later = _untouched_until_step(self.param_group, tensor)
        handle = self.dp.all_reduce(tensor, self.group, op=op, async_op=later)
        if later:
            self.in_flight.add(handle)


def _untouched_until_step(param_group: Any, output: torch.Tensor) -> bool:
    """Whether FSDP's ``foreach_reduce`` only views ``output`` as the new sharded gradients
    after the reduce-scatter (torch 2.13): no post-divide (fp16 reduce, forced sum), no
    cast to another dtype, no gradient accumulated into, no CPU offload copy, no
    all-reduce or post-accumulate-grad hook that reads it at once. Only on CPU: on CUDA
    FSDP's streams already overlap the reduction with backward."""
    if output.device.type != "cpu" or output.dtype not in (torch.float32, torch.bfloat16):
        return False
    if (param_group.force_sum_reduction_for_comms or param_group._all_reduce_hook is not None
            or param_group._orig_dtype != output.dtype):
        return False
    return not any(p.offload_to_cpu or p.sharded_param.grad is not None
                   or getattr(p.sharded_param, "_post_accumulate_grad_hooks", None)
                   for p in param_group.fsdp_params)


class InFlight:
    """Replicate all-reduces started during a backward pass, finished at its end.

    The first one queues an autograd final callback that waits for all of them (and
    for any started by FSDP's own final callback, which runs earlier and may start the
    root module's); outside a backward pass a handle is finished at once. The decode
    and the codec's state update happen in ``wait``, in the order started, so every
    replica decodes the same bytes and ends with the same gradients.
    """

    def __init__(self) -> None:
        self.handles: list = []
        self.queued = False

    def add(self, handle) -> None:
        self.handles.append(handle)
        if self.queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.queued = True
        except RuntimeError:  # not inside a backward pass
            self.finish()

    def finish(self) -> None:
        self.queued = False
        handles, self.handles = self.handles, []
        errors = []
        for handle in handles:  # every one, so no transfer is left running
            try:
                handle.wait()
            except Exception as e:  # noqa: BLE001 - re-raised below, the first one
                errors.append(e)
        if errors:
            raise errors[0]


def _replicate_all_reduce(param_group: Any, policy: Policy, in_flight: InFlight
                          ) -> tuple[ReplicateAllReduce | None, list[Swap]]:
    """The replicate all-reduce of an HSDP parameter group, and the swaps of its meshes
    that switch FSDP's own all-reduce off for it; ``(None, [])`` on a 1-D mesh."""
    mesh_info = param_group.mesh_info
    if not isinstance(mesh_info, HSDPMeshInfo):
        return None, []
    if mesh_info.shard_mesh_size == 1:
        raise InputError(
            "commpress.fsdp.compress: HSDP mesh with a shard dimension of size 1 "
            f"(mesh {tuple(mesh_info.mesh.shape)}) is replication only and FSDP calls no "
            "reduce-scatter to compress; allowed: a shard dimension of size >= 2 (for pure "
            "replication use DDP with commpress.ddp_hook)")
    # the mesh as FSDP's reduction sees it once commpress owns the replicate all-reduce:
    # the shard dimension only (remove() puts the HSDP one back)
    shard_only = FSDPMeshInfo(
        mesh=mesh_info.mesh, shard_mesh_dim=mesh_info.shard_mesh_dim,
        dp_mesh_dims=mesh_info.dp_mesh_dims, spmd_mesh=mesh_info.spmd_mesh)
    shard_only.reduce_scatter_process_group = mesh_info.reduce_scatter_process_group
    swaps = [Swap(param_group, "mesh_info", shard_only)]
    if param_group.post_forward_mesh_info is mesh_info:  # reshard_after_forward=True
        swaps.append(Swap(param_group, "post_forward_mesh_info", shard_only))
    dp = DPBucket(policy, Topology(1), "dp.grad.inter", level="inter")
    return ReplicateAllReduce(dp, mesh_info.replicate_process_group, param_group,
                              in_flight), swaps


def _op_name(op, input_tensor: torch.Tensor) -> str:
    red = dist.ReduceOp
    if op == red.AVG or getattr(op, "op", None) == red.RedOpType.AVG:
        return "avg"
    if op == red.SUM or getattr(op, "op", None) == red.RedOpType.SUM:
        return "sum"
    factor = getattr(op, "factor", None)
    if factor is not None:
        input_tensor.mul_(factor)
        return "sum"
    raise InputError(f"commpress FSDP reduce-scatter: op {op!r} is not supported; "
                     "allowed: AVG, SUM, PREMUL_SUM")


class FSDPCompression:
    """The compressed collectives :func:`compress` installed, by FSDP module name, and
    their codec state.

    A ``torch.distributed.checkpoint`` ``Stateful``: put it next to the model and the
    optimizer in the dict given to ``dcp.save`` / ``dcp.load`` (or ``torch.save`` its
    ``state_dict()`` per rank). Codec state differs between ranks (each rank's residual
    is what its own codes dropped), so each rank's state is one opaque entry under its
    own key ``rank<r>``, as torchtitan keys its data loaders' state: a checkpoint
    holds every rank's, and a tensor entry shared by name would be written by one rank
    only. Inside, the state is keyed by the FSDP module's fully-qualified name (``""``
    for the root). Loading needs the same policy, world size and FSDP modules; on another
    number of ranks give ``dcp.load`` :meth:`elastic` instead, which starts the codecs
    fresh (DCP itself reshards the model and the optimizer).

    Example::

        comm = commpress.fsdp.compress(model, "int2ef")
        dcp.save({"app": app_state, "comm": comm}, checkpoint_id=path)
        dcp.load({"app": app_state, "comm": comm}, checkpoint_id=path)
    """

    def __init__(self, policy: Policy, modules: dict[str, tuple[CompressedAllGather,
                                                                 CompressedReduceScatter]],
                 device: torch.device, swaps: list[Swap]) -> None:
        # hyperparameters
        self.policy = policy
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device
        # internal state: the collectives hold their codecs (and so the codec state)
        self.modules = modules
        self._swaps = swaps  # on FSDP's parameter groups: what remove() gives back
        self._also: list[Callable[[], None]] = []  # adapters' own installs (also_remove)

    def __len__(self) -> int:
        return len(self.modules)

    def remove(self) -> None:
        """Give every FSDP module its own collectives back (HSDP its own replicate
        all-reduce and mesh): training goes on as stock FSDP2 does. Call it between steps;
        the codec state stays readable. Idempotent."""
        if not self._swaps:
            return
        restore(self._swaps)
        self._swaps = []
        for undo in self._also:
            undo()
        log.info("Removed commpress %s from %d FSDP modules", self.policy.name,
                 len(self.modules))

    def also_remove(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at :meth:`remove` too: what an engine's adapter installed beside
        FSDP's collectives under the same handle (torchtitan's expert dispatchers)."""
        self._also.append(undo)

    def fallback_decisions(self) -> dict[str, dict[str, int]]:
        """With ``fallback="measured"``: how many FSDP modules' collectives went each way
        (:func:`commpress.dp.fallback.tally`), HSDP's replicate all-reduces as
        ``dp.grad.inter``; empty without it."""
        buckets = {id(s.dp): s.dp for _, s in self.modules.values()}
        buckets.update({id(s.replicate.dp): s.replicate.dp for _, s in self.modules.values()
                        if s.replicate is not None})
        return tally(c for b in buckets.values() for c in b.choices.values())

    def codec_states(self) -> dict[str, dict[str, Any]]:
        """This rank's codec state by FSDP module name: its :class:`DPBucket`'s
        (``{"grad": ..., "param": ...}``) and, under HSDP, the replicate codec's."""
        states = {}
        for name, (_, scatter) in self.modules.items():
            states[name] = scatter.dp.state_dict()
            if scatter.replicate is not None:
                states[name]["replicate"] = scatter.replicate.dp.state_dict()
        return states

    def state_dict(self) -> dict[str, Any]:
        # the rank's whole state travels as its entry's bytes: DCP loads only the keys
        # the loading run's own state has, so a nested dict could not be compared whole
        buffer = io.BytesIO()
        torch.save(envelope(STATE_FORMAT, self.policy, self.rank, self.world,
                            codecs=self.codec_states()), buffer)
        return {"format": STATE_FORMAT, "world_size": self.world,
                "modules": list(self.modules), f"rank{self.rank}": buffer.getvalue()}

    def load_state_dict(self, state: dict[str, Any], elastic: bool = False) -> None:
        """Restore the codec state; another policy, world size or set of FSDP modules is
        refused with the difference named.

        ``elastic=True`` resumes on another number of ranks (DCP reshards the model and the
        optimizer): the policy and modules are still checked, and the codecs start fresh —
        their error-feedback memory and rounding streams were laid out for the world that
        saved them (said once, on rank 0). With DCP, load :meth:`elastic` in its place."""
        what = "commpress FSDP codec"
        advice = ("resume with the same policy and world size; on another number of ranks "
                  "load comm.elastic() with DCP, or load_state_dict(state, elastic=True)")
        check_saved_state(state, STATE_FORMAT, what,
                          {} if elastic else {"world_size": self.world}, advice)
        _check_module_names(state["modules"], list(self.modules))
        key = f"rank{self.rank}"
        saved_keys = sorted(k for k in state if k.startswith("rank"))
        if key not in state and elastic:
            if not saved_keys:
                raise InputError("FSDP codec checkpoint holds no rank's state; save it with "
                                 "the FSDPCompression of a compressed model")
            key = saved_keys[0]  # only its policy is read
        elif key not in state:
            raise InputError(f"FSDP codec checkpoint holds the state of {saved_keys}, not this "
                             f"rank's ({key!r}); load each rank's own state")
        try:
            entry = torch.load(io.BytesIO(state[key]), map_location=self.device,
                               weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's reader raises several kinds
            raise InputError(f"FSDP codec checkpoint: the entry {key!r} cannot be read "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it is "
                             "truncated or corrupt: resume from an intact checkpoint") from None
        if not check_resume(entry, STATE_FORMAT, what, self.policy, self.rank, self.world,
                            elastic, advice):
            self._fresh_codecs()
            return
        codec_states = entry["codecs"]
        _check_module_names(list(codec_states), list(self.modules))
        for name, (_, scatter) in self.modules.items():
            saved = codec_states[name]
            _check_same(f"HSDP replicate codec of module {name!r}", "replicate" in saved,
                        scatter.replicate is not None)
            scatter.dp.load_state_dict({k: v for k, v in saved.items() if k != "replicate"})
            if scatter.replicate is not None:
                scatter.replicate.dp.load_state_dict(saved["replicate"])

    def elastic(self) -> _ElasticLoad:
        """The ``Stateful`` to give ``dcp.load`` in this one's place when the checkpoint
        was saved on another number of ranks: it reads only what every rank saved alike
        (and rank 0's entry, for its policy), then starts the codecs fresh as
        ``load_state_dict(state, elastic=True)`` does. Example::

            dcp.load({"app": app_state, "comm": comm.elastic()}, checkpoint_id=path)
        """
        return _ElasticLoad(self)

    def _fresh_codecs(self) -> None:
        for _, scatter in self.modules.values():
            scatter.dp.fresh()
            if scatter.replicate is not None:
                scatter.replicate.dp.fresh()


class _ElasticLoad:
    """:meth:`FSDPCompression.elastic`: the keys every saved world has, for ``dcp.load``."""

    def __init__(self, compression: FSDPCompression) -> None:
        self.compression = compression

    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "world_size": 0, "modules": [], "rank0": b""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compression.load_state_dict(state, elastic=True)


def _agree_on_compress(model: nn.Module, policy: Policy) -> None:
    """Every rank of the model's data-parallel groups (the shard group, and HSDP's
    replicate group) compresses the same FSDP modules with the same policy. A rank that
    does not goes on to FSDP's own collectives on those groups, so the ranks first meet
    through the store (naming one that never comes), then agree over each group."""
    names = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    groups = next(([info.shard_process_group] + ([info.replicate_process_group]
                                                  if isinstance(info, HSDPMeshInfo) else [])
                   for module in model.modules() if isinstance(module, FSDPModule)
                   for info in (g.mesh_info for g in
                                module._get_fsdp_state()._fsdp_param_groups)), [])
    for group in groups:
        rendezvous(group, "fsdp.compress")
    fields = {"label": "dp", "policy": policy.to_dict(), "modules": names}
    agree_across("fsdp.compress", [(group, fields) for group in groups])


def _param_rule(policy: Policy) -> Rule:
    """The weights' rule: ``dp.param``'s, or exact where it asks for differences."""
    rule = policy.rule("dp", "param")
    return Rule() if rule.delta else rule


def _check_same(key: str, saved: Any, mine: Any) -> None:
    if saved != mine:
        raise InputError(f"FSDP codec checkpoint {key} {saved!r} does not match this run's "
                         f"{mine!r}; resume with the same {key}")


def _check_module_names(saved: list[str], mine: list[str]) -> None:
    if saved == mine:
        return
    missing = [n for n in mine if n not in saved]
    extra = [n for n in saved if n not in mine]
    raise InputError(f"FSDP codec checkpoint was saved for other FSDP modules: this model's "
                     f"{missing} are not in it, its {extra} are not in this model (names "
                     "as model.named_modules() gives them); shard the model the same way "
                     "(the same fully_shard calls) before loading")


def compress(model: nn.Module, policy: str | dict | Policy = "sdp4bit",
             topology: Topology | None = None, *,
             fallback: str | None = None) -> FSDPCompression:
    """Install compressed collectives on every FSDPModule in ``model``.

    Call after ``fully_shard``. Returns the :class:`FSDPCompression` holding them (its
    ``len`` is the number of FSDP modules): checkpoint it with the model and optimizer.
    Example::

        for block in model.blocks: fully_shard(block)
        fully_shard(model)
        comm = commpress.fsdp.compress(model, "zeropp")

    ``fallback="measured"``: each FSDP module's collectives are timed compressed and exact
    in their first calls and stay compressed only where faster
    (:mod:`commpress.dp.fallback`); None: the policy's.
    """
    policy = Policy.resolve(policy).with_fallback(fallback)
    topology = topology or Topology()
    _agree_on_compress(model, policy)
    param_rule = policy.rule("dp", "param")
    if param_rule.delta:
        log.warning("commpress.fsdp: policy %s asks for weight differences (qWD) on dp.param, "
                    "which FSDP2 cannot keep; weights are all-gathered exactly", policy.name)
    modules: dict[str, tuple[CompressedAllGather, CompressedReduceScatter]] = {}
    swaps: list[Swap] = []
    in_flight = InFlight()
    by_state: dict[int, tuple[CompressedAllGather, CompressedReduceScatter]] = {}
    try:
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            if id(state) in by_state:  # fully_shard([a, b]): modules sharing one FSDP state
                modules[name] = by_state[id(state)]
                continue
            dp = DPBucket(policy, topology, weights=True, param_rule=_param_rule(policy))
            gather, scatter = CompressedAllGather(dp), CompressedReduceScatter(dp)
            param_groups = state._fsdp_param_groups
            if len(param_groups) > 1:
                raise InputError(f"commpress.fsdp.compress: FSDP module {name!r} has "
                                 f"{len(param_groups)} parameter groups (a per-parameter mesh "
                                 "from shard_placement_fn); allowed: one, as FSDP's own "
                                 "set_custom_all_gather allows")
            for param_group in param_groups:
                if isinstance(param_group._all_gather_comm, CompressedAllGather):
                    raise InputError(f"commpress.fsdp.compress: FSDP module {name!r} is "
                                     "compressed already; remove() the first compression "
                                     "before compressing it again")
                scatter.replicate, meshes = _replicate_all_reduce(param_group, policy,
                                                                  in_flight)
                swaps += install([Swap(param_group, "_all_gather_comm", gather),
                                  Swap(param_group, "_reduce_scatter_comm", scatter), *meshes])
            modules[name] = by_state[id(state)] = (gather, scatter)
    except BaseException:
        restore(swaps)
        raise
    if not modules:
        raise InputError("commpress.fsdp.compress: no FSDPModule found; call fully_shard first")
    device = next(model.parameters()).device
    hsdp = sum(scatter.replicate is not None for _, scatter in modules.values())
    if hsdp:
        log.info("commpress.fsdp: HSDP replicate all-reduce of %d FSDP modules through "
                 "the inter-node codec (dp.grad.inter)", hsdp)
    log.info("Applied commpress %s to %d FSDP modules", policy.name, len(modules))
    return FSDPCompression(policy, modules, device, swaps)

