"""How every adapter changes an engine: attributes replaced, and given back.

A :class:`Swap` replaces one attribute — of a module, a class or one engine object — and
restores it. An adapter's swaps on its own objects (a DeepSpeed optimizer's methods, an
FSDP parameter group's collectives) live and die with its handle. Functions the engine
looks up at module or class level are shared by every compression in the process: a
:class:`Seam` holds those swaps, installs them for its first owner, restores them after
its last, and its replacements find the owner of a call among :attr:`Seam.owners` —
anything no owner claims goes to the engine's own function unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Swap:
    """``owner.name`` replaced by ``replacement`` while installed."""

    owner: Any  # a module, a class or an object
    name: str
    replacement: Any
    original: Any = None
    _own: bool = False  # owner held the attribute itself (not through its class)

    def install(self) -> Swap:
        # an attribute of the owner's own is read from __dict__ (a class's staticmethod stays
        # one); one it gets from its class (an object's method) is taken bound, for the
        # replacement to call; restoring that (or an attribute the owner did not have)
        # deletes the owner's own attribute again
        own = vars(self.owner)
        self._own = self.name in own
        self.original = own[self.name] if self._own else getattr(self.owner, self.name, None)
        setattr(self.owner, self.name, self.replacement)
        return self

    def intact(self) -> bool:
        return vars(self.owner).get(self.name) is self.replacement

    def restore(self) -> None:
        if not self.intact():
            log.warning("commpress: %s was replaced by someone else after commpress installed "
                        "its own; leaving theirs", self.describe())
        elif self._own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)

    def describe(self) -> str:
        owner = (getattr(self.owner, "__qualname__", None)
                 or getattr(self.owner, "__name__", None) or type(self.owner).__name__)
        return f"{owner}.{self.name}"


def install(swaps: Iterable[Swap]) -> list[Swap]:
    """Install ``swaps`` in order; if one fails, the ones before it are restored."""
    done: list[Swap] = []
    try:
        for s in swaps:
            done.append(s.install())
    except BaseException:
        restore(done)
        raise
    return done


def restore(swaps: list[Swap]) -> None:
    """Restore ``swaps`` in the reverse order of their installation."""
    for s in reversed(swaps):
        s.restore()


class Seam:
    """Module- or class-level swaps shared by every live owner (a compression) in this
    process: installed when the first owner acquires the seam, restored when the last
    releases it. ``lock`` guards the owners and whatever the adapter maps beside them."""

    def __init__(self, engine: str, swaps: list[Swap]) -> None:
        self.engine = engine
        self.swaps = swaps
        self.owners: list[Any] = []
        self.lock = threading.RLock()

    def acquire(self, owner: Any) -> None:
        with self.lock:
            if not self.owners:
                install(self.swaps)
                log.debug("commpress.%s: replaced %s", self.engine,
                          ", ".join(s.describe() for s in self.swaps))
            self.owners.append(owner)

    def release(self, owner: Any) -> None:
        """Drop ``owner`` (a second release is a no-op); the last one restores the engine."""
        with self.lock:
            if not any(o is owner for o in self.owners):
                return
            self.owners = [o for o in self.owners if o is not owner]
            if not self.owners:
                restore(self.swaps)

    def broken(self) -> list[str]:
        """The installed swaps someone else has since replaced again."""
        with self.lock:
            return [s.describe() for s in self.swaps if self.owners and not s.intact()]
