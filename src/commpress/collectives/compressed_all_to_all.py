"""Compressed all-to-all of rows: what expert parallelism sends (tokens to their experts
and expert outputs back), shaped like ``torch.distributed.all_to_all_single``.

Each rank sends ``input_split_sizes[j]`` rows of its input to rank ``j`` and receives
``output_split_sizes[j]`` rows from it. A row (a token's hidden vector) is padded to the
codec's alignment and encoded on its own — no codec group or Hadamard block spans two
rows — so a token's codes never depend on another token, on which rank it came from, or
on how the rows are split. All rows are encoded in one codec call and decoded in one,
the received blocks end to end; a rank's rows for itself are decoded from their codes
too, so a token's value does not depend on whether its expert is local.

Ranks agree on more than equal fields here: rank ``r``'s input split for ``j`` must be
rank ``j``'s output split from ``r``. Each rank's share of a checksum of the splits rides
the agreement's header (no extra round trip; :func:`split_balance`), and when the sum
fails the ranks exchange their splits: a mismatch raises the same
:class:`CollectiveMismatchError` everywhere, naming the pair, before a byte of payload
moves. A rank whose own arguments are wrong (splits that do not sum to its rows, a
non-float tensor) tells the others in that same exchange, so every rank raises, naming
the field — none waits for it.

Bytes this rank sends: ``Σ_{j≠rank} input_split_sizes[j] · row_bytes`` with ``row_bytes``
the codec's wire size of one padded row.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch
import torch.distributed as dist

from commpress.codecs import Codec
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import check_float, end, is_exact, resolve_codec
from commpress.collectives.comm import describe, resolve_group
from commpress.collectives.group_context import context
from commpress.collectives.handle import Handle
from commpress.collectives.mismatch import CollectiveMismatchError
from commpress.collectives.topology import Topology
from commpress.collectives.transport import AllToAll, Peers, Steps, run_into
from commpress.validate import InputError


def all_to_all_steps(rows: torch.Tensor, input_splits: list[int], output_splits: list[int],
                     codecs: list[Codec], peers: Peers, stats: Stats,
                     labels: list[str]) -> Steps:
    """One rank's all-to-all of ``rows`` (``(N, D)``, any float dtype): ``input_splits[j]``
    rows to peer ``j`` → the ``(sum(output_splits), D)`` rows received, peer order, in
    ``rows``' dtype. ``codecs[j]`` is the (fixed-rate) codec of the link to peer ``j``,
    which it uses back, ``labels[j]`` that link's stats label. Consecutive peers of one
    codec object are encoded in one call and decoded in one; exact rows travel as their
    own bytes."""
    (_, D), dtype = rows.shape, rows.dtype
    me, itemsize = peers.rank, rows.element_size()
    runs = _runs(codecs)
    widths = [0] * peers.size
    blocks: list[torch.Tensor] = []
    starts = [0, *itertools.accumulate(input_splits)]
    for a, b in runs:
        codes = _encode(rows[starts[a]:starts[b]], codecs[a], labels[a], stats, me)
        widths[a:b] = [codes.shape[1]] * (b - a)
        blocks += codes.reshape(-1).split([s * codes.shape[1] for s in input_splits[a:b]])
    del rows
    # the elements are the rows' own (padding is part of what the codec costs)
    for lab in dict.fromkeys(labels):
        others = [j for j in range(peers.size) if labels[j] == lab and j != me]
        count_sent(stats, lab, sum(input_splits[j] for j in others) * D,
                   sum(blocks[j].numel() for j in others), itemsize)
    received = yield AllToAll(peers, stats, labels[me], False, blocks,
                              [s * w for s, w in zip(output_splits, widths)])
    # Step 2: decode what each run of peers sent, this rank's own rows too
    out = []
    for a, b in runs:
        count = sum(output_splits[a:b])
        codes = torch.cat([r.reshape(-1) for r in received[a:b]]).view(count, widths[a])
        out.append(_decode(codes, codecs[a], D, dtype, labels[a], stats))
    return torch.cat(out)


def _runs(codecs: list[Codec]) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of consecutive peers that share one codec object."""
    bounds = [0] + [j for j in range(1, len(codecs)) if codecs[j] is not codecs[j - 1]]
    return list(zip(bounds, [*bounds[1:], len(codecs)]))


