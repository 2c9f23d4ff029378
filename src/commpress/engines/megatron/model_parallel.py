"""Tensor and pipeline parallelism inside Megatron-core: activations and their gradients
through the policy's ``tp`` and ``pp`` codecs.

**Tensor parallelism.** Megatron's autograd functions in
``megatron/core/tensor_parallel/mappings.py`` communicate through the module-level
``_reduce`` (all-reduce), ``dist_all_gather_func`` and ``dist_reduce_scatter_func``;
its sequence-parallel linear layers (``layers.py``) through their own two. Every
function's ``forward`` is marked as carrying activations (``tp.act``) and its
``backward`` their gradients (``tp.act_grad``), and the module-level collectives,
replaced, read that mark. Column-parallel layers all-reduce their input gradient
inside their matmul's backward with a direct ``torch.distributed.all_reduce``
(``allreduce_dgrad``); :func:`route_dgrad_through_mappings` makes the layers of the
covered model take Megatron's other path — the identity function whose backward
all-reduces (``copy_to_tensor_model_parallel_region``) — which sums the same values
in the same order. Both ranks decode the same bytes, so activations, and the
parameters every TP rank holds a replica of, stay identical across TP ranks.

**Pipeline parallelism.** Stage-to-stage transfers of
``pipeline_parallel/p2p_communication.py`` go through its ``_batched_p2p_ops``:
sends to the next stage and receives from the previous one are activations
(``pp.act``), the other direction their gradients (``pp.act_grad``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.tensor_parallel import layers, mappings

from commpress.codecs.error_feedback import coder_state, load_coder_state
from commpress.collectives import P2POp, all_gather, all_reduce, batch_isend_irecv, reduce_scatter
from commpress.engines.megatron.seams import REGISTRY, Direction
from commpress.engines.seam import Swap
from commpress.policy import Policy
from commpress.validate import InputError

KINDS = ("act", "act_grad")


class ActivationComm:
    """The codecs of one tensor- or pipeline-parallel group's activations (``act``) and
    their gradients (``act_grad``), the memories of their sends where the policy asks for
    error feedback (pipeline only: ``apply`` refuses it on tensor parallelism), and so
    their state."""

    def __init__(self, axis: str, group: dist.ProcessGroup, policy: Policy) -> None:
        self.axis, self.group = axis, group
        self.fresh_codecs(policy)

    def fresh_codecs(self, policy: Policy) -> None:
        """New codecs, with no state (an elastic resume)."""
        self.codecs = {kind: policy.codec_for(self.axis, kind) for kind in KINDS}
        self.memories = {kind: policy.memory_for(self.axis, kind) for kind in KINDS}

    def label(self, kind: str) -> str:
        return f"{self.axis}.{kind}"

    def state_dict(self) -> dict[str, Any]:
        return {kind: coder_state(c, self.memories[kind]) for kind, c in self.codecs.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for kind, c in self.codecs.items():
            load_coder_state(c, self.memories[kind], state[kind])


# -- tensor parallelism -------------------------------------------------------------------

_direction = Direction()  # the TP direction (act, act_grad) a mapping runs in


def _covered(group: Any, kind: str | None = None) -> tuple[Any, str] | None:
    """``(codec, label)`` when ``group`` is a covered TP group and the direction is known."""
    comm = REGISTRY.tp.get(group)
    kind = kind or _direction.kind
    if comm is None or kind is None:
        return None
    return comm.codecs[kind], comm.label(kind)


def tp_reduce(input_: torch.Tensor, group: Any) -> torch.Tensor:
    """Replaces ``mappings._reduce``: the TP all-reduce (sum) of a covered group."""
    found = _covered(group)
    if found is None:
        return TP_REDUCE.original(input_, group)
    if group.size() > 1:
        all_reduce(input_, found[0], group=group, op="sum", label=found[1])
    return input_


def _gather(swap: Swap, kind: str | None):
    def gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        found = _covered(group, kind)
        if found is None:
            return swap.original(output, input, group=group, async_op=async_op)
        result = all_gather(output, input.contiguous(), found[0], group=group, label=found[1],
                            async_op=async_op)
        return result if async_op else None
    return gather


def _scatter(swap: Swap, kind: str | None):
    def scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                async_op: bool = False):
        found = _covered(group, kind)
        if found is None:
            return swap.original(output, input, op=op, group=group, async_op=async_op)
        if op != dist.ReduceOp.SUM:
            raise InputError(f"commpress.megatron: tensor-parallel reduce-scatter op {op!r} is "
                             "not supported; allowed: SUM")
        result = reduce_scatter(output, input.contiguous(), found[0], group=group, op="sum",
                                label=found[1], async_op=async_op)
        return result if async_op else None
    return scatter


def _directed(fn, kind: str) -> staticmethod:
    def run(*args, **kwargs):
        with _direction(kind):
            return fn(*args, **kwargs)
    return staticmethod(run)


# every autograd function of mappings.py that communicates on the TP group (the MoE
# all-to-all is not covered: apply refuses MoE models)
_FUNCTIONS = ("_CopyToModelParallelRegion", "_ReduceFromModelParallelRegion",
              "_ScatterToModelParallelRegion", "_GatherFromModelParallelRegion",
              "_ScatterToSequenceParallelRegion", "_GatherFromSequenceParallelRegion",
              "_ReduceScatterToSequenceParallelRegion", "_AllGatherFromTensorParallelRegion",
              "_ReduceScatterToTensorParallelRegion")


TP_REDUCE = Swap(mappings, "_reduce", tp_reduce)
_TP_GATHER = Swap(mappings, "dist_all_gather_func", None)
_TP_SCATTER = Swap(mappings, "dist_reduce_scatter_func", None)
_TP_GATHER.replacement = _gather(_TP_GATHER, None)
_TP_SCATTER.replacement = _scatter(_TP_SCATTER, None)
# sequence-parallel linear layers: their all-gathers carry activations (the backward's
# too: it gathers the input again for the weight gradient), the reduce-scatter gradients
_SP_GATHER = Swap(layers, "dist_all_gather_func", None)
_SP_SCATTER = Swap(layers, "dist_reduce_scatter_func", None)
_SP_GATHER.replacement = _gather(_SP_GATHER, "act")
_SP_SCATTER.replacement = _scatter(_SP_SCATTER, "act_grad")
_DIRECTION_SWAPS = [Swap(cls, method, _directed(vars(cls)[method].__func__, kind))
                    for cls in (getattr(mappings, name) for name in _FUNCTIONS)
                    for method, kind in (("forward", "act"), ("backward", "act_grad"))]
TP_SWAPS = [TP_REDUCE, _TP_GATHER, _TP_SCATTER, _SP_GATHER, _SP_SCATTER, *_DIRECTION_SWAPS]


def route_dgrad_through_mappings(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Make the column-parallel layers of the model chunks all-reduce their input gradient
    in ``_CopyToModelParallelRegion.backward`` instead of inside their matmul's backward;
    returns the layers changed (for :func:`restore_dgrad`)."""
    changed = []
    for m in (m for c in chunks for m in c.modules()):
        if isinstance(m, layers.ColumnParallelLinear) and m.allreduce_dgrad:
            m.allreduce_dgrad = False
            changed.append(m)
    return changed


