"""Compressed point-to-point transfers for pipeline parallelism.

``send``/``recv`` move one encoded tensor between two ranks; ``isend``/``irecv`` return
handles, and :func:`batch_isend_irecv` posts several at once for a pipeline
schedule. The receiver passes a tensor of the sender's shape and dtype and gets the
decoded values in place.

Every transfer is checked, so a send and a receive that disagree can neither corrupt
the receiver's tensor nor leave uninitialised memory in it:

1. the sender posts, at once, a 56-byte frame (a magic number, the kind ``DATA``, the
   transfer's sequence number between the two ranks and tag, the payload's size, the
   length and the 128-bit digest of its descriptor), the descriptor itself (label,
   codec, size, dtype, ranks, tag — any length) and the payload;
2. the receiver takes the frame and descriptor (``irecv`` returns once it has them),
   receives the payload whatever it holds (of the size the frame announced), compares
   the descriptors and answers with an acknowledgement frame: ``ACK_OK``, or
   ``ACK_MISMATCH`` followed by its own descriptor, after which it raises
   :class:`CollectiveMismatchError`; the sender reads the answer in ``wait()`` and
   raises the same error.

**One channel, read in order.** Everything one rank sends another on one tag — its
transfers and its answers to the other's transfers — is one ordered stream: Gloo
matches a receive with the oldest message on (peer, tag) and aborts the process when
the message is larger than the buffer; NCCL ignores tags and matches every message
between two ranks in order. Two ranks that exchange on one tag interleave transfers
and answers in an order neither can predict, so a receive posted for an answer could
take a transfer's frame. So no receive is posted for an expected message: an
:class:`_Inbox` per (peer, tag) reads the stream frame by frame — every frame has the
same size and says what follows it, so it posts the receives for those bytes at once —
and files each arrival where its reader (an ``irecv``, or a send's ``wait()``) takes
it. Distinct tags per message kind were the alternative: the user's tag already spans
torch's whole range, [0, 2³¹ − 1], so there is no room to derive one, and NCCL
would not separate them anyway.

The receiver's decision needs the frame on the host: on NCCL that is one small
device-to-host copy per message. On Gloo, which cannot send CUDA memory, frames and
payloads travel through host memory (the payload is staged on both sides).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback, packet_to_bytes
from commpress.codecs.error_feedback import encode
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import check_float, resolve_codec, resolve_memory
from commpress.collectives.comm import resolve_group
from commpress.collectives.group_context import GroupContext, context
from commpress.collectives.handle import Handle
from commpress.collectives.mismatch import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    describe_call,
    digest,
    mismatch_message,
)
from commpress.validate import InputError, check_int

MAGIC = 0x636F6D6D70726573  # "commpres"
# magic, kind, sequence number, payload bytes, descriptor bytes, descriptor digest (2)
FRAME_WORDS = 7
DATA, ACK_OK, ACK_MISMATCH = 0, 1, 2


def _global(group: dist.ProcessGroup, peer: int) -> int:
    return dist.get_global_rank(group, peer) if group is not dist.group.WORLD else peer


def _wire_device(ctx: GroupContext, tensor: torch.Tensor) -> torch.device:
    """Where transfer buffers live: host memory on Gloo (it cannot send CUDA memory)."""
    return torch.device("cpu") if "gloo" in ctx.backend else tensor.device


def _descriptor(ctx: GroupContext, seq: int, label: str, codec: Codec, tensor: torch.Tensor,
                src: int, dst: int, tag: int) -> str:
    return describe_call("p2p", seq, {
        "label": label, "codec": codec.spec(), "numel": tensor.numel(),
        "dtype": str(tensor.dtype).removeprefix("torch."), "src": ctx.ranks[src],
        "dst": ctx.ranks[dst], "tag": tag})


def _text_tensor(text: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)


def _text(buf: torch.Tensor) -> str:
    return bytes(buf.cpu().tolist()).decode(errors="replace")


def _frame(kind: int, seq: int, payload_bytes: int, text: str,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A frame and the descriptor that follows it (``text`` may be empty)."""
    desc = _text_tensor(text, device)
    d1, d2 = digest(text) if text else (0, 0)
    frame = torch.tensor([MAGIC, kind, seq, payload_bytes, desc.numel(), d1, d2],
                         dtype=torch.int64, device=device)
    return frame, desc


