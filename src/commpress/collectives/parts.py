"""Compressed reduce-scatter with uneven parts: each rank gets the sum of what every
rank holds for it, whatever its length.

:func:`commpress.reduce_scatter` needs ``world`` equal chunks. An engine that owns
parameters by ranges (DeepSpeed's ZeRO partitions a flat buffer; a gradient bucket
covers some ranks' ranges and not others) has parts of any length per rank, zero
included. Padding them to the longest would send the longest part to every rank —
up to ``world`` times the bytes of the engine's own reduction — so each part is
encoded on its own and one all-to-all with uneven rows moves them: a rank receives
only its elements, each encoded once (as :mod:`commpress.collectives.compressed_reduce_scatter`),
decoded and summed in fp32, in rank order.

With ``intra``/``inter`` codecs and several nodes, two levels as TLq-HS
(:mod:`commpress.collectives.hierarchical`): step 1 sends inside the node, to local
rank ``l``, the parts of every node's rank ``l``; step 2 sends those node sums across
nodes among the ranks of one local index. The ``intra`` result is decoded before the
``inter`` encode (no fused re-quantization: the parts of one rank are not aligned to
the codec's groups across nodes).

Bytes this rank sends: ``Σ_{r≠me} wire(len(parts[r]))``; two levels:
``Σ_{l'≠l} wire_intra(Σ_n len(parts[n·L + l']))`` inside the node and
``Σ_{n'≠n} wire_inter(len(parts[n'·L + l]))`` across nodes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.codecs import packet_to_bytes
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import AnyCodec, begin
from commpress.collectives.comm import Exchange, resolve_group
from commpress.collectives.topology import Topology


def reduce_scatter_parts(
    parts: list[torch.Tensor],
    codec="none",
    *,
    intra=None,
    inter=None,
    topology: Topology | None = None,
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
) -> torch.Tensor:
    """Sum (``op="sum"``) or mean (``"avg"``) over ranks of the part each rank holds for
    this rank, in fp32.

    Args:
        parts: ``world`` 1-D tensors of one floating dtype; ``parts[r]`` is what this rank
            contributes to rank ``r``. Every rank passes the same lengths (checked).
        codec: the codec of a one-level call.
        intra, inter: the codecs of a two-level call (both, instead of ``codec``).
        topology: node layout for two levels (default from ``LOCAL_WORLD_SIZE``).
        label: key for :func:`commpress.stats` (``label.intra`` / ``label.inter`` with
            two levels; default ``"reduce_scatter_parts"``).

    Returns:
        ``len(parts[rank])`` fp32 values.

    Example::

        mine = commpress.collectives.parts.reduce_scatter_parts(
            [slice_for_0, slice_for_1], "int4", label="dp.grad")
    """
    if (intra is None) != (inter is None):
        raise ValueError("reduce_scatter_parts: two levels need both intra and inter codecs; "
                         f"got intra={intra!r}, inter={inter!r}")
    codecs = {"single": codec} if intra is None else {"intra": intra, "inter": inter}
    world = dist.get_world_size(resolve_group(group))
    if len(parts) != world:
        raise ValueError(f"reduce_scatter_parts: {len(parts)} parts for a group of {world} "
                         "ranks; allowed: one part per rank")
    sizes = [p.numel() for p in parts]
    rpn = (topology or Topology()).ranks_per_node_in(world)
    # every rank must agree on the codecs, the parts' lengths and the node size before
    # a byte moves (and before the node sub-groups are made)
    call = begin("reduce_scatter_parts", group, label, codecs, op=op,
                 tensors={"parts": parts[0]}, sizes=sizes, ranks_per_node=rpn)
    total = _two_levels(parts, call, rpn) if intra is not None else _level(
        parts, call.codecs["single"], call.group, call.stats, call.label, call.rank)
    return total.div_(world) if op == "avg" else total


def _two_levels(parts: list[torch.Tensor], call, rpn: int) -> torch.Tensor:
    levels = call.ctx.levels(call.group, rpn)
    intra, inter, label = call.codecs["intra"], call.codecs["inter"], call.label
    if levels.nodes == 1:  # one node, or one rank per node: one level
        return _level(parts, intra, call.group, call.stats, f"{label}.intra", call.rank)
    if levels.ranks_per_node == 1:
        return _level(parts, inter, call.group, call.stats, f"{label}.inter", call.rank)
    L, nodes, local = levels.ranks_per_node, levels.nodes, levels.local_rank
    # Step 1: local rank l receives, from each rank of the node, the parts of ranks
    # (node 0, l), (node 1, l), … and sums them
    node_parts = [torch.cat([parts[n * L + j].reshape(-1) for n in range(nodes)])
                  for j in range(L)]
    partial = _level(node_parts, intra, levels.intra, call.stats, f"{label}.intra", local)
    # Step 2: the node sums cross the slow link once, to the rank of this local index
    across = list(partial.split([parts[n * L + local].numel() for n in range(nodes)]))
    return _level(across, inter, levels.inter, call.stats, f"{label}.inter", levels.node)


def _level(parts: list[torch.Tensor], codec: AnyCodec, group: dist.ProcessGroup,
           stats: Stats, label: str, me: int) -> torch.Tensor:
    """One level: encode each part, one all-to-all, decode and sum this rank's rows."""
    device, dtype = parts[me].device, parts[me].dtype
    padded = [chunks.padded_chunk(codec, p.numel()) for p in parts]
    # Step 1: encode each rank's part once, padded to the codec's alignment
    with stats.timed(label, "encode_s", device):
        rows = [_encode_part(codec, p, m, me, f"{label}#{r}")
                for r, (p, m) in enumerate(zip(parts, padded))]
    count_sent(stats, label, sum(m for r, m in enumerate(padded) if r != me),
               sum(row.numel() for r, row in enumerate(rows) if r != me),
               parts[me].element_size())
    # Step 2: one all-to-all of the byte rows. A fixed-rate codec's rows for this rank
    # all have the size of the one it sends itself; a variable-rate codec's sizes
    # travel first.
    with stats.timed(label, "comm_s", device):
        if chunks.splittable(codec):
            received = _all_to_all_rows(rows, rows[me].numel(), group)
        else:
            received = Exchange(rows, group).wait()
    n = parts[me].numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    # Step 3: decode every rank's row for this rank and sum in fp32, in rank order
    # (one call: fused for group quantizers)
    with stats.timed(label, "decode_s", device):
        return chunks.decode_sum_rows(codec, received, padded[me], dtype)[:n]


def _all_to_all_rows(rows: list[torch.Tensor], width: int,
                     group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``rows[r]`` to rank ``r``; receive ``width`` bytes from each → ``(world, width)``."""
    received = torch.empty(len(rows), width, dtype=torch.uint8, device=rows[0].device)
    dist.all_to_all_single(received.view(-1), torch.cat(rows),
                           output_split_sizes=[width] * len(rows),
                           input_split_sizes=[r.numel() for r in rows], group=group)
    return received


def _encode_part(codec: AnyCodec, part: torch.Tensor, padded: int, rng_stream: int,
                 key: str) -> torch.Tensor:
    if padded == 0:
        return torch.empty(0, dtype=torch.uint8, device=part.device)
    x = part.reshape(-1)
    if padded != x.numel():
        x = torch.cat([x, x.new_zeros(padded - x.numel())])
    return packet_to_bytes(chunks.encode(codec, x, rng_stream=rng_stream, key=key))
