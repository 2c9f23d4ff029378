"""Compressed point-to-point transfers for pipeline parallelism.

``send``/``recv`` move one encoded tensor between two ranks; ``isend``/``irecv`` return
handles, and :func:`batch_isend_irecv` posts several at once for a pipeline
schedule. The receiver passes a tensor of the sender's shape and dtype and gets the
decoded values in place. Fixed-rate codecs send exactly ``wire_bytes(numel)``;
variable-rate codecs send an 8-byte size first, which ``irecv`` awaits before it
returns (so it blocks until the sender has posted its send).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from commpress.codecs import packet_to_bytes
from commpress.collectives import chunks
from commpress.collectives.comm import resolve_group
from commpress.collectives.handle import Handle
from commpress.collectives.reduce_scatter import check_float, resolve_codec
from commpress.collectives.stats import record, timed


def _global(group: dist.ProcessGroup, peer: int) -> int:
    return dist.get_global_rank(group, peer) if group is not dist.group.WORLD else peer


def isend(tensor: torch.Tensor, dst: int, codec="none", group: dist.ProcessGroup | None = None,
          label: str | None = None, tag: int = 0) -> Handle:
    """Start sending ``tensor`` encoded with ``codec`` to group rank ``dst``."""
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_float("tensor", tensor)
    label = label or "p2p"
    peer = _global(group, dst)
    with timed(label, "encode_s", tensor.device):
        packet = chunks.encode(codec, tensor, stream=dist.get_rank(), key=f"{label}->{dst}")
        payload = packet_to_bytes(packet)
    record(label, calls=1, elements=tensor.numel(), wire_bytes=payload.numel(),
           raw_bytes=tensor.numel() * tensor.element_size())
    works = []
    if not codec.fixed_rate:
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=tensor.device)
        works.append(dist.isend(size, peer, group=group, tag=tag))
    works.append(dist.isend(payload, peer, group=group, tag=tag))

    def finish() -> torch.Tensor:
        with timed(label, "comm_s", tensor.device):
            for w in works:
                w.wait()
        return tensor

    return Handle(finish)


def irecv(tensor: torch.Tensor, src: int, codec="none", group: dist.ProcessGroup | None = None,
          label: str | None = None, tag: int = 0) -> Handle:
    """Start receiving into ``tensor`` (the sender's shape and dtype) from group rank ``src``."""
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_float("tensor", tensor)
    label = label or "p2p"
    peer = _global(group, src)
    if codec.fixed_rate:
        nbytes = codec.wire_bytes(tensor.numel(), tensor.dtype)
    else:
        # the 8-byte size header is awaited here, so the payload receive is posted before
        # this returns: waiting on handles in any order cannot deadlock
        size_t = torch.empty(1, dtype=torch.int64, device=tensor.device)
        with timed(label, "comm_s", tensor.device):
            dist.irecv(size_t, peer, group=group, tag=tag).wait()
        nbytes = int(size_t.item())
    payload = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
    work = dist.irecv(payload, peer, group=group, tag=tag)

    def finish() -> torch.Tensor:
        with timed(label, "comm_s", tensor.device):
            work.wait()
        with timed(label, "decode_s", tensor.device):
            packet = codec.packet_from_bytes(payload, tensor.numel(), tuple(tensor.shape),
                                             tensor.dtype)
            codec.decode(packet, out=tensor)
        return tensor

    return Handle(finish)


def send(tensor: torch.Tensor, dst: int, codec="none", group: dist.ProcessGroup | None = None,
         label: str | None = None, tag: int = 0) -> None:
    """Send ``tensor`` encoded with ``codec`` to group rank ``dst`` (blocking)."""
    isend(tensor, dst, codec, group, label, tag).wait()


def recv(tensor: torch.Tensor, src: int, codec="none", group: dist.ProcessGroup | None = None,
         label: str | None = None, tag: int = 0) -> torch.Tensor:
    """Receive into ``tensor`` from group rank ``src`` (blocking); returns ``tensor``."""
    return irecv(tensor, src, codec, group, label, tag).wait()


@dataclass
class P2POp:
    """One transfer of a batch: ``op`` is ``"send"`` or ``"recv"``."""

    op: str
    tensor: torch.Tensor
    peer: int
    codec: object = "none"
    group: dist.ProcessGroup | None = None
    label: str | None = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise ValueError(f"P2POp: op={self.op!r} is not allowed; allowed: send, recv")


def batch_isend_irecv(ops: list[P2POp]) -> list[Handle]:
    """Post every transfer of ``ops`` (sends first, so two ranks exchanging never wait
    on each other), and return their handles in the given order."""
    handles: dict[int, Handle] = {}
    for i, p in enumerate(ops):
        if p.op == "send":
            handles[i] = isend(p.tensor, p.peer, p.codec, p.group, p.label, p.tag)
    for i, p in enumerate(ops):
        if p.op == "recv":
            handles[i] = irecv(p.tensor, p.peer, p.codec, p.group, p.label, p.tag)
    return [handles[i] for i in range(len(ops))]