@dataclass
class _Arrival:
    """One message read off a peer's stream: its frame's fields, and the buffers that
    follow the frame with their receives (posted at once, each waited for once: a
    second wait on a Gloo receive waits for another message)."""

    kind: int
    seq: int
    payload_bytes: int
    digest: tuple[int, int]
    desc: torch.Tensor | None = None  # a transfer's, or a refusing receiver's, descriptor
    payload: torch.Tensor | None = None  # a transfer's
    pending: dict = field(default_factory=dict)  # "desc"/"payload" -> its receive

    def text(self) -> str:
        assert self.desc is not None, "an ACK_OK frame carries no descriptor"
        self._wait("desc")
        return _text(self.desc)

    def wait(self) -> None:
        self._wait("desc")
        self._wait("payload")

    def _wait(self, part: str) -> None:
        work = self.pending.pop(part, None)
        if work is not None:
            work.wait()


class _Inbox:
    """What one peer sends this rank on one tag, read in order (see the module's
    docstring): transfers queue for the ``irecv`` calls, in the order sent; answers to
    this rank's sends wait, by sequence number, for the send's ``wait()``."""

    def __init__(self, group: dist.ProcessGroup, peer: int, tag: int) -> None:
        self.group, self.peer, self.tag = group, peer, tag  # peer: the global rank
        self._lock = threading.Lock()  # one reader at a time: frames come in order
        self._transfers: deque[_Arrival] = deque()
        self._answers: dict[int, _Arrival] = {}

    def next_transfer(self, device: torch.device, what: str) -> _Arrival:
        with self._lock:
            while not self._transfers:
                self._read(device, what)
            return self._transfers.popleft()

    def answer(self, seq: int, device: torch.device, what: str) -> _Arrival:
        with self._lock:
            while seq not in self._answers:
                self._read(device, what)
            return self._answers.pop(seq)

    def _read(self, device: torch.device, what: str) -> None:
        frame = torch.empty(FRAME_WORDS, dtype=torch.int64, device=device)
        try:
            dist.irecv(frame, self.peer, group=self.group, tag=self.tag).wait()
        except RuntimeError as e:
            raise CollectiveTimeoutError(
                f"{what}: nothing came from rank {self.peer} on tag {self.tag} within the "
                f"timeout. Cause: {type(e).__name__}: {e}") from e
        magic, kind, seq, payload_bytes, desc_bytes, d1, d2 = frame.tolist()
        if magic != MAGIC or kind not in (DATA, ACK_OK, ACK_MISMATCH):
            raise CollectiveMismatchError(
                f"{what}: rank {self.peer} did not send a commpress transfer (plain "
                "torch.distributed.send?); allowed: commpress.send/isend on the sending side")
        # the bytes that follow the frame are next on the stream: post their receives
        # before the next frame's
        arrival = _Arrival(kind, seq, payload_bytes, (d1, d2))
        if kind != ACK_OK:
            arrival.desc = torch.empty(desc_bytes, dtype=torch.uint8, device=device)
            arrival.pending["desc"] = self._irecv(arrival.desc)
        if kind == DATA:
            arrival.payload = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
            arrival.pending["payload"] = self._irecv(arrival.payload)
            self._transfers.append(arrival)
        else:
            self._answers[seq] = arrival

    def _irecv(self, buf: torch.Tensor):
        return dist.irecv(buf, self.peer, group=self.group, tag=self.tag)

    def send(self, *tensors: torch.Tensor) -> list:
        return [dist.isend(t, self.peer, group=self.group, tag=self.tag) for t in tensors]


def _inbox(ctx: GroupContext, group: dist.ProcessGroup, peer: int, tag: int) -> _Inbox:
    return ctx.p2p_inbox(peer, tag, lambda: _Inbox(group, _global(group, peer), tag))


