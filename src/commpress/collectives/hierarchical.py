"""Two-level collectives: data crosses the slow links between nodes once, compressed.

:func:`hierarchical_reduce_scatter` is SDP4Bit's TLq-HS (Jia et al., NeurIPS 2024);
:func:`hierarchical_all_gather` is its mirror image for the way back (as ZeRO++'s
hierarchical partitioning keeps the second hop inside the node), and
:func:`hierarchical_all_reduce` reduces inside the node, all-reduces the node sums
across nodes, and shares the result inside the node.

TLq-HS:

Inside a node links are fast, across nodes slow, so the gradient crosses the slow
links once, at 4 bits, after an 8-bit exchange inside the node:

1. Hadamard-rotate and encode the input with the ``intra`` codec (8-bit), laid out
   so that local rank ``l`` receives every chunk destined for local index ``l``;
2. all-to-all inside the node;
3. sum-requantize: decode the node's chunks, sum in fp32, re-encode with the
   ``inter`` codec (4-bit) — still in the rotated domain, one fused kernel, no
   second rotation (:meth:`Codec.sum_requantize`);
4. all-to-all across nodes among ranks with the same local index;
5. decode-sum: decode the nodes' chunks, sum in the rotated domain, rotate back once
   (:meth:`Codec.decode_sum`) → this rank's shard of the global reduce-scatter.

Step 3 is fused when the ``intra`` codec can re-encode into the ``inter`` one (group
quantizers with the same Hadamard size); otherwise each level uses its codec's own
encode/decode (any codec works, at the cost of an extra rotation). One node, or one
rank per node, falls back to a single level. The codecs only transform bytes; this
module only moves them.

Bytes this rank sends: ``(L − 1) · nodes · wire_intra(m)`` inside the node and
``(nodes − 1) · wire_inter(m)`` across nodes, for an output of ``m`` elements.

The all-gather sends each shard (``m`` elements) across nodes once, encoded with the
``inter`` codec, to the ranks with the same local index, then the decoded values
inside the node: ``(nodes − 1) · wire_inter(m)`` across and ``(L − 1) · nodes ·
wire_intra(m)`` inside. A flat ring all-gather over the same ranks pushes
``(world − 1) · m`` elements through each node's link instead of ``(nodes − 1) · L · m``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from commpress.codecs import Codec, ErrorFeedback
from commpress.collectives import chunks
from commpress.collectives.byte_stats import Stats, count_sent
from commpress.collectives.call import Call, begin, end, is_exact, resolve_codec
from commpress.collectives.comm import check_sizes, resolve_group
from commpress.collectives.compressed_all_gather import all_gather_steps, run_all_gather
from commpress.collectives.compressed_all_reduce import all_reduce_steps
from commpress.collectives.compressed_reduce_scatter import (
    exchange_and_sum,
    reduce_scatter_steps,
    send_rows,
)
from commpress.collectives.handle import Handle
from commpress.collectives.topology import Topology, level_label, levels_used
from commpress.collectives.transport import AllToAll, Peers, Steps, run, run_into
from commpress.validate import InputError

EXACT = resolve_codec("none")


def begin_two_level(collective: str, group: dist.ProcessGroup | None, label: str | None,
                    intra, inter, topology: Topology | None, *,
                    tensors: dict[str, torch.Tensor], op: str | None = None,
                    check=None, intra_memory: ErrorFeedback | None = None,
                    inter_memory: ErrorFeedback | None = None, **fields: object
                    ) -> tuple[Call, tuple[str, ...], tuple[Peers, Peers, Peers]]:
    """The prologue of a two-level collective: agree on everything, including the node
    size, *before* the sub-groups are made (ranks that disagree on it would otherwise
    wait for each other in ``new_group``). Returns the call, the levels used
    (:func:`levels_used`) and this rank's peers in the whole group, inside its node and
    across nodes (the ranks of its local index).
    """
    topology = topology or Topology()
    world = dist.get_world_size(resolve_group(group))
    rpn = topology.ranks_per_node_in(world)
    call = begin(collective, group, label, {"intra": intra, "inter": inter}, op=op,
                 memories={"intra": intra_memory, "inter": inter_memory}, tensors=tensors,
                 check=check, ranks_per_node=rpn, **fields)
    levels = call.ctx.levels(call.group, rpn)
    peers = (Peers(call.rank, call.world, call.group),
             Peers(levels.local_rank, levels.ranks_per_node, levels.intra),
             Peers(levels.node, levels.nodes, levels.inter))
    return call, levels_used(True, world, rpn), peers


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    intra="int8:hadamard=128",
    inter="int4:hadamard=128",
    topology: Topology | None = None,
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
    async_op: bool = False,
    intra_memory: ErrorFeedback | None = None,
    inter_memory: ErrorFeedback | None = None,
) -> torch.Tensor | Handle:
    """Two-level reduce-scatter of ``input`` (``world × output.numel()``) into ``output``.

    Rank ``r`` gets the sum or mean over all ranks of chunk ``r``, exactly as
    :func:`commpress.reduce_scatter`. Stats go to ``label + ".intra"`` and
    ``label + ".inter"`` (default label ``"hierarchical_reduce_scatter"``).
    ``intra_memory``/``inter_memory``: error feedback around each level's encode (a
    level with memory does not fuse its re-quantization: the residual needs the values
    it sent).

    Example::

        commpress.hierarchical_reduce_scatter(shard, grads, intra="int8:hadamard=128",
                                              inter="int4:hadamard=128", label="dp.grad")
    """
    call, used, peers = begin_two_level(
        "hierarchical_reduce_scatter", group, label, intra, inter, topology, op=op,
        intra_memory=intra_memory, inter_memory=inter_memory,
        tensors={"input": input, "output": output},
        check=lambda n: check_sizes("hierarchical_reduce_scatter", input, output, n, "input",
                                    "output"))
    return end(run_into(output, lambda out: reduce_scatter_levels_steps(
        input.reshape(-1), out.numel(), call.codecs, used, *peers, call.stats, call.label, op,
        call.rank, call.memories)), async_op)


def reduce_scatter_levels_steps(flat: torch.Tensor, sizes: int | list[int],
                                codecs: dict[str, Codec], used: tuple[str, ...],
                                peers: Peers, intra: Peers, inter: Peers, stats: Stats,
                                label: str, op: str, rank: int,
                                memories: dict[str, ErrorFeedback | None] | None = None
                                ) -> Steps:
    """A reduce-scatter (even or uneven ``sizes``, :func:`reduce_scatter_steps`) on the
    levels ``used`` (:func:`levels_used`): one level over ``peers`` with that level's
    codec, memory and label, or TLq-HS over ``intra``/``inter``."""
    memories = memories or {}
    if len(used) == 1:
        return reduce_scatter_steps(flat, sizes, codecs[used[0]], peers, stats,
                                    level_label(label, used[0]), op,
                                    memory=memories.get(used[0]))
    return two_level_reduce_scatter_steps(flat, sizes, codecs["intra"], codecs["inter"],
                                          intra, inter, stats, label, op, rank,
                                          memories.get("intra"), memories.get("inter"))


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
    async_op: bool = False,
    memory: ErrorFeedback | None = None,
    intra_memory: ErrorFeedback | None = None,
    inter_memory: ErrorFeedback | None = None,
) -> torch.Tensor | Handle:
    """Reduce-scatter with uneven parts: the sum (``op="sum"``) or mean (``"avg"``) over
    ranks of the part each rank holds for this rank, in fp32.

    :func:`commpress.reduce_scatter` needs ``world`` equal chunks. An engine that owns
    parameters by ranges (DeepSpeed's ZeRO partitions a flat buffer; a gradient bucket
    covers some ranks' ranges and not others) has parts of any length per rank, zero
    included. Padding them to the longest would send the longest part to every rank —
    up to ``world`` times the bytes of the engine's own reduction — so each part is
    padded to the codec's alignment alone and one all-to-all with uneven rows moves
    them: a rank receives only its elements, each encoded once. The steps are those of
    the even reduce-scatter (one encode for all parts of a fixed-rate codec; with
    ``intra``/``inter``, TLq-HS with its fused re-quantization).

    Args:
        parts: ``world`` 1-D tensors of one floating dtype; ``parts[r]`` is what this rank
            contributes to rank ``r``. Every rank passes the same lengths (checked).
        codec: the codec of a one-level call.
        intra, inter: the codecs of a two-level call (both, instead of ``codec``).
        topology: node layout for two levels (default from ``LOCAL_WORLD_SIZE``).
        label: key for :func:`commpress.stats` (``label.intra`` / ``label.inter`` with
            two levels; default ``"reduce_scatter_parts"``).
        memory, intra_memory, inter_memory: error feedback around the encode of the
            one level, or of each of two.

    Returns:
        ``len(parts[rank])`` fp32 values (a :class:`Handle` with ``async_op``).

    Example::

        mine = commpress.reduce_scatter_parts([slice_for_0, slice_for_1], "int4",
                                              label="dp.grad")
    """
    if (intra is None) != (inter is None):
        raise InputError("reduce_scatter_parts: two levels need both intra and inter codecs; "
                         f"got intra={intra!r}, inter={inter!r}")
    world = dist.get_world_size(resolve_group(group))
    if not isinstance(parts, list | tuple) or len(parts) != world:
        raise InputError(f"reduce_scatter_parts: parts={type(parts).__name__} of "
                         f"{len(parts) if isinstance(parts, list | tuple) else '?'} is not "
                         f"allowed; allowed: a list of one 1-D tensor per rank ({world})")
    if len({p.dtype for p in parts}) != 1:
        raise InputError("reduce_scatter_parts: parts of dtypes "
                         f"{sorted({str(p.dtype) for p in parts})} are not allowed; allowed: "
                         "one floating dtype")
    sizes = [p.numel() for p in parts]
    tensors = {"parts": parts[0]}
    if intra is None:
        call = begin("reduce_scatter_parts", group, label, {"single": codec}, op=op,
                     memories={"single": memory}, tensors=tensors, sizes=sizes)
        whole = Peers(call.rank, call.world, call.group)
        used, peers = ("single",), (whole, whole, whole)
    else:
        call, used, peers = begin_two_level("reduce_scatter_parts", group, label, intra,
                                            inter, topology, op=op, tensors=tensors,
                                            intra_memory=intra_memory,
                                            inter_memory=inter_memory, sizes=sizes)
    flat = torch.cat([p.reshape(-1) for p in parts])
    return end(run(reduce_scatter_levels_steps(flat, sizes, call.codecs, used, *peers,
                                               call.stats, call.label, op, call.rank,
                                               call.memories)), async_op)


def all_reduce_levels_steps(flat: torch.Tensor, codecs: dict[str, Codec],
                            used: tuple[str, ...], peers: Peers, intra: Peers, inter: Peers,
                            stats: Stats, label: str, op: str, *,
                            gather_out: torch.Tensor | None = None,
                            memories: dict[str, ErrorFeedback | None] | None = None) -> Steps:
    """An all-reduce on the levels ``used``: one level over ``peers``, or two; each
    level's codec with its memory (``memories``, by the same names)."""
    memories = memories or {}
    if len(used) == 1:
        return all_reduce_steps(flat, codecs[used[0]], peers, stats,
                                level_label(label, used[0]), op, memories.get(used[0]))
    return two_level_all_reduce_steps(flat, codecs["intra"], codecs["inter"], intra, inter,
                                      stats, label, op, gather_out=gather_out,
                                      intra_memory=memories.get("intra"),
                                      inter_memory=memories.get("inter"))


def two_level_reduce_scatter_steps(flat: torch.Tensor, sizes: int | list[int],
                                   intra: Codec, inter: Codec, intra_peers: Peers,
                                   inter_peers: Peers, stats: Stats, label: str, op: str,
                                   rank: int, intra_memory: ErrorFeedback | None = None,
                                   inter_memory: ErrorFeedback | None = None) -> Steps:
    """One rank's TLq-HS reduce-scatter of ``flat``, the parts for each rank end to end
    (``sizes`` as in :func:`reduce_scatter_steps`: even or uneven) → its values in fp32;
    ``rank`` (in the whole group) seeds its random streams."""
    L, nodes = intra_peers.size, inter_peers.size
    n, itemsize, device = L * nodes, flat.element_size(), flat.device
    local, node = intra_peers.rank, inter_peers.rank
    sizes = [sizes] * n if isinstance(sizes, int) else list(sizes)
    # every part aligned to both codecs: the node sums re-encode part by part
    unit = math.lcm(max(intra.alignment, 1), max(inter.alignment, 1))
    padded = [-(-size // unit) * unit for size in sizes]
    x = chunks.pad_parts(flat, sizes, padded)
    del flat
    # local rank l gets the parts of ranks l, L + l, 2L + l, … (node-major → local-major)
    if len(set(padded)) == 1:
        x = x.view(nodes, L, padded[0]).transpose(0, 1).reshape(-1)
    else:
        by_rank = x.split(padded)
        x = torch.cat([by_rank[nd * L + lr] for lr in range(L) for nd in range(nodes)])
    for_local = [sum(padded[nd * L + lr] for nd in range(nodes)) for lr in range(L)]
    for_node = [padded[nd * L + local] for nd in range(nodes)]  # this rank's node sums
    lab_intra, lab_inter = f"{label}.intra", f"{label}.inter"
    # Step 1-3: encode for and exchange inside the node, reduce the node's contributions
    # and re-encode for the slow link. Eager, not in wait(): the fast intra-node exchange
    # is short, and the slow transfer then runs while an async caller goes on computing.
    # fused only without memory: a residual needs the decoded values of what is sent
    if intra_memory is None and inter_memory is None and intra.requantizes_into(inter):
        with stats.timed(lab_intra, "encode_s", device):
            rows = chunks.encode_rows(intra, x, rng_stream=rank, key=lab_intra,
                                      padded=for_local)
        del x
        received = yield from send_rows(rows, intra, intra_peers, stats, lab_intra,
                                        for_local, itemsize, eager=True)
        with stats.timed(lab_inter, "encode_s", device):
            packet = chunks.packet_of_rows(intra, received, for_local[local], torch.float32)
            rows = chunks.rows_of_parts(
                inter, intra.sum_requantize(packet, inter, rng_stream=rank),
                for_node)
        del received, packet
        # Step 4-5: exchange across nodes, decode, sum (and the inverse rotation, once)
        received = yield from send_rows(rows, inter, inter_peers, stats, lab_inter,
                                        for_node, itemsize)
        with stats.timed(lab_inter, "decode_s", device):
            total = chunks.decode_sum_rows(inter, received, for_node[node], torch.float32)
    else:
        partial = yield from exchange_and_sum(x, for_local, intra, intra_peers, stats,
                                              lab_intra, rng_stream=rank, eager=True,
                                              memory=intra_memory)
        total = yield from exchange_and_sum(partial, for_node, inter, inter_peers, stats,
                                            lab_inter, rng_stream=rank, memory=inter_memory)
    if op == "avg":
        total /= n
    return total[:sizes[rank]]


def hierarchical_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    inter="int4",
    intra="none",
    topology: Topology | None = None,
    group: dist.ProcessGroup | None = None,
    label: str | None = None,
    async_op: bool = False,
    intra_memory: ErrorFeedback | None = None,
    inter_memory: ErrorFeedback | None = None,
) -> torch.Tensor | Handle:
    """Two-level all-gather of every rank's ``input`` into ``output`` (rank order).

    Shards cross nodes encoded with ``inter`` among ranks of the same local index,
    then the node shares what it decoded with ``intra`` (default exact: the values
    were quantized once already, and a second quantization would add its error for
    little gain on fast links). Every rank decodes the same bytes, so ``output`` is
    bitwise identical everywhere. One node uses ``intra`` alone, one rank per node
    ``inter`` alone. Stats go to ``label + ".inter"`` and ``label + ".intra"``;
    ``intra_memory``/``inter_memory``: error feedback around each level's encode.

    Example::

        commpress.hierarchical_all_gather(full, shard, inter="int4", label="dp.param")
    """
    call, used, peers = begin_two_level(
        "hierarchical_all_gather", group, label, intra, inter, topology,
        intra_memory=intra_memory, inter_memory=inter_memory,
        tensors={"input": input, "output": output},
        check=lambda n: check_sizes("hierarchical_all_gather", output, input, n, "output",
                                    "input"))
    if len(used) == 1:
        return end(run_all_gather(output, input, call.codecs[used[0]], call.memories[used[0]],
                                  call.group, call.stats, level_label(call.label, used[0])),
                   async_op)
    return end(run_into(output, lambda out: two_level_all_gather_steps(
        input.reshape(-1), call.codecs["intra"], call.codecs["inter"], *peers[1:], call.stats,
        call.label, call.memories["intra"], call.memories["inter"])), async_op)


def two_level_all_gather_steps(flat: torch.Tensor, intra: Codec, inter: Codec,
                               intra_peers: Peers, inter_peers: Peers, stats: Stats,
                               label: str, intra_memory: ErrorFeedback | None = None,
                               inter_memory: ErrorFeedback | None = None) -> Steps:
    """One rank's two-level all-gather of ``flat`` → every rank's values, node-major, in
    ``flat``'s dtype."""
    L, nodes, m, dtype = intra_peers.size, inter_peers.size, flat.numel(), flat.dtype
    # Step 1: shards cross nodes once, among ranks of this local index
    across = yield from all_gather_steps(flat, inter, inter_peers, stats, f"{label}.inter",
                                         memory=inter_memory,
                                         then=lambda v: v.to(dtype).reshape(-1))
    del flat
    # Step 2: the node shares what it decoded; local rank l's row holds the nodes'
    # shards l, and rank order is node-major
    return (yield from all_gather_steps(
        across, intra, intra_peers, stats, f"{label}.intra", memory=intra_memory,
        then=lambda v: v.to(dtype).view(L, nodes, m).transpose(0, 1).reshape(-1)))


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    *,
    intra="none",
    inter="int4",
    topology: Topology | None = None,
    group: dist.ProcessGroup | None = None,
    op: str = "avg",
    label: str | None = None,
    async_op: bool = False,
    also_agree: dict[str, object] | None = None,
    intra_memory: ErrorFeedback | None = None,
    inter_memory: ErrorFeedback | None = None,
) -> torch.Tensor | Handle:
    """Two-level all-reduce of ``tensor`` in place; bitwise identical on every rank.

    1. reduce-scatter inside the node with ``intra``: local rank ``l`` holds chunk ``l``
       of the node's sum; 2. :func:`commpress.all_reduce` of that chunk across nodes
       among ranks of the same local index, with ``inter`` (two nodes: one exchange,
       each element quantized once); 3. exact all-gather inside the node.

    Bytes across nodes, per node: ``2 · (nodes − 1) / nodes · wire_inter(numel)`` —
    the node sends its sum once, not each rank its own gradient. With ``async_op``
    the call returns once the transfer across nodes has started. One node uses
    ``intra`` alone, one rank per node ``inter`` alone. Stats go to ``label + ".intra"``,
    ``label + ".inter"`` and ``label + ".gather.intra"``. ``also_agree``: as
    :func:`commpress.all_reduce`'s; ``intra_memory``/``inter_memory``: error feedback
    around each level's encodes.

    Example::

        commpress.hierarchical_all_reduce(grad, intra="none", inter="int4", label="dp.grad")
    """
    call, used, peers = begin_two_level("hierarchical_all_reduce", group, label, intra, inter,
                                        topology, op=op, tensors={"tensor": tensor},
                                        intra_memory=intra_memory, inter_memory=inter_memory,
                                        **(also_agree or {}))
    in_place = tensor.numel() % peers[1].size == 0  # the last gather writes into it: no copies
    return end(run_into(tensor, lambda flat: all_reduce_levels_steps(
        flat, call.codecs, used, *peers, call.stats, call.label, op,
        gather_out=flat if in_place else None, memories=call.memories)), async_op)


def two_level_all_reduce_steps(flat: torch.Tensor, intra: Codec, inter: Codec,
                               intra_peers: Peers, inter_peers: Peers, stats: Stats,
                               label: str, op: str, *,
                               gather_out: torch.Tensor | None = None,
                               intra_memory: ErrorFeedback | None = None,
                               inter_memory: ErrorFeedback | None = None) -> Steps:
    """One rank's two-level all-reduce of ``flat`` → the reduced values in its dtype
    (bitwise the same on every rank); ``gather_out``, a ``L · ceil(numel / L)`` buffer
    the last exact gather may write into."""
    L, n = intra_peers.size, intra_peers.size * inter_peers.size
    numel, dtype, itemsize = flat.numel(), flat.dtype, flat.element_size()
    m = -(-numel // L)
    padded = flat
    if L * m != numel:
        padded = torch.zeros(L * m, dtype=dtype, device=flat.device)
        padded[:numel] = flat
    del flat
    # Step 1: reduce inside the node; local rank l holds chunk l of the node's sum
    if is_exact(intra, intra_memory):
        # an all-to-all and a sum in local-rank order: deterministic, and on Gloo
        # about twice as fast as its reduce-scatter
        count_sent(stats, f"{label}.intra", (L - 1) * m, (L - 1) * m * itemsize, itemsize)
        request = AllToAll(intra_peers, stats, f"{label}.intra", True, padded.view(L, m))
        del padded
        chunk = torch.sum((yield request), dim=0)
    else:
        chunk = (yield from reduce_scatter_steps(padded, m, intra, intra_peers, stats,
                                                 f"{label}.intra", "sum", eager=True,
                                                 memory=intra_memory))
        del padded
        chunk = chunk.to(dtype)
    # Step 2: across nodes; the slow transfer starts now, an async caller computes on
    chunk = (yield from all_reduce_steps(chunk, inter, inter_peers, stats, f"{label}.inter",
                                         "sum", inter_memory)).to(dtype)
    if op == "avg":
        chunk = chunk / n  # not in place: the played transport shares gathered results
    # Step 3: share the result inside the node, exactly
    return (yield from all_gather_steps(chunk, EXACT, intra_peers, stats,
                                        f"{label}.gather.intra", out=gather_out,
                                        then=lambda v: v.reshape(-1)[:numel]))
