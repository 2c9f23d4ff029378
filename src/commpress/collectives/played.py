"""The played transport: ``N`` ranks' collectives in one process, what ``commpress
simulate`` runs.

A collective's steps (:mod:`commpress.collectives.transport`) are run for every rank,
one rank at a time as its input arrives (so a caller can compute rank ``r``'s gradient,
hand it over and free it): its steps run until they wait for other ranks, holding
only codes. Once every member of a group has made its request, the request is
answered by indexing what the members sent, and each member goes on. So the played
ranks run the very steps the real ones run — the same codec objects per rank
(stochastic-rounding counters, error-feedback memory), random streams, row order in
every sum and byte accounting — and only the moving of bytes differs.

What every member computes from the same gathered bytes (``AllGather.then``) is
computed once. Exact (uncompressed) reductions are summed here in rank order as the
inputs arrive; a real backend sums in its own order, so those agree to fp32 rounding,
not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from commpress.codecs import Codec, ErrorFeedback
from commpress.collectives.byte_stats import Stats
from commpress.collectives.p2p import decode_payload, encode_payload
from commpress.collectives.transport import AllGather, AllToAll, Peers, Reduce, Request, Steps


def played_peers(rank: int, world: int, ranks_per_node: int) -> tuple[Peers, Peers, Peers]:
    """Rank ``rank``'s peers in the whole group, inside its node and across nodes (the
    ranks of its local index), named by their member ranks."""
    L = ranks_per_node
    node, local = divmod(rank, L)
    return (Peers(rank, world, tuple(range(world))),
            Peers(local, L, tuple(range(node * L, (node + 1) * L))),
            Peers(node, world // L, tuple(range(local, world, L))))


class _RankOrderSum:
    """A running sum of the ranks' tensors in rank order; a tensor that arrives before
    its turn waits, so only the sum and early arrivals are held."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self._waiting: dict[int, torch.Tensor] = {}
        self._next = 0

    def add(self, rank: int, x: torch.Tensor) -> None:
        self._waiting[rank] = x
        while self._next in self._waiting:
            y = self._waiting.pop(self._next)
            self.total = y if self.total is None else self.total.add_(y)
            self._next += 1


class Played:
    """One collective over ``world`` played ranks.

    ``steps(rank, x)`` gives rank ``rank``'s steps on its input; :meth:`add` the ranks'
    inputs in any order; :meth:`finish` → ``{rank: result}`` for the ranks in ``keep``
    (default: all; others' results are dropped as they come — all-reduce results are
    the same on every rank).
    """

    def __init__(self, world: int, steps: Callable[[int, Any], Steps],
                 keep: tuple[int, ...] | None = None) -> None:
        self.world, self.steps = world, steps
        self.keep = set(range(world) if keep is None else keep)
        self.results: dict[int, Any] = {}
        self._waiting: dict[tuple, dict[int, tuple[int, Steps, Request]]] = {}
        self._sums: dict[tuple, _RankOrderSum] = {}

    def add(self, rank: int, x: Any) -> None:
        """Run rank ``rank``'s steps on ``x`` until they wait for other ranks (from then
        on they hold only codes, or for an exact reduction this transport's copy)."""
        self._advance(rank, self.steps(rank, x), None)

    def finish(self) -> dict[int, Any]:
        if self._waiting or len(self.results) < len(self.keep):
            raise RuntimeError(f"played collective unfinished: {len(self.results)} of "
                               f"{len(self.keep)} ranks done; add every rank's input")
        return self.results

    def _advance(self, rank: int, steps: Steps, answer: Any) -> None:
        try:
            request = steps.send(answer)
        except StopIteration as done:
            if rank in self.keep:
                self.results[rank] = done.value
            return
        key = (type(request).__name__, request.peers.group)
        if isinstance(request, Reduce):  # folded in now: N inputs are never held
            self._sums.setdefault(key, _RankOrderSum()).add(request.peers.rank,
                                                            request.x.clone())
            request.x = None
        waiting = self._waiting.setdefault(key, {})
        waiting[request.peers.rank] = (rank, steps, request)
        if len(waiting) == request.peers.size:
            del self._waiting[key]
            self._answer(key, [waiting[i] for i in range(request.peers.size)])

    def _answer(self, key: tuple, members: list[tuple[int, Steps, Request]]) -> None:
        """Give each member what the real transfer would, then let it go on."""
        first, n = members[0][2], len(members)
        if isinstance(first, AllGather):
            rows = [request.row for _, _, request in members]
            gathered = first.then(torch.stack(rows) if first.fixed else rows)
            answer = lambda i: gathered  # noqa: E731 - the same bytes for every member
        elif isinstance(first, AllToAll):
            answer = lambda i: _received([r.rows for _, _, r in members], i,  # noqa: E731
                                         isinstance(first.received, int))
        else:
            total = self._sums.pop(key).total
            total = total / n if first.op == "avg" else total
            answer = lambda i: total.view(n, -1)[i] if first.scatter else total  # noqa: E731
        for i, (rank, steps, _) in enumerate(members):
            self._advance(rank, steps, answer(i))


def _received(rows_by_source: list, index: int, stacked: bool):
    """What a destination gets: row ``index`` of every source, in source order (stacked
    for fixed-size rows, as the real transport returns them)."""
    picked = [rows[index] for rows in rows_by_source]
    return torch.stack(picked) if stacked or isinstance(rows_by_source[0], torch.Tensor) else (
        picked)


def played_transfer(send_codec: Codec, recv_codec: Codec, tensor: torch.Tensor, *,
                    rng_stream: int, key: str, stats: Stats | None = None,
                    label: str = "p2p", send_memory: ErrorFeedback | None = None
                    ) -> torch.Tensor:
    """What :func:`commpress.recv` writes on the receiver when the sender calls
    :func:`commpress.isend` on ``tensor`` (``rng_stream``: the sender's global rank;
    ``key``: ``"<label>-><dst>"``; ``send_memory``: the sender's) — the same encode, bytes
    and decode into a new tensor."""
    payload = encode_payload(send_codec, tensor, Stats() if stats is None else stats, label,
                             tensor.device, rng_stream=rng_stream, key=key,
                             memory=send_memory)
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return decode_payload(recv_codec, payload, out)
