"""Thin wrappers over torch.distributed: group defaults, API-version compatibility,
and the byte exchanges (all-to-all, all-gather) that the compressed collectives use."""

from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commpress.validate import InputError

ReduceOpName = str  # "avg" | "sum"
REDUCE_OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}


# A Gloo worker thread drops its finished work (and the last reference to the work's
# tensors) just after the work's future completes. If the interpreter is finalizing by then,
# the tensor's Python object cannot take the GIL and the process aborts ("terminate called
# without an active exception", SIGABRT) after the script's last line, on any rank whose
# worker was a little late. A short wait at exit, while the interpreter is still whole and
# the GIL free, lets every worker finish first. The hazard is torch's (a plain DDP or
# ZeroRedundancyOptimizer script shows it too); the wait applies to any process that imported
# commpress and had a process group: initialized by torch.distributed (still set after
# destroy_process_group) or handed to commpress (torchft makes its groups outside it).
EXIT_GRACE_S = 0.2
_handed_a_group = False


def _had_a_process_group() -> bool:
    c10d = dist.distributed_c10d
    return (_handed_a_group or dist.is_initialized()
            or getattr(c10d, "_default_pg_init_method", None) is not None)


@atexit.register
def _wait_for_gloo_workers() -> None:
    if _had_a_process_group():
        time.sleep(EXIT_GRACE_S)


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the world. A group the caller hands over may be one torch.distributed
    never registered (torchft's reconfigurable groups are made outside it)."""
    global _handed_a_group
    _handed_a_group = True
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError("commpress collectives need torch.distributed to be initialized "
                           "(torch.distributed.init_process_group), or a process group")
    return dist.group.WORLD


def registered(group: dist.ProcessGroup) -> bool:
    """Whether torch.distributed knows ``group`` (made by ``init_process_group`` or
    ``new_group``, not destroyed)."""
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


def rank_in(group: dist.ProcessGroup) -> int:
    """This process's rank in ``group``, registered or not."""
    return dist.get_rank(group) if registered(group) else group.rank()


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """``group``'s timeout (default: the default group's), for the sub-groups made from it:
    torch gives a new group its backend's default (30 min on Gloo, 10 on NCCL), not the
    timeout the group it is carved from was created with. None if the backend hides it."""
    pg = resolve_group(group)
    for device in pg._device_types:
        timeout = getattr(getattr(pg._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise InputError(f"op={op!r} is not allowed; allowed: {', '.join(REDUCE_OPS)}")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: str, group,
                          async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=REDUCE_OPS[op], group=group, async_op=async_op)


class Exchange:
    """An all-to-all of per-destination byte rows, started at construction.

    ``rows`` is either a ``(world, row_bytes)`` uint8 tensor (fixed-rate codecs: every
    row has the same size) or a list of ``world`` 1-D tensors of any sizes (and one
    dtype). For a list, every source's row for this rank has ``received`` elements when
    given (uneven parts of a fixed-rate codec), or ``received[j]`` from source ``j`` (an
    all-to-all whose splits both sides know), else the sizes are exchanged first
    (variable-rate codecs). ``wait()`` returns what each source rank sent this rank: a
    ``(world, ·)`` tensor, or a list.
    """

    def __init__(self, rows: torch.Tensor | list[torch.Tensor], group,
                 received: int | list[int] | None = None) -> None:
        self.group = group
        self.sizes: list[int] | None = None
        if isinstance(rows, torch.Tensor):
            self.recv = torch.empty_like(rows)
            self.work = dist.all_to_all_single(self.recv, rows, group=group, async_op=True)
            return
        send_sizes = [r.numel() for r in rows]
        if received is None:
            sizes_t = torch.tensor(send_sizes, dtype=torch.int64, device=rows[0].device)
            recv_sizes_t = torch.empty_like(sizes_t)
            dist.all_to_all_single(recv_sizes_t, sizes_t, group=group)
            self.sizes = recv_sizes_t.tolist()
            self.recv = torch.empty(sum(self.sizes), dtype=torch.uint8, device=rows[0].device)
            recv_sizes = self.sizes
        elif isinstance(received, list):
            self.sizes = recv_sizes = received
            self.recv = torch.empty(sum(received), dtype=rows[0].dtype, device=rows[0].device)
        else:
            self.recv = torch.empty(len(rows), received, dtype=torch.uint8,
                                    device=rows[0].device)
            recv_sizes = [received] * len(rows)
        self.work = dist.all_to_all_single(
            self.recv.view(-1), torch.cat(rows), output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes, group=group, async_op=True)

    def wait(self) -> torch.Tensor | list[torch.Tensor]:
        self.work.wait()
        if self.sizes is None:
            return self.recv
        return list(torch.split(self.recv, self.sizes))


class Gather:
    """An all-gather of one byte row per rank (any sizes), started at construction."""

    def __init__(self, row: torch.Tensor, fixed_size: bool, group) -> None:
        world = dist.get_world_size(group)
        self.sizes: list[int] | None = None
        if not fixed_size:
            size = torch.tensor([row.numel()], dtype=torch.int64, device=row.device)
            all_sizes = torch.empty(world, dtype=torch.int64, device=row.device)
            all_gather_single(all_sizes, size, group)
            self.sizes = all_sizes.tolist()
            padded = torch.zeros(max(self.sizes), dtype=torch.uint8, device=row.device)
            padded[: row.numel()] = row
            row = padded
        self.recv = torch.empty(world * row.numel(), dtype=row.dtype, device=row.device)
        self.work = all_gather_single(self.recv, row, group, async_op=True)
        self.world, self.width = world, row.numel()

    def wait(self) -> torch.Tensor | list[torch.Tensor]:
        self.work.wait()
        rows = self.recv.view(self.world, self.width)  # width 0 (an empty shard) too
        if self.sizes is None:
            return rows
        return [rows[i, :s] for i, s in enumerate(self.sizes)]


def check_sizes(collective: str, full: torch.Tensor, part: torch.Tensor, world: int,
                full_name: str, part_name: str) -> None:
    """``full`` must hold ``world × part.numel()`` elements of ``part``'s dtype."""
    if full.numel() != world * part.numel() or full.dtype != part.dtype:
        raise InputError(f"{collective}: {full_name} must have world_size ({world}) × "
                         f"{part_name}.numel() ({part.numel()}) elements and {part_name}'s "
                         f"dtype; got {full.numel()} elements of {full.dtype} for {part.dtype}")


def describe(x: torch.Tensor) -> dict[str, Any]:
    """What ranks must agree on about a tensor: its size, dtype and device type."""
    return {"numel": x.numel(), "dtype": str(x.dtype).removeprefix("torch."),
            "device": x.device.type}
