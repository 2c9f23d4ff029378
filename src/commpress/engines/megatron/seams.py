"""The attributes of Megatron-core that commpress replaces, and what each live
application covers.

Every replacement is a module- or class-level attribute that Megatron looks up when it
communicates (its own functions stay as they are). The replacements are installed
when the first :func:`~commpress.engines.megatron.compress` covers something and
restored when the last one is removed. Each dispatches on Megatron's own call
arguments — a gradient bucket's tensor, a tensor- or pipeline-parallel group — to the
application that covers it, and hands everything else to Megatron's original
function unchanged, so models that were not given a policy communicate as before.
"""

from __future__ import annotations

import logging
import threading
import types
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Swap:
    """``owner.name`` replaced by ``replacement`` while installed."""

    owner: Any  # a module or a class
    name: str
    replacement: Any
    original: Any = None

    def install(self) -> None:
        # a class attribute is read from __dict__ so a staticmethod stays one
        self.original = vars(self.owner)[self.name]
        setattr(self.owner, self.name, self.replacement)

    def intact(self) -> bool:
        return vars(self.owner).get(self.name) is self.replacement

    def restore(self) -> None:
        if self.intact():
            setattr(self.owner, self.name, self.original)
        else:
            log.warning("commpress.megatron: %s was replaced by someone else after commpress "
                        "installed its own; leaving theirs", self.describe())

    def describe(self) -> str:
        owner = (getattr(self.owner, "__qualname__", None)
                 or getattr(self.owner, "__name__", repr(self.owner)))
        return f"{owner}.{self.name}"


class ModuleView(types.ModuleType):
    """A module whose attributes are ``real``'s except ``overrides``: given to one Megatron
    module as its ``torch`` so that a call it makes directly (``torch.distributed.
    all_reduce``) reaches commpress while every other module sees torch unchanged."""

    def __init__(self, real: types.ModuleType, overrides: dict[str, Any]) -> None:
        super().__init__(real.__name__)
        self.__dict__["_real"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)


@dataclass
class Registry:
    """What the live applications cover, by the objects Megatron passes when it calls.

    ``buckets`` maps ``id`` of a bucket's ``grad_data`` and ``param_data`` to its
    :class:`~commpress.engines.megatron.data_parallel.BucketComm`; ``tp`` and
    ``pp`` map a process group to the codecs of its activations.
    """

    buckets: dict[int, Any] = field(default_factory=dict)
    tp: dict[Any, Any] = field(default_factory=dict)
    pp: dict[Any, Any] = field(default_factory=dict)
    owners: int = 0  # live applications
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bucket(self, tensor: Any, kind: str) -> Any:
        """The covered bucket whose ``kind`` ("grad_data"/"param_data") is ``tensor``."""
        comm = self.buckets.get(id(tensor))
        if comm is not None and getattr(comm.bucket, kind) is tensor:
            return comm
        return None


REGISTRY = Registry()
_SWAPS: list[Swap] = []


def acquire(swaps: list[Swap]) -> None:
    """Install ``swaps`` for the first live application (later ones share them)."""
    with REGISTRY.lock:
        if REGISTRY.owners == 0:
            for s in swaps:
                s.install()
            _SWAPS[:] = swaps
            log.debug("commpress.megatron: replaced %s", ", ".join(s.describe() for s in swaps))
        REGISTRY.owners += 1


def release() -> None:
    """Restore Megatron's attributes when the last live application is removed."""
    with REGISTRY.lock:
        REGISTRY.owners -= 1
        if REGISTRY.owners == 0:
            for s in reversed(_SWAPS):
                s.restore()
            _SWAPS.clear()


def broken_swaps() -> list[str]:
    """The replaced attributes someone else has since replaced again."""
    return [s.describe() for s in _SWAPS if not s.intact()]
