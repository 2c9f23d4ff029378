"""Rank functions for ranks that send each other on one tag (module level: picklable)."""

import torch

import commpress
from commpress.collectives.played import played_transfer

CODECS = ("none", "int8", "int4:hadamard=128")
SIZES = (1000, 0, 3, 257)  # one call after another, an empty tensor among them
TAGS = (0, 2**31 - 1)


def _data(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g)


def _expected(spec: str, src: int, numel: int, seed: int, label: str, dst: int) -> torch.Tensor:
    """What the receiver must hold: the sender's tensor through the same encode/decode."""
    return played_transfer(commpress.codec(spec), commpress.codec(spec), _data(src, numel, seed),
                           rng_stream=src, key=f"{label}->{dst}")


def _run(ops: list) -> list[str]:
    """Post ``ops`` in one batch and wait for every handle; the outcome of each."""
    try:
        handles = commpress.batch_isend_irecv(ops)
    except commpress.CollectiveMismatchError as e:
        return [f"batch: {e}"] * len(ops)
    outcomes = []
    for h in handles:
        try:
            h.wait()
            outcomes.append("ok")
        except commpress.CollectiveMismatchError as e:
            outcomes.append(f"wait: {e}")
    return outcomes


def exchange(rank, world):
    """Two ranks send each other on the same tag in one batch, call after call; per
    (codec, tag, call): whether the received tensor is the peer's, decoded."""
    peer, out = 1 - rank, {}
    for spec in CODECS:
        for tag in TAGS:
            for call, numel in enumerate(SIZES):
                seed = call + tag % 7
                got = torch.full((numel,), 7.0)
                ops = [commpress.P2POp("send", _data(rank, numel, seed), peer, spec, tag=tag),
                       commpress.P2POp("recv", got, peer, spec, tag=tag)]
                if call % 2:
                    ops.reverse()  # the order within a batch must not matter
                outcomes = _run(ops)
                want = _expected(spec, peer, numel, seed, "p2p", rank)
                out[(spec, tag, call)] = outcomes == ["ok", "ok"] and torch.equal(got, want)
    return out


def two_each_way(rank, world):
    """Two transfers of different sizes each way between two ranks in one batch, on one
    tag (activations one way and gradients the other, as a 1F1B step); matched in order."""
    peer, out = 1 - rank, {}
    for call in range(3):
        sizes = (64 + call, 5)
        gots = [torch.empty(n) for n in sizes]
        ops = [commpress.P2POp("send", _data(rank, n, 40 + i), peer, "int8", label="pp")
               for i, n in enumerate(sizes)]
        ops += [commpress.P2POp("recv", g, peer, "int8", label="pp") for g in gots]
        outcomes = _run(ops)
        out[call] = outcomes == ["ok"] * 4 and all(
            torch.equal(g, _expected("int8", peer, n, 40 + i, "pp", rank))
            for i, (g, n) in enumerate(zip(gots, sizes)))
    return out


def ring_both_ways(rank, world):
    """Every rank sends to and receives from both neighbours at once, on one tag."""
    left, right = (rank - 1) % world, (rank + 1) % world
    out = {}
    for spec in CODECS:
        for call in range(3):
            numel = 300 + call
            from_left, from_right = torch.empty(numel), torch.empty(numel)
            ops = [commpress.P2POp("recv", from_left, left, spec, label="ring"),
                   commpress.P2POp("send", _data(rank, numel, call), right, spec, label="ring"),
                   commpress.P2POp("recv", from_right, right, spec, label="ring"),
                   commpress.P2POp("send", _data(rank, numel, call), left, spec, label="ring")]
            outcomes = _run(ops)
            out[(spec, call)] = (
                outcomes == ["ok"] * 4
                and torch.equal(from_left, _expected(spec, left, numel, call, "ring", rank))
                and torch.equal(from_right, _expected(spec, right, numel, call, "ring", rank)))
    return out


MISMATCHES = ("rank 1 expects more", "both expect more")


def mismatched_exchange(rank, case):
    """Two ranks exchange on one tag, one or both receiving a size other than the one
    sent; returns (outcomes, receive untouched?, a matching exchange afterwards right?)."""
    peer = 1 - rank
    wrong = {"rank 1 expects more": {1}, "both expect more": {0, 1}}[case]
    numel = 100 + (3 if rank in wrong else 0)
    got = torch.full((numel,), 7.0)
    outcomes = _run([commpress.P2POp("send", _data(rank, 100, 1), peer, "int8", tag=5),
                     commpress.P2POp("recv", got, peer, "int8", tag=5)])
    untouched = bool((got == 7.0).all())
    # the tag's traffic is drained: the next exchange on it works
    again = torch.empty(50)
    after = _run([commpress.P2POp("send", _data(rank, 50, 2), peer, "int4:hadamard=128", tag=5),
                  commpress.P2POp("recv", again, peer, "int4:hadamard=128", tag=5)])
    right = after == ["ok", "ok"] and torch.equal(
        again, _expected("int4:hadamard=128", peer, 50, 2, "p2p", rank))
    return outcomes, untouched, right


def two_ranks(rank, world):
    """Every two-rank scenario, one after another in the same processes (so each also
    starts on channels the previous one left behind)."""
    return {"exchange": exchange(rank, world), "two_each_way": two_each_way(rank, world),
            "mismatch": {case: mismatched_exchange(rank, case) for case in MISMATCHES}}