def _begin(tensor: torch.Tensor, peer: int, name: str, codec, group: dist.ProcessGroup | None,
           label: str | None, tag: int
           ) -> tuple[dist.ProcessGroup, Codec, GroupContext, str, torch.device]:
    """Check a transfer's arguments (``name``: ``dst`` or ``src``) → its group, codec,
    context, label and wire device."""
    # torch.distributed takes a tag that fits a C ``int`` and is not negative (a negative
    # one fails only on the sending side, and the receiver then waits out the timeout)
    check_int("tag", tag, ge=0, le=2**31 - 1)
    codec = resolve_codec(codec)
    group = resolve_group(group)
    check_float("tensor", tensor)
    ctx = context(group)
    if not isinstance(peer, int) or not 0 <= peer < ctx.world or peer == ctx.rank:
        raise InputError(f"{name}={peer!r} is not allowed; allowed: another rank of the group "
                         f"(0 … {ctx.world - 1}, not this rank {ctx.rank})")
    return group, codec, ctx, label or "p2p", _wire_device(ctx, tensor)


def isend(tensor: torch.Tensor, dst: int, codec="none", group: dist.ProcessGroup | None = None,
          label: str | None = None, tag: int = 0, *,
          memory: ErrorFeedback | None = None) -> Handle:
    """Start sending ``tensor`` encoded with ``codec`` to group rank ``dst``; ``memory``:
    the sender's error feedback, keyed ``"<label>-><dst>"`` (the receiver decodes with the
    codec alone).

    ``wait()`` returns once the receiver has acknowledged and the bytes are sent; it
    raises :class:`CollectiveMismatchError` if the receiver expected another transfer.
    """
    memory = resolve_memory(memory)
    group, codec, ctx, label, device = _begin(tensor, dst, "dst", codec, group, label, tag)
    payload = encode_payload(codec, tensor, ctx.stats, label, device,
                             rng_stream=dist.get_rank(), key=f"{label}->{dst}", memory=memory)
    seq = ctx.next_p2p("send", dst, tag)
    text = _descriptor(ctx, seq, label, codec, tensor, ctx.rank, dst, tag)
    inbox = _inbox(ctx, group, dst, tag)
    frame, desc = _frame(DATA, seq, payload.numel(), text, device)
    works = inbox.send(frame, desc, payload)
    what = f"commpress.isend (label {label!r}, transfer #{seq} to rank {ctx.ranks[dst]})"

    def finish() -> torch.Tensor:
        with ctx.stats.timed(label, "comm_s", tensor.device):
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:
                raise CollectiveTimeoutError(
                    f"{what}: rank {ctx.ranks[dst]} did not take it within the timeout. "
                    f"Cause: {type(e).__name__}: {e}") from e
            answer = inbox.answer(seq, device, f"{what}: waiting for its acknowledgement")
            theirs = answer.text() if answer.kind == ACK_MISMATCH else None
        if theirs is not None:
            raise CollectiveMismatchError(mismatch_message(
                f"commpress.isend (label {label!r}) to rank {ctx.ranks[dst]}",
                [text, theirs], (ctx.ranks[ctx.rank], ctx.ranks[dst])))
        return tensor

    return Handle(finish)


