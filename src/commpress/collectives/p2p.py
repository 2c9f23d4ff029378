"""Compressed point-to-point transfers for pipeline parallelism.

``send``/``recv`` move one encoded tensor between two ranks; ``isend``/``irecv`` return
handles, and :func:`batch_isend_irecv` posts several at once for a pipeline
schedule. The receiver passes a tensor of the sender's shape and dtype and gets the
decoded values in place.

Every transfer is checked, so a send and a receive that disagree can neither corrupt
the receiver's tensor nor leave uninitialised memory in it:

1. the sender posts, at once, a 48-byte header (a magic number, the transfer's
   sequence number between the two ranks and tag, the payload's size, the length and
   the 128-bit digest of its descriptor), the descriptor itself (label, codec, size,
   dtype, ranks, tag — any length), the payload, and a receive for an acknowledgement;
2. the receiver takes the header and descriptor (``irecv`` returns once it has them),
   compares them with its own, and acknowledges: on agreement it receives the payload;
   otherwise it drains the payload, sends its own descriptor back and raises
   :class:`CollectiveMismatchError`; the sender raises the same error in ``wait()``.

The receiver's decision needs the header on the host: on NCCL that is one small
device-to-host copy per receive. On Gloo, which cannot send CUDA memory, headers and
payloads travel through host memory (the payload is staged on both sides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from commpress.codecs import packet_to_bytes
from commpress.collectives import chunks
from commpress.collectives.call import AnyCodec, check_float, resolve_codec
from commpress.collectives.comm import resolve_group
from commpress.collectives.context import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupContext,
    context,
    describe_call,
    digest,
    mismatch_message,
)
from commpress.collectives.handle import Handle
from commpress.validate import check_int

MAGIC = 0x636F6D6D70726573  # "commpres"
HEADER_WORDS = 6  # magic, sequence number, payload bytes, descriptor bytes, digest (2)
ACK_OK, ACK_MISMATCH = 1, 2


def _global(group: dist.ProcessGroup, peer: int) -> int:
    return dist.get_global_rank(group, peer) if group is not dist.group.WORLD else peer


def _wire_device(ctx: GroupContext, tensor: torch.Tensor) -> torch.device:
    """Where transfer buffers live: host memory on Gloo (it cannot send CUDA memory)."""
    return torch.device("cpu") if "gloo" in ctx.backend else tensor.device


def _descriptor(ctx: GroupContext, seq: int, label: str, codec: AnyCodec, tensor: torch.Tensor,
                src: int, dst: int, tag: int) -> str:
    return describe_call("p2p", seq, {
        "label": label, "codec": codec.spec(), "numel": tensor.numel(),
        "dtype": str(tensor.dtype).removeprefix("torch."), "src": ctx.ranks[src],
        "dst": ctx.ranks[dst], "tag": tag})


def _text_tensor(text: str, device: torch.device) -> torch.Tensor:
    raw = text.encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device) if raw else \
        torch.empty(0, dtype=torch.uint8, device=device)


def _text(buf: torch.Tensor) -> str:
    return bytes(buf.cpu().tolist()).decode(errors="replace")


def _check_tag(tag: int) -> None:
    """torch.distributed takes a tag that fits a C ``int`` and is not negative (a negative
    one fails only on the sending side, and the receiver then waits out the timeout)."""
    check_int("tag", tag, ge=0, le=2**31 - 1)


def _check_peer(ctx: GroupContext, peer: int, name: str) -> None:
    if not isinstance(peer, int) or not 0 <= peer < ctx.world or peer == ctx.rank:
        raise ValueError(f"{name}={peer!r} is not allowed; allowed: another rank of the group "
                         f"(0 … {ctx.world - 1}, not this rank {ctx.rank})")


def isend(tensor: torch.Tensor, dst: int, codec="none", group: dist.ProcessGroup | None = None,
          label: str | None = None, tag: int = 0) -> Handle:
    """Start sending ``tensor`` encoded with ``codec`` to group rank ``dst``.

    ``wait()`` returns once the receiver has acknowledged and the bytes are sent; it
    raises :class:`CollectiveMismatchError` if the receiver expected another transfer.
    """
    _check_tag(tag)
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_float("tensor", tensor)
    ctx = context(group)
    _check_peer(ctx, dst, "dst")
    label = label or "p2p"
    peer = _global(group, dst)
    device = _wire_device(ctx, tensor)
    with ctx.stats.timed(label, "encode_s", tensor.device):
        packet = chunks.encode(codec, tensor.detach(), rng_stream=dist.get_rank(),
                               key=f"{label}->{dst}")
        payload = packet_to_bytes(packet).to(device)
        if payload.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            payload = payload.clone()  # codec "none" sends the tensor itself: the caller
            # may reuse its tensor once isend returns
    ctx.stats.record(label, calls=1, elements=tensor.numel(), wire_bytes=payload.numel(),
                     raw_bytes=tensor.numel() * tensor.element_size())
    seq = ctx.next_p2p("send", dst, tag)
    text = _descriptor(ctx, seq, label, codec, tensor, ctx.rank, dst, tag)
    desc = _text_tensor(text, device)
    header = torch.tensor([MAGIC, seq, payload.numel(), desc.numel(), *digest(text)],
                          dtype=torch.int64, device=device)
    ack = torch.empty(3, dtype=torch.int64, device=device)
    works = [dist.isend(header, peer, group=group, tag=tag),
             dist.isend(desc, peer, group=group, tag=tag),
             dist.isend(payload, peer, group=group, tag=tag)]
    ack_work = dist.irecv(ack, peer, group=group, tag=tag)

    def finish() -> torch.Tensor:
        with ctx.stats.timed(label, "comm_s", tensor.device):
            for w in works:
                w.wait()
            ack_work.wait()
        status, their_len = int(ack[0]), int(ack[1])
        if status != ACK_OK:
            theirs = torch.empty(their_len, dtype=torch.uint8, device=device)
            dist.recv(theirs, peer, group=group, tag=tag)
            raise CollectiveMismatchError(mismatch_message(
                f"commpress.isend (label {label!r}) to rank {ctx.ranks[dst]}",
                [text, _text(theirs)], (ctx.ranks[ctx.rank], ctx.ranks[dst])))
        return tensor

    return Handle(finish)


def irecv(tensor: torch.Tensor, src: int, codec="none", group: dist.ProcessGroup | None = None,
          label: str | None = None, tag: int = 0) -> Handle:
    """Start receiving into ``tensor`` (the sender's shape and dtype) from group rank ``src``.

    Returns once the sender's header has arrived and matched (so waiting on handles in
    any order cannot deadlock); raises :class:`CollectiveMismatchError` if the sender
    sent something else, leaving ``tensor`` untouched.
    """
    _check_tag(tag)
    group = resolve_group(group)
    codec = resolve_codec(codec)
    check_float("tensor", tensor)
    ctx = context(group)
    _check_peer(ctx, src, "src")
    label = label or "p2p"
    peer = _global(group, src)
    device = _wire_device(ctx, tensor)
    seq = ctx.next_p2p("recv", src, tag)
    mine = _descriptor(ctx, seq, label, codec, tensor, src, ctx.rank, tag)
    header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=device)
    with ctx.stats.timed(label, "comm_s", tensor.device):
        try:
            dist.irecv(header, peer, group=group, tag=tag).wait()
        except RuntimeError as e:
            raise CollectiveTimeoutError(
                f"commpress.irecv (label {label!r}, transfer #{seq} from rank "
                f"{ctx.ranks[src]}, tag {tag}): rank {ctx.ranks[src]} never sent it within "
                f"the timeout. Cause: {type(e).__name__}: {e}") from e
    magic, their_seq, nbytes, desc_len, d1, d2 = header.tolist()
    if magic != MAGIC:
        raise CollectiveMismatchError(
            f"commpress.irecv (label {label!r}) from rank {ctx.ranks[src]}: the peer did not "
            "send a commpress transfer (plain torch.distributed.send?); allowed: "
            "commpress.send/isend on the sending side")
    theirs = torch.empty(desc_len, dtype=torch.uint8, device=device)
    dist.irecv(theirs, peer, group=group, tag=tag).wait()
    expected = codec.wire_bytes(tensor.numel(), tensor.dtype)
    agreed = (d1, d2) == digest(mine) and (expected is None or nbytes == expected)
    if not agreed:
        _refuse(ctx, peer, group, tag, device, mine, nbytes)
        raise CollectiveMismatchError(mismatch_message(
            f"commpress.irecv (label {label!r}) from rank {ctx.ranks[src]}",
            [_text(theirs), mine], (ctx.ranks[src], ctx.ranks[ctx.rank])))
    payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
    work = dist.irecv(payload, peer, group=group, tag=tag)
    ack = torch.tensor([ACK_OK, 0, their_seq], dtype=torch.int64, device=device)
    ack_work = dist.isend(ack, peer, group=group, tag=tag)

    def finish() -> torch.Tensor:
        with ctx.stats.timed(label, "comm_s", tensor.device):
            work.wait()
            ack_work.wait()
        with ctx.stats.timed(label, "decode_s", tensor.device):
            packet = codec.packet_from_bytes(payload.to(tensor.device), tensor.numel(),
                                             tuple(tensor.shape), tensor.dtype)
            codec.decode(packet, out=tensor)
        return tensor

    return Handle(finish)


def _refuse(ctx: GroupContext, peer: int, group: dist.ProcessGroup, tag: int,
            device: torch.device, mine: str, nbytes: int) -> None:
    """Drain the sender's payload (its send completes), then tell it why — without
    waiting for it to read the answer (it may itself be refusing a transfer of ours)."""
    dist.recv(torch.empty(max(0, nbytes), dtype=torch.uint8, device=device), peer, group=group,
              tag=tag)
    desc = _text_tensor(mine, device)
    ack = torch.tensor([ACK_MISMATCH, desc.numel(), 0], dtype=torch.int64, device=device)
    ctx.hold(dist.isend(ack, peer, group=group, tag=tag), ack)
    ctx.hold(dist.isend(desc, peer, group=group, tag=tag), desc)


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
    sends = list(handles.values())
    try:
        for i, p in enumerate(ops):
            if p.op == "recv":
                handles[i] = irecv(p.tensor, p.peer, p.codec, p.group, p.label, p.tag)
    except Exception:
        # finish the sends already posted (their peers answer them), so no message of
        # this batch is left for a later transfer to read
        for h in sends:
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - the receive's error is the one to report
                pass
        raise
    return [handles[i] for i in range(len(ops))]