def _encode(rows: torch.Tensor, codec: Codec, label: str, stats: Stats,
            rng_stream: int) -> torch.Tensor:
    """``(N, width)`` bytes of the rows: their own (exact), or each padded to the codec's
    alignment and encoded alone, all in one call."""
    (N, D), device = rows.shape, rows.device
    if is_exact(codec):
        return rows.contiguous().view(torch.uint8).view(N, D * rows.element_size())
    D_pad = chunks.padded_chunk(codec, D)
    if N == 0:
        return torch.empty(0, codec.wire_bytes(D_pad, rows.dtype), dtype=torch.uint8,
                           device=device)
    x = rows if D_pad == D else torch.nn.functional.pad(rows, (0, D_pad - D))
    with stats.timed(label, "encode_s", device):
        return chunks.encode_rows(codec, x, key=label, rng_stream=rng_stream)


def _decode(codes: torch.Tensor, codec: Codec, D: int, dtype: torch.dtype, label: str,
            stats: Stats) -> torch.Tensor:
    """The ``(rows, D)`` values of :func:`_encode`'s bytes."""
    if is_exact(codec):
        return codes.view(dtype).view(codes.shape[0], D)
    if codes.shape[0] == 0:
        return torch.empty(0, D, dtype=dtype, device=codes.device)
    with stats.timed(label, "decode_s", codes.device):
        values = chunks.decode_rows(codec, codes, chunks.padded_chunk(codec, D), dtype)
    return values[:, :D].to(dtype)


def check_splits(name: str, splits, rows: int, world: int) -> list[int]:
    """``splits`` as a list of ``world`` non-negative ints summing to ``rows`` (``None``:
    even), or an :class:`InputError` naming the field."""
    if splits is None:
        if rows % world:
            raise InputError(f"all_to_all: {name}=None (even splits) needs rows divisible by "
                             f"the group size {world}; got {rows} rows: pass {name}")
        return [rows // world] * world
    # a tensor or a numpy array (Megatron keeps its splits as host arrays) as ints
    splits = splits.tolist() if hasattr(splits, "tolist") else splits
    if (not isinstance(splits, list | tuple) or len(splits) != world
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                       for s in splits)):
        raise InputError(f"all_to_all: {name}={splits!r} is not allowed; allowed: {world} "
                         "non-negative ints (one per rank of the group)")
    if sum(splits) != rows:
        raise InputError(f"all_to_all: {name}={list(splits)} sums to {sum(splits)}; allowed: "
                         f"splits summing to the tensor's {rows} rows (its first dimension)")
    return list(splits)


def _local_check(output: torch.Tensor, input: torch.Tensor, output_split_sizes,
                 input_split_sizes, world: int) -> tuple[list[int], list[int]]:
    check_float("input", input)
    check_float("output", output)
    if input.dim() == 0 or output.dim() == 0:
        raise InputError("all_to_all: 0-d tensors are not allowed; allowed: tensors whose "
                         "first dimension is the rows (tokens)")
    if input.dtype != output.dtype or input.shape[1:] != output.shape[1:]:
        raise InputError(f"all_to_all: output {output.dtype} {tuple(output.shape)} and input "
                         f"{input.dtype} {tuple(input.shape)} are not allowed; allowed: one "
                         "dtype and the same row shape (all but the first dimension)")
    return (check_splits("output_split_sizes", output_split_sizes, output.shape[0], world),
            check_splits("input_split_sizes", input_split_sizes, input.shape[0], world))


def split_balance(ranks: tuple[int, ...], rank: int, input_splits: list[int],
                  output_splits: list[int]) -> int:
    """This rank's share of a sum over ranks that is zero (mod 2⁶⁴) when every claim
    "rank ``r`` sends ``k`` rows to rank ``j``" is made alike by ``r`` (its input split)
    and by ``j`` (its output split): each claim hashed, added by the sender and taken
    away by the receiver. A mismatch leaves a non-zero sum but for a 2⁻⁶⁴ chance."""
    def claim(src: int, dst: int, k: int) -> int:
        text = f"{ranks[src]}>{ranks[dst]}:{k}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    sends = sum(claim(rank, j, k) for j, k in enumerate(input_splits))
    expects = sum(claim(j, rank, k) for j, k in enumerate(output_splits))
    return (sends - expects) % 2**64


