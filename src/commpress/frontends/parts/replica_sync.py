"""Keep data-parallel replicas identical where no optimizer step reaches: the weights at
the start, frozen parameters, and buffers (a BatchNorm's running statistics).

DDP broadcasts the first rank's parameters and buffers at construction, and the buffers
again before every forward (``broadcast_buffers=True``): each rank's forward moves its
running statistics by its own batch, so without it they drift apart. The sharded
optimizer does the same once per ``step()``, all buffers in one coalesced broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.collectives import CollectiveMismatchError
from commpress.collectives.agreement import agree
from commpress.collectives.comm import all_gather_single
from commpress.frontends.parts.buckets import Bucket, checksum


def group_source(group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group``'s first rank (the broadcast source)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


@torch.no_grad()
def sync_initial_state(model: nn.Module | None, buckets: list[Bucket], group: dist.ProcessGroup,
                       rank: int, world: int, how: str) -> None:
    """Make (``how="broadcast"``) or check (``"verify"``) every replica start from the
    first rank's state: the buckets, and — as DDP does — the frozen parameters and every
    buffer, which no step ever brings together."""
    src = group_source(group)
    device = buckets[0].param_buffer.device
    in_buckets = {id(p) for b in buckets for p in b.params}
    others = []  # without a module (parameters given): no frozen parameters or buffers
    if model is not None:
        others += [(f"parameter {n!r}", p) for n, p in model.named_parameters()
                   if id(p) not in in_buckets]
        others += [(f"buffer {n!r}", t) for n, t in model.named_buffers()]
    if how == "broadcast":
        agree(group, "broadcast", label="initial weights", src=src,
              numels=[b.param_buffer.numel() for b in buckets])
        for b in buckets:
            dist.broadcast(b.param_buffer, src=src, group=group)
            b.reset_master(rank, world)
        broadcast_coalesced([t for _, t in others], src, group, device, "initial state")
        return
    items = [(f"the bucket holding {b.names[0]!r}", b.param_buffer) for b in buckets]
    names, tensors = zip(*items, *others)
    differ, every = differing_ranks(tensors, group, device)
    if differ:
        first = next(name for name, same in zip(names, (every == every[0]).all(dim=0))
                     if not same)
        raise CollectiveMismatchError(
            f"ShardedOptimizer(init_sync='verify'): data-parallel ranks {differ} start "
            f"from other weights than rank 0 (first difference: {first}); initialize "
            "every replica from the same seed, or use init_sync='broadcast'")


def differing_ranks(tensors: list[torch.Tensor], group: dist.ProcessGroup,
                    device: torch.device) -> tuple[list[int], torch.Tensor]:
    """``group``'s ranks whose ``tensors`` differ from its first rank's, and every checksum."""
    agree(group, "all_gather", label="replica check", tensors=len(tensors))
    mine = torch.tensor([checksum(t) for t in tensors], dtype=torch.int64, device=device)
    every = mine.new_empty(group.size() * mine.numel())
    all_gather_single(every, mine, group)
    every = every.view(group.size(), -1)
    return [r for r in range(group.size()) if not torch.equal(every[r], every[0])], every


@torch.no_grad()
def broadcast_buffers(model: nn.Module, group: dist.ProcessGroup,
                      device: torch.device) -> None:
    """Copy the first rank's buffers to every rank of ``group`` (one collective; none
    without buffers)."""
    broadcast_coalesced(list(model.buffers()), group_source(group), group, device, "buffers")


def broadcast_coalesced(tensors: list[torch.Tensor], src: int,
                        group: dist.ProcessGroup | None, device: torch.device,
                        label: str) -> None:
    """Broadcast ``tensors`` (any dtypes, shapes, bool included) in one collective: their
    bytes packed into one buffer, copied back in place."""
    if not tensors:
        return
    parts = [t.detach().reshape(-1).contiguous().view(torch.uint8).to(device) for t in tensors]
    flat = torch.cat(parts)
    agree(group, "broadcast", label=label, src=src, bytes=flat.numel())
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for t, part in zip(tensors, parts):
        # a fresh copy: viewing bytes as a wider dtype needs an aligned start
        t.copy_(flat[offset : offset + part.numel()].clone().view(t.dtype).view(t.shape))
        offset += part.numel()
