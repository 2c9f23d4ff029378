"""Cross-rank agreement: turn a mismatch that would hang a collective into an error.

The first call of a collective with a given (label, shape, dtype, codec, ...) on a
process group all-gathers a short text descriptor from every rank (fixed-size bytes,
nothing pickled). If any rank differs, every rank raises the same
:class:`CollectiveMismatchError` naming the ranks and the fields that differ, instead
of entering a collective whose buffers do not match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DESCRIPTOR_BYTES = 512

_checked: set[tuple] = set()


class CollectiveMismatchError(RuntimeError):
    """Ranks called the same collective with different arguments."""


def _encode(text: str, device: torch.device) -> torch.Tensor:
    raw = text.encode()[: DESCRIPTOR_BYTES - 2]
    buf = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
    buf[0], buf[1] = len(raw) >> 8, len(raw) & 0xFF
    buf[2 : 2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _decode(buf: torch.Tensor) -> str:
    b = buf.cpu()
    n = (int(b[0]) << 8) | int(b[1])
    return bytes(b[2 : 2 + n].tolist()).decode(errors="replace")


def _fields(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split("; ") if "=" in item)


def check_agreement(group: dist.ProcessGroup, collective: str, device: torch.device, /,
                    **fields: object) -> None:
    """Raise on every rank if ranks disagree on ``fields`` for this collective."""
    text = "; ".join(f"{k}={v}" for k, v in fields.items())
    key = (id(group), collective, text)
    if key in _checked:
        return
    world = dist.get_world_size(group)
    mine = _encode(text, device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    texts = [_decode(g) for g in gathered]
    if len(set(texts)) > 1:
        ref = _fields(texts[0])
        lines = []
        for rank, t in enumerate(texts):
            f = _fields(t)
            diff = {k: f.get(k) for k in set(ref) | set(f) if f.get(k) != ref.get(k)}
            if diff:
                got = ", ".join(f"{k}={v} (rank 0: {ref.get(k)})" for k, v in sorted(diff.items()))
                lines.append(f"rank {rank}: {got}")
        raise CollectiveMismatchError(
            f"commpress.{collective}: ranks disagree, so the collective would hang or "
            f"corrupt data; " + "; ".join(lines)
        )
    _checked.add(key)


def forget_agreements() -> None:
    """Forget which calls were checked (for tests and after re-initializing groups)."""
    _checked.clear()