def agree_on_splits(ctx, collective: str, label: str, fields: dict[str, object],
                    out_splits: list[int] | None, in_splits: list[int] | None,
                    refused: str | None) -> None:
    """The agreement of an all-to-all: the call's fields (or this rank's refusal) and its
    share of the splits' checksum (:func:`split_balance`) in one header; when the
    checksum fails, one more exchange of the splits names every pair that differs."""
    world = ctx.world
    if refused is not None:
        ctx.agree(collective, label=label, refused=refused)
        raise InputError(refused)  # every rank refused alike: each raises its own error
    _, balanced = ctx.agree_balanced(collective, split_balance(ctx.ranks, ctx.rank,
                                                               in_splits, out_splits),
                                     label=label, **fields)
    if balanced:
        return
    table = ctx.gather_words(in_splits + out_splits, collective, label)
    sends, expects = table[:, :world], table[:, world:]
    wrong = [(r, j) for r in range(world) for j in range(world)
             if int(sends[r, j]) != int(expects[j, r])]
    shown = "; ".join(f"rank {ctx.ranks[r]} sends {int(sends[r, j])} rows to rank "
                      f"{ctx.ranks[j]}, which expects {int(expects[j, r])}"
                      for r, j in wrong[:4])
    raise CollectiveMismatchError(
        f"commpress.{collective} (label {label!r}): ranks disagree on the splits, so the "
        f"call would corrupt data or hang: {shown}"
        + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
        + "; every rank's input_split_sizes[j] must equal rank j's output_split_sizes for "
        "it")


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    codec="none",
    group: dist.ProcessGroup | None = None,
    label: str | None = None,
    async_op: bool = False,
    *,
    intra=None,
    inter=None,
    topology: Topology | None = None,
) -> torch.Tensor | Handle:
    """Send ``input_split_sizes[j]`` rows of ``input`` to rank ``j``; receive
    ``output_split_sizes[j]`` rows from each rank ``j`` into ``output``, in rank order —
    :func:`torch.distributed.all_to_all_single`'s contract (splits ``None``: even), with
    every row (a token) encoded on its own with ``codec``. With ``codec="none"`` it is
    torch's own transfer, bit for bit.

    Args:
        output: ``(sum(output_split_sizes), *row_shape)``, the input's dtype.
        input: ``(sum(input_split_sizes), *row_shape)``, floating point.
        codec: a fixed-rate codec or spec (``"fp8"``, ``"int8"``, ``"int4:hadamard=128"``);
            rows are padded to its alignment, so any row width works.
        label: key for :func:`commpress.stats` (default ``"all_to_all"``).
        intra, inter: instead of ``codec``, the codec of rows to and from ranks on this
            rank's node, and to and from the other nodes (stats under ``label.intra`` and
            ``label.inter``); ``topology`` says which ranks share a node (default
            ``LOCAL_WORLD_SIZE``), by their global ranks.

    Every rank checks that the splits match across ranks (module docstring).

    Example::

        commpress.all_to_all(recv, tokens, out_splits, in_splits, "fp8", group=ep_group,
                             label="ep.dispatch")
    """
    if (intra is None) != (inter is None):
        raise InputError("all_to_all: two levels need both intra and inter codecs; got "
                         f"intra={intra!r}, inter={inter!r}")
    levels = {"codec": codec} if intra is None else {"intra": intra, "inter": inter}
    group = resolve_group(group)
    ctx = context(group)
    label = label or "all_to_all"
    refused = None
    out_splits = in_splits = None
    codecs: dict[str, Codec] = {}
    try:  # what this rank got wrong is told to the others in the agreement, not alone
        codecs = {name: resolve_codec(c, name) for name, c in levels.items()}
        out_splits, in_splits = _local_check(output, input, output_split_sizes,
                                             input_split_sizes, ctx.world)
        for name, c in codecs.items():
            if not (c.fixed_rate and c.alignment > 0):
                raise InputError(f"all_to_all: {name}={c.spec()!r} is not allowed; allowed: "
                                 "a fixed-rate codec (none, bf16, fp16, fp8, int8, int4, int2, "
                                 "sign, nf2): rows are exchanged at sizes known in advance")
    except (ValueError, TypeError) as e:  # InputError is a ValueError, as a bad spec's
        refused = str(e)
    fields = {} if refused else {
        **{name: c.spec() for name, c in codecs.items()}, "row_shape": tuple(input.shape[1:]),
        **{f"input.{k}": v for k, v in describe(input).items() if k != "numel"}}
    link = ["codec"] * ctx.world
    if intra is not None and refused is None:
        topology = topology or Topology()
        nodes = [topology.node_of(r) for r in ctx.ranks]
        fields["nodes"] = nodes  # every rank must see the same layout
        link = ["intra" if nodes[j] == nodes[ctx.rank] else "inter" for j in range(ctx.world)]
    agree_on_splits(ctx, "all_to_all", label, fields, out_splits, in_splits, refused)
    rows = input.detach().reshape(input.shape[0], math.prod(input.shape[1:]))  # 0 rows too
    if async_op and any(is_exact(c) for c in codecs.values()):
        rows = rows.clone()  # an exact block is sent from it until the transfer ends
    peers = Peers(ctx.rank, ctx.world, group)
    per_peer = [codecs[lv] for lv in link]
    labels = [label if lv == "codec" else f"{label}.{lv}" for lv in link]
    return end(run_into(output, lambda flat: all_to_all_steps(
        rows, in_splits, out_splits, per_peer, peers, ctx.stats, labels)), async_op)