def restore_dgrad(changed: list[torch.nn.Module]) -> None:
    for m in changed:
        m.allreduce_dgrad = True


# -- pipeline parallelism -----------------------------------------------------------------


def batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                    group, prev_pipeline_rank: int, next_pipeline_rank: int):
    """Replaces ``_batched_p2p_ops``: a covered pipeline group's transfers, in Megatron's
    order, as commpress handles (``wait()`` decodes a receive in place)."""
    comm = REGISTRY.pp.get(group)
    if comm is None:
        return PP_BATCHED.original(
            tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
            tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next, group=group,
            prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)
    prev = dist.get_group_rank(group, prev_pipeline_rank)
    nxt = dist.get_group_rank(group, next_pipeline_rank)
    ops = []
    for op, tensor, peer, kind in (("send", tensor_send_prev, prev, "act_grad"),
                                   ("recv", tensor_recv_prev, prev, "act"),
                                   ("send", tensor_send_next, nxt, "act"),
                                   ("recv", tensor_recv_next, nxt, "act_grad")):
        if tensor is not None:
            # receives land in Megatron's leaf tensors (requires_grad): write through a view
            ops.append(P2POp(op, tensor.detach(), peer, comm.codecs[kind], group,
                             comm.label(kind),
                             memory=comm.memories[kind] if op == "send" else None))
    return batch_isend_irecv(ops) if ops else []


def p2p_ops(*, group, **kwargs):
    """Replaces ``_p2p_ops`` (Megatron's unbatched transfers): refused for a covered group,
    where it would pass uncompressed (``apply`` refuses ``batch_p2p_comm=False``)."""
    if group in REGISTRY.pp:
        raise RuntimeError("commpress.megatron: unbatched pipeline transfers (batch_p2p_comm="
                           "False, overlap_p2p_comm) are not covered; set batch_p2p_comm=True")
    return PP_UNBATCHED.original(group=group, **kwargs)


PP_BATCHED = Swap(p2p, "_batched_p2p_ops", batched_p2p_ops)
PP_UNBATCHED = Swap(p2p, "_p2p_ops", p2p_ops)
PP_SWAPS = [PP_BATCHED, PP_UNBATCHED]
