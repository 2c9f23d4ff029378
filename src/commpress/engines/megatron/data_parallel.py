"""Data parallelism inside Megatron's DDP: its buckets' gradient reduce-scatter or
all-reduce and the distributed optimizer's weight all-gather, through the policy's
``dp`` codecs.

Megatron issues them from ``_ParamAndGradBucketGroup`` in
``megatron/core/distributed/param_and_grad_buffer.py``, by way of three module-level
names — ``dist_reduce_scatter_func``, ``dist_all_gather_func`` and
``_coalescing_manager`` — and, without the distributed optimizer, a direct
``torch.distributed.all_reduce``. All four are replaced (:data:`SWAPS`); Megatron's
bucketing, overlap, gradient scaling and averaging run unchanged around them. torch's
coalescing manager cannot hold commpress's collectives (each starts with a small
exchange that checks the ranks agree, which the manager swallows, and its handle then
fails with "Illegal to call wait on IllegalWork object"), so the replacement collects
commpress's handles itself and enters torch's manager only for buckets no policy
covers.

Each Megatron bucket gets a :class:`BucketComm`: its gradient codecs
(:class:`~commpress.frontends.GradPath`: one level, or TLq-HS's two), its weight
codec and — for qWD — the reference its differences are taken against. Megatron's
optimizer writes this rank's new weights into its slice of the bucket before the
all-gather, over the weights every rank holds, so the reference (this rank's slice as
used in the step, copied at the gradient reduce-scatter) is kept aside: the slice is
put back to it, the difference to the new weights is sent, and every rank, the owner
too, applies the same decoded difference.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import param_and_grad_buffer as pgb

from commpress.collectives import Handle, Topology
from commpress.dp import DPBucket
from commpress.engines.megatron.layout import Layout
from commpress.engines.megatron.seams import REGISTRY, ModuleView
from commpress.engines.seam import Swap
from commpress.policy import Policy
from commpress.validate import InputError


class BucketComm:
    """One Megatron bucket's collectives and codec state.

    Slots: identity (``key``, ``names``, the Megatron ``bucket``, its ``group``);
    internal state (``dp``: the bucket's codecs and qWD reference; the wire layouts); the
    process group is Megatron's.
    """

    def __init__(self, key: str, names: list[str], bucket: Any, group: dist.ProcessGroup,
                 policy: Policy, topology: Topology,
                 identical: dict[str, torch.Tensor | None],
                 distributed_optimizer: bool) -> None:
        # identity
        self.key, self.names, self.bucket, self.group = key, names, bucket, group
        self.rank, self.world = group.rank(), group.size()
        # internal state
        self.dp = DPBucket(policy, topology, weights=True)
        # per kind ("grad", "param"): elements equal on every TP rank, when the bucket
        # mixes them with others (see layout.py)
        self.identical = identical
        self.distributed_optimizer = distributed_optimizer
        if distributed_optimizer:
            self.dp.follow(self.shard(bucket.param_data))
        self._layouts: dict[tuple[int, int], Layout] = {}

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a bucket tensor (Megatron's ``shard_buffer``)."""
        m = t.numel() // self.world
        return t.view(-1)[self.rank * m:(self.rank + 1) * m]

    def _layout(self, kind: str, lossy: bool, unit: int, rows: int) -> Layout | None:
        if self.identical[kind] is None or not lossy:
            return None
        key = (kind, max(unit, 1), rows)
        if key not in self._layouts:
            self._layouts[key] = Layout(self.identical[kind], rows, key[1])
        return self._layouts[key]

    # -- the collectives Megatron calls ---------------------------------------------
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        """Megatron's gradient reduce-scatter of this bucket into this rank's slice."""
        dp = self.dp
        if self.distributed_optimizer:
            # during backward every slice holds the weights this step used, the ones the
            # next difference is taken against: whatever wrote them (the last gather, a
            # checkpoint load, broadcast_params), the reference follows
            dp.follow(self.shard(self.bucket.param_data))
        layout = self._layout("grad", dp.grad_lossy, dp.grad_alignment, self.world)
        if layout is None:
            return dp.reduce_scatter(output, input, self.group, op=op, async_op=True)
        wire = layout.to_wire(input)
        out = torch.empty(layout.width, dtype=input.dtype, device=input.device)
        handle = dp.reduce_scatter(out, wire.view(-1), self.group, op=op, async_op=True)

        def finish() -> torch.Tensor:
            handle.wait()
            layout.row_from_wire(out, self.rank, output)
            return output

        return Handle(finish)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        """Megatron's gradient all-reduce of this bucket (no distributed optimizer)."""
        # one row; each kind padded to world × alignment, so that no rank's chunk of any
        # stage (one or two levels) puts the two kinds in one group
        dp = self.dp
        layout = self._layout("grad", dp.grad_lossy, dp.grad_alignment * self.world, 1)
        if layout is None:
            return dp.all_reduce(tensor, self.group, op=op, async_op=True)
        wire = layout.to_wire(tensor).view(-1)
        handle = dp.all_reduce(wire, self.group, op=op, async_op=True)

        def finish() -> torch.Tensor:
            handle.wait()
            layout.from_wire(wire, tensor)
            return tensor

        return Handle(finish)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """The distributed optimizer's weight all-gather: ``input`` is this rank's slice of
        ``output`` holding the optimizer's new weights."""
        dp = self.dp
        new = dp.take_new_weights(input)  # qWD: input holds what every rank holds again
        layout = self._layout("param", dp.weights_lossy, dp.weights_alignment, self.world)
        if layout is None:
            handle = dp.gather_weights(output, new, self.group, async_op=True)
            wire = None
        else:
            wire = (layout.to_wire(output) if dp.sends_differences else
                    output.new_empty(self.world, layout.width))
            handle = dp.gather_weights(wire.view(-1), layout.row_to_wire(new, self.rank),
                                       self.group, async_op=True)

        def finish() -> torch.Tensor:
            handle.wait()
            if wire is not None:
                layout.from_wire(wire, output)
            dp.weights_gathered(input)
            return output

        return Handle(finish)

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, **self.dp.state_dict()}

    def load_state_dict(self, state: dict[str, Any], memory: bool = True) -> None:
        """Restore :meth:`state_dict`; ``memory=False`` checks it and starts the codecs
        fresh, the qWD reference following the loaded weights (an elastic resume)."""
        if state["names"] != self.names:
            raise InputError(f"Megatron codec checkpoint: bucket {self.key} held {state['names']}"
                             f", this model's holds {self.names}; resume with the same model, "
                             "bucket size and parallel layout")
        self.dp.load_state_dict({k: v for k, v in state.items() if k != "names"}, memory)


