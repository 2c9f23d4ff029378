"""One way in and out of every public collective.

:func:`begin` is the prologue every collective shares: it resolves the group (default:
the world) and the codecs, checks the inputs locally (dtype, sizes), and then checks
across ranks that everyone makes the same call (:meth:`GroupContext.agree`) — all
before a byte of payload moves, so bad input never leaves a peer waiting. Its
:class:`Call` carries what the body needs. :func:`end` is the epilogue: the handle
for ``async_op=True``, else the finished result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback
from commpress.codecs import codec as build_codec
from commpress.collectives.byte_stats import Stats
from commpress.collectives.comm import check_op, describe, resolve_group
from commpress.collectives.group_context import GroupContext, context
from commpress.collectives.handle import Handle
from commpress.validate import InputError


def resolve_codec(codec: Any, field: str = "codec") -> Codec:
    """A codec object from a spec, dict or codec."""
    if isinstance(codec, ErrorFeedback):
        raise InputError(f"{field}={codec!r} is not allowed: error feedback is memory beside "
                         f"the codec; allowed: a codec or spec as {field}=, and the memory "
                         "as memory= (intra_memory=/inter_memory= for two levels)")
    if isinstance(codec, Codec):
        return codec
    return build_codec(codec)


def resolve_memory(memory: Any, field: str = "memory") -> ErrorFeedback | None:
    if memory is None or isinstance(memory, ErrorFeedback):
        return memory
    raise InputError(f"{field}={memory!r} is not allowed; allowed: None or a "
                     "commpress.ErrorFeedback()")


def is_exact(codec: Codec, memory: ErrorFeedback | None = None) -> bool:
    """Whether a collective can use torch's own uncompressed collective: codec ``none``
    with no memory (a memory of an exact codec is always zero, but it was asked for)."""
    return codec.name == "none" and memory is None


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if not t.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")


@dataclass
class Call:
    """A checked call: its group, context, codecs and their memories (by the same
    names), and label."""

    group: dist.ProcessGroup
    ctx: GroupContext
    codecs: dict[str, Codec]
    memories: dict[str, ErrorFeedback | None]
    label: str

    @property
    def codec(self) -> Codec:
        """The codec of a one-codec collective."""
        return next(iter(self.codecs.values()))

    @property
    def memory(self) -> ErrorFeedback | None:
        """The memory of a one-codec collective."""
        return next(iter(self.memories.values()))

    @property
    def stats(self) -> Stats:
        return self.ctx.stats

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world(self) -> int:
        return self.ctx.world


def begin(collective: str, group: dist.ProcessGroup | None, label: str | None,
          codecs: dict[str, Any], *, tensors: dict[str, torch.Tensor], op: str | None = None,
          check: Callable[[int], None] | None = None,
          memories: dict[str, Any] | None = None, **fields: object) -> Call:
    """Resolve, check locally, then agree across ranks; returns the :class:`Call`.

    ``tensors`` are the call's floating-point inputs and outputs by argument name; their
    element counts, dtypes and device types, the codec specs (with whether each has a
    memory: ``memories``, by the codecs' names), ``op`` and ``fields`` are what every rank
    must agree on. ``check(world_size)`` runs the collective's own local checks (sizes)
    before anything is exchanged.
    """
    resolved = {name: resolve_codec(c, _field(name, "codec")) for name, c in codecs.items()}
    memories = {name: resolve_memory((memories or {}).get(name), _field(name, "memory"))
                for name in codecs}
    group = resolve_group(group)
    if op is not None:
        check_op(op)
    described: dict[str, object] = {}
    for name, t in tensors.items():
        check_float(name, t)
        described.update({f"{name}.{k}": v for k, v in describe(t).items()})
    ctx = context(group)
    if check is not None:
        check(ctx.world)
    label = label or collective
    specs = {name: c.spec() + ("" if memories[name] is None else f"+{memories[name].spec()}")
             for name, c in resolved.items()}
    ctx.agree(collective, label=label, op=op, **specs, **described, **fields)
    return Call(group, ctx, resolved, memories, label)


def _field(name: str, what: str) -> str:
    """The argument a codec (``what="codec"``) or memory of this name came from: ``intra``
    and ``intra_memory`` for a level, else ``codec`` and ``memory``."""
    if name in ("intra", "inter"):
        return name if what == "codec" else f"{name}_memory"
    return what


def owned_input(input: torch.Tensor, codec: Codec, async_op: bool) -> torch.Tensor:
    """The input an exact asynchronous collective hands torch: a copy, since torch reads
    it until the transfer ends and the caller may reuse it once the call returns
    (compressed paths have encoded it by then)."""
    return input.clone() if async_op and is_exact(codec) else input


def end(handle: Handle, async_op: bool) -> torch.Tensor | Handle:
    """The epilogue: ``handle`` itself for ``async_op``, else its finished result."""
    return handle if async_op else handle.wait()
