"""Ranks of the all-to-all tests (module level: picklable)."""

import torch
import torch.distributed as dist

import commpress
from commpress.collectives.byte_stats import Stats
from commpress.collectives.compressed_all_to_all import all_to_all_steps
from commpress.collectives.played import Played
from commpress.collectives.transport import Peers

SPECS = ["fp8", "int8", "int4:hadamard=128", "bf16"]


def splits_of(world: int, seed: int) -> list[list[int]]:
    """An uneven split matrix every rank builds alike: ``S[r][j]`` rows from ``r`` to ``j``,
    zero included."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (world, world), generator=g).tolist()


def rows_of(rank: int, n: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(n, width, generator=g) * (1 + rank)).to(dtype)


def exchange(rank, world, width, dtype, seed=0):
    """Uneven splits through every codec: ``none`` equals torch's all_to_all_single bit for
    bit; each compressed row equals that row alone through the codec (rows are encoded on
    their own); the played transport gives the same bits; async_op too."""
    S = splits_of(world, seed)
    in_splits, out_splits = S[rank], [S[j][rank] for j in range(world)]
    x = rows_of(rank, sum(in_splits), width, dtype, seed)
    out = {}
    mine = torch.empty(sum(out_splits), width, dtype=dtype)
    commpress.all_to_all(mine, x, out_splits, in_splits, "none", label="ep")
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, x, out_splits, in_splits)
    out["none_is_torch"] = torch.equal(mine, theirs)
    for spec in SPECS:
        got = torch.empty(sum(out_splits), width, dtype=dtype)
        commpress.all_to_all(got, x, out_splits, in_splits, spec, label=f"ep.{spec}")
        # what each source sent this rank, each row through the codec on its own
        expected = []
        for src in range(world):
            rows = rows_of(src, sum(S[src]), width, dtype, seed)
            start = sum(S[src][:rank])
            for row in rows[start:start + S[src][rank]]:
                c = commpress.codec(spec)
                a = max(c.alignment, 1)
                padded = torch.zeros(-(-width // a) * a, dtype=dtype)
                padded[:width] = row
                expected.append(c.decode(c.encode(padded))[:width].to(dtype))
        expected = torch.stack(expected) if expected else torch.empty(0, width, dtype=dtype)
        out[f"{spec}_row_alone"] = torch.equal(got, expected)
        out[f"{spec}_error"] = (((got.double() - theirs.double()).norm()
                                 / theirs.double().norm().clamp_min(1e-30)).item())
        # the played transport: every rank's steps in this process, the same bits
        played = Played(world, lambda r, rows, spec=spec: all_to_all_steps(
            rows, S[r], [S[j][r] for j in range(world)], [commpress.codec(spec)] * world,
            Peers(r, world, tuple(range(world))), Stats(), ["ep"] * world))
        for r in range(world):
            played.add(r, rows_of(r, sum(S[r]), width, dtype, seed).reshape(sum(S[r]), width))
        out[f"{spec}_played"] = torch.equal(played.finish()[rank], got)
    handle = commpress.all_to_all(torch.empty_like(mine), x, out_splits, in_splits, "int8",
                                  async_op=True)
    x.zero_()  # the caller may reuse its input once the call returns
    again = torch.empty_like(mine)
    commpress.all_to_all(again, rows_of(rank, sum(in_splits), width, dtype, seed), out_splits,
                         in_splits, "int8")
    out["async"] = torch.equal(handle.wait(), again)
    return out


def non_finite(rank, world):
    """A NaN and an Inf token stay non-finite; tokens sent beside them stay finite."""
    x = torch.randn(2 * world, 64)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    out = torch.empty_like(x)
    commpress.all_to_all(out, x, codec="int8")
    return {"rows_finite": torch.isfinite(out).all(dim=1).tolist()}


def bad_splits(rank, world, case):
    """What one rank, or the ranks together, get wrong: every rank raises, naming it."""
    x = torch.randn(2 * world, 8)
    out = torch.empty_like(x)
    in_splits = [2] * world
    out_splits = [2] * world
    if case == "disagree" and rank == 0:
        in_splits = [3, 1] + [2] * (world - 2)
    if case == "sum" and rank == 1:
        in_splits = [2] * (world - 1) + [1]
    if case == "int" and rank == 1:
        x = x.to(torch.int64)
    if case == "spec" and rank == 1:
        return _error(lambda: commpress.all_to_all(out, x, out_splits, in_splits, "int9",
                                                   label="ep"))
    if case == "numpy":  # Megatron's host arrays are splits too
        import numpy as np

        return _error(lambda: commpress.all_to_all(out, x, np.array(out_splits),
                                                   np.array(in_splits), "int8", label="ep"))
    if case == "codec" and rank == 0:
        return _error(lambda: commpress.all_to_all(out, x, out_splits, in_splits, "int8",
                                                   label="ep"))
    try:
        commpress.all_to_all(out, x, out_splits, in_splits, "int4" if case == "codec" else
                             "int8", label="ep")
    except Exception as e:  # noqa: BLE001 - the test reads the error's type and text
        return f"{type(e).__name__}: {e}"
    return None


def _error(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads the error's type and text
        return f"{type(e).__name__}: {e}"
    return None


def no_rows(rank, world):
    """A rank with no tokens at all (it sends and receives nothing), beside ranks that
    exchange among themselves: every codec, and the gradient's way back."""
    out = {}
    sends = [0] * world if rank == 0 else [0] + [3] * (world - 1)
    expects = [0] * world if rank == 0 else [0] + [3] * (world - 1)
    for spec in ["none", *SPECS]:
        x = rows_of(rank, sum(sends), 40, torch.float32)
        got = torch.empty(sum(expects), 40)
        commpress.all_to_all(got, x, expects, sends, spec)
        out[spec] = tuple(got.shape)
    return out


def two_levels(rank, world, width):
    """``intra``/``inter``: rows between ranks of one node travel exact, rows across nodes
    through the inter codec, each on its own; the stats count each link apart."""
    S = splits_of(world, seed=7)
    in_splits, out_splits = S[rank], [S[j][rank] for j in range(world)]
    x = rows_of(rank, sum(in_splits), width, torch.float32, seed=7)
    commpress.reset_stats()
    got = torch.empty(sum(out_splits), width)
    commpress.all_to_all(got, x, out_splits, in_splits, intra="none", inter="int8",
                         topology=commpress.Topology(2), label="ep")
    node = rank // 2
    expected = []
    for src in range(world):
        rows = rows_of(src, sum(S[src]), width, torch.float32, seed=7)
        start = sum(S[src][:rank])
        for row in rows[start:start + S[src][rank]]:
            if src // 2 == node:
                expected.append(row)
            else:
                c = commpress.codec("int8")
                padded = torch.zeros(-(-width // 128) * 128)
                padded[:width] = row
                expected.append(c.decode(c.encode(padded))[:width])
    expected = torch.stack(expected) if expected else torch.empty(0, width)
    stats = commpress.stats()
    return {"rows": torch.equal(got, expected),
            "intra": stats.get("ep.intra", {}), "inter": stats.get("ep.inter", {})}
