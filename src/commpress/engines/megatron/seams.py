"""What each live compression of Megatron-core covers, and the module view its bucket
code gets.

commpress replaces module- and class-level attributes that Megatron looks up when it
communicates (its own functions stay as they are), on one :class:`~commpress.engines.
seam.Seam` (``compression.SEAM``) shared by every live compression. Each replacement
dispatches on Megatron's own call arguments — a gradient bucket's tensor, a tensor- or
pipeline-parallel group — through :data:`REGISTRY` to the compression that covers it,
and hands everything else to Megatron's original function unchanged, so models that
were not given a policy communicate as before.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


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
    ``pp`` map a process group to the codecs of its activations, ``ep`` an
    expert-parallel group to the :class:`~commpress.ep.EPExchange` of its tokens.
    """

    buckets: dict[int, Any] = field(default_factory=dict)
    tp: dict[Any, Any] = field(default_factory=dict)
    pp: dict[Any, Any] = field(default_factory=dict)
    ep: dict[Any, Any] = field(default_factory=dict)

    def bucket(self, tensor: Any, kind: str) -> Any:
        """The covered bucket whose ``kind`` ("grad_data"/"param_data") is ``tensor``."""
        comm = self.buckets.get(id(tensor))
        if comm is not None and getattr(comm.bucket, kind) is tensor:
            return comm
        return None


REGISTRY = Registry()


class Direction:
    """Which direction a replaced function runs in, per thread: set around a call by the
    replaced method above it (``with DIRECTION("act"): …``), read by the function below."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def kind(self) -> str | None:
        return getattr(self._local, "kind", None)

    @contextmanager
    def __call__(self, kind: str) -> Iterator[None]:
        previous = self.kind
        self._local.kind = kind
        try:
            yield
        finally:
            self._local.kind = previous