def irecv(tensor: torch.Tensor, src: int, codec="none", group: dist.ProcessGroup | None = None,
          label: str | None = None, tag: int = 0) -> Handle:
    """Start receiving into ``tensor`` (the sender's shape and dtype) from group rank ``src``.

    Returns once the sender's frame has arrived and matched (so waiting on handles in
    any order cannot deadlock); raises :class:`CollectiveMismatchError` if the sender
    sent something else, leaving ``tensor`` untouched.
    """
    group, codec, ctx, label, device = _begin(tensor, src, "src", codec, group, label, tag)
    seq = ctx.next_p2p("recv", src, tag)
    mine = _descriptor(ctx, seq, label, codec, tensor, src, ctx.rank, tag)
    inbox = _inbox(ctx, group, src, tag)
    what = f"commpress.irecv (label {label!r}, transfer #{seq} from rank {ctx.ranks[src]})"
    with ctx.stats.timed(label, "comm_s", tensor.device):
        arrival = inbox.next_transfer(device, what)
        theirs = arrival.text()
    expected = codec.wire_bytes(tensor.numel(), tensor.dtype)
    agreed = arrival.digest == digest(mine) and (expected is None
                                                  or arrival.payload_bytes == expected)
    if not agreed:
        _refuse(ctx, inbox, arrival, mine, device)
        raise CollectiveMismatchError(mismatch_message(
            f"commpress.irecv (label {label!r}) from rank {ctx.ranks[src]}",
            [theirs, mine], (ctx.ranks[src], ctx.ranks[ctx.rank])))
    # not waited for: a Gloo send completes once the peer takes it, which it does in its
    # send's wait() — after its own receive's, perhaps, which may be waiting for ours
    ack, _ = _frame(ACK_OK, arrival.seq, 0, "", device)
    [ack_work] = inbox.send(ack)
    ctx.hold(ack_work, ack)

    def finish() -> torch.Tensor:
        with ctx.stats.timed(label, "comm_s", tensor.device):
            arrival.wait()
        with ctx.stats.timed(label, "decode_s", tensor.device):
            return decode_payload(codec, arrival.payload.to(tensor.device), tensor)

    return Handle(finish)


def encode_payload(codec: Codec, tensor: torch.Tensor, stats: Stats, label: str,
                   device: torch.device, *, rng_stream: int, key: str,
                   memory: ErrorFeedback | None = None) -> torch.Tensor:
    """Encode ``tensor`` (through ``memory``, keyed ``key``) for a transfer and count its
    bytes → the payload on ``device`` (never the tensor's own storage: the sender may
    reuse it once the send returns)."""
    with stats.timed(label, "encode_s", tensor.device):
        packet = encode(codec, tensor.detach(), rng_stream=rng_stream, key=key, memory=memory)
        payload = packet_to_bytes(packet).to(device)
        if payload.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            payload = payload.clone()  # codec "none" sends the tensor itself
    count_sent(stats, label, tensor.numel(), payload.numel(), tensor.element_size())
    return payload


def decode_payload(codec: Codec, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode a transfer's ``payload`` into ``out`` (the codec alone: the memory of error
    feedback is the sender's)."""
    packet = codec.packet_from_bytes(payload, out.numel(), tuple(out.shape), out.dtype)
    return codec.decode(packet, out=out)


def _refuse(ctx: GroupContext, inbox: _Inbox, arrival: _Arrival, mine: str,
            device: torch.device) -> None:
    """Take the sender's payload (its send completes), then tell it why — without
    waiting for it to read the answer (it may itself be refusing a transfer of ours)."""
    arrival.wait()
    frame, desc = _frame(ACK_MISMATCH, arrival.seq, 0, mine, device)
    for work, buf in zip(inbox.send(frame, desc), (frame, desc)):
        ctx.hold(work, buf)


def send(tensor: torch.Tensor, dst: int, codec="none", group: dist.ProcessGroup | None = None,
         label: str | None = None, tag: int = 0, *,
         memory: ErrorFeedback | None = None) -> None:
    """Send ``tensor`` encoded with ``codec`` to group rank ``dst`` (blocking); ``memory``
    as :func:`isend`'s."""
    isend(tensor, dst, codec, group, label, tag, memory=memory).wait()


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
    memory: ErrorFeedback | None = None  # a send's error feedback

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise InputError(f"P2POp: op={self.op!r} is not allowed; allowed: send, recv")
        if self.op == "recv" and self.memory is not None:
            raise InputError("P2POp: memory= on a recv is not allowed; allowed: memory on a "
                             "send only (error feedback is the sender's)")


def batch_isend_irecv(ops: list[P2POp]) -> list[Handle]:
    """Post every transfer of ``ops`` (sends first, so two ranks exchanging never wait
    on each other), and return their handles in the given order."""
    handles: dict[int, Handle] = {}
    for i, p in enumerate(ops):
        if p.op == "send":
            handles[i] = isend(p.tensor, p.peer, p.codec, p.group, p.label, p.tag,
                               memory=p.memory)
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