def op_name(op: Any) -> str:
    """Megatron's ``ReduceOp`` as commpress's op name."""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    raise InputError(f"commpress.megatron: gradient reduce op {op!r} is not supported; "
                     "allowed: SUM, AVG")


# -- the replacements -------------------------------------------------------------------

_LOCAL = threading.local()


class Batch:
    """What the replaced ``_coalescing_manager`` yields: commpress's handles for the
    covered buckets, and torch's own manager, entered only for buckets no policy covers.
    ``wait()`` finishes them all (Megatron calls it when ``async_ops``)."""

    def __init__(self, group: Any, device: Any, async_ops: bool) -> None:
        self.group, self.device, self.async_ops = group, device, async_ops
        self.handles: list[Handle] = []
        self._stack = ExitStack()
        self._torch = None

    def passthrough(self, fn, *args, **kwargs):
        if self._torch is None:
            self._torch = self._stack.enter_context(
                CM.original(self.group, self.device, self.async_ops))
        return fn(*args, **kwargs)

    def close(self) -> None:
        self._stack.close()
        if not self.async_ops:
            self.wait()

    def wait(self) -> None:
        if self._torch is not None and self.async_ops:
            self._torch.wait()
        handles, self.handles = self.handles, []
        for h in handles:
            h.wait()


def _current() -> Batch | None:
    batches = getattr(_LOCAL, "batches", None)
    return batches[-1] if batches else None


@contextmanager
def coalescing_manager(group=None, device=None, async_ops: bool = False) -> Iterator[Batch]:
    """Replaces torch's ``_coalescing_manager`` in Megatron's bucket code."""
    broken = [s.describe() for s in SWAPS if not s.intact()]
    if broken:
        raise RuntimeError(
            f"commpress.megatron: {', '.join(broken)} was replaced after commpress applied its "
            "policy (a DistributedDataParallel built with reduce_scatter_with_fp32_accumulation "
            "does that), so gradients or weights would travel uncompressed; build every model "
            "before commpress.megatron.compress, without reduce_scatter_with_fp32_accumulation")
    batch = Batch(group, device, async_ops)
    stack = _LOCAL.__dict__.setdefault("batches", [])
    stack.append(batch)
    try:
        yield batch
    finally:
        stack.pop()
    batch.close()


def _issue(handle: Handle, async_op: bool) -> Handle | None:
    batch = _current()
    if batch is not None:
        batch.handles.append(handle)
        return handle
    if async_op:
        return handle
    handle.wait()
    return None


def _passthrough(fn, *args, **kwargs):
    batch = _current()
    if batch is None:
        return fn(*args, **kwargs)
    return batch.passthrough(fn, *args, **kwargs)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group=None, async_op: bool = False):
    """Replaces ``dist_reduce_scatter_func``: a covered bucket's gradients → ``dp.grad``."""
    comm = REGISTRY.bucket(input, "grad_data")
    if comm is None:
        return _passthrough(RS.original, output, input, op=op, group=group, async_op=async_op)
    return _issue(comm.reduce_scatter(output, input, op_name(op)), async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False):
    """Replaces ``dist_all_gather_func``: a covered bucket's weights → ``dp.param``."""
    comm = REGISTRY.bucket(output, "param_data")
    if comm is None:
        return _passthrough(AG.original, output, input, group=group, async_op=async_op)
    return _issue(comm.all_gather(output, input), async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """Replaces the ``torch.distributed.all_reduce`` Megatron's bucket code calls without
    the distributed optimizer: a covered bucket's gradients → ``dp.grad``."""
    comm = REGISTRY.bucket(tensor, "grad_data")
    if comm is None:
        return _passthrough(dist.all_reduce, tensor, op=op, group=group, async_op=async_op)
    return _issue(comm.all_reduce(tensor, op_name(op)), async_op)


RS = Swap(pgb, "dist_reduce_scatter_func", reduce_scatter_tensor)
AG = Swap(pgb, "dist_all_gather_func", all_gather_into_tensor)
CM = Swap(pgb, "_coalescing_manager", coalescing_manager)
# the bucket code's own view of torch: only torch.distributed.all_reduce differs
TORCH = Swap(pgb, "torch", ModuleView(torch, {
    "distributed": ModuleView(torch.distributed, {"all_reduce": all_reduce})}))
SWAPS = [RS, AG, CM, TORCH]
