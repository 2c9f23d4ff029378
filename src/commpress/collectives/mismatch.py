"""What ranks agree on before a call, its digest, and the errors when they do not.

Every collective and transfer describes itself as ``key=value`` lines (:func:`describe_call`);
ranks compare a 128-bit digest of that text (:func:`digest`) and, when the digests differ,
the whole texts, from which :func:`mismatch_message` names each field that differs and
the ranks holding each value.
"""

from __future__ import annotations

import hashlib


class CollectiveMismatchError(RuntimeError):
    """Ranks called the same collective (or a send and its receive) with different
    arguments; raised on every rank involved, before any payload moved — or, where the
    others replayed the call without a header (``GroupContext.allow_replay``), before
    any of theirs completed."""


class CollectiveTimeoutError(RuntimeError):
    """A rank waited for the others past the group's timeout; names who never came."""


def describe_call(collective: str, seq: int | None, fields: dict[str, object]) -> str:
    """The text ranks agree on: one ``key=value`` per line (no length limit); ``seq``
    None: the call's form, whatever its place in the sequence."""
    lines = [f"collective={collective}", f"call={seq}"]
    lines += [f"{k}={v}" for k, v in fields.items()]
    return "\n".join(lines)


def digest(text: str) -> tuple[int, int]:
    """128-bit BLAKE2 digest of ``text`` as two int64 (what crosses the wire)."""
    d = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return (int.from_bytes(d[:8], "little", signed=True),
            int.from_bytes(d[8:], "little", signed=True))


def _fields(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.split("\n") if "=" in line)


def mismatch_message(what: str, texts: list[str], ranks: tuple[int, ...]) -> str:
    """Name each field whose value differs, with the ranks holding each value."""
    parsed = [_fields(t) for t in texts]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    parts = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, p in zip(ranks, parsed):
            by_value.setdefault(p.get(key, "<missing>"), []).append(rank)
        if len(by_value) > 1:
            shown = "; ".join(f"ranks {rs}: {v}" if len(rs) > 1 else f"rank {rs[0]}: {v}"
                              for v, rs in by_value.items())
            parts.append(f"{key} differs ({shown})")
    return (f"{what}: ranks disagree, so the call would corrupt data or hang; "
            + "; ".join(parts))


def deviation_message(what: str, mine: str, agreed: str, rank: int, seq: int) -> str:
    """Name what differs between this rank's call ``mine`` and ``agreed``, the call every
    rank agreed at this point of the previous step, which the others replay."""
    have, want = _fields(mine), _fields(agreed)
    parts = [f"{key} differs (rank {rank}: {have.get(key, '<missing>')}; the others: "
             f"{want.get(key, '<missing>')})"
             for key in dict.fromkeys([*want, *have]) if have.get(key) != want.get(key)]
    return (f"{what}: ranks disagree, so the call would corrupt data or hang; at call #{seq} "
            f"rank {rank} made another call than the one every rank agreed at this point of "
            "the previous step, which the others make again (replayed, without a header): "
            + "; ".join(parts))
