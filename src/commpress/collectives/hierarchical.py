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

from commpress.collectives import chunks
from commpress.collectives.agreement import Levels
from commpress.collectives.all_gather import run_all_gather
from commpress.collectives.all_reduce import run_all_reduce
from commpress.collectives.byte_stats import Stats
from commpress.collectives.call import AnyCodec, Call, begin, end, is_exact, resolve_codec
from commpress.collectives.comm import (
    Exchange,
    check_sizes,
    resolve_group,
    writable_flat,
    write_back,
)
from commpress.collectives.handle import Handle
from commpress.collectives.reduce_scatter import (
    finish_reduce_scatter,
    run_reduce_scatter,
    start_reduce_scatter,
)
from commpress.collectives.topology import Topology

EXACT = resolve_codec("none")


def begin_two_level(collective: str, group: dist.ProcessGroup | None, label: str | None,
                    intra, inter, topology: Topology | None, *,
                    tensors: dict[str, torch.Tensor], op: str | None = None,
                    check=None) -> tuple[Call, Levels, tuple[AnyCodec, str] | None]:
    """The prologue of a two-level collective: agree on everything, including the node
    size, *before* the sub-groups are made (ranks that disagree on it would otherwise
    wait for each other in ``new_group``). Returns the call, the levels, and
    ``(codec, level name)`` when only one level exists (one node, or one rank per node).
    """
    topology = topology or Topology()
    world = dist.get_world_size(resolve_group(group))
    rpn = topology.ranks_per_node_in(world)
    call = begin(collective, group, label, {"intra": intra, "inter": inter}, op=op,
                 tensors=tensors, check=check, ranks_per_node=rpn)
    levels = call.ctx.levels(call.group, rpn)
    single = None
    if levels.nodes == 1:
        single = call.codecs["intra"], "intra"
    elif levels.ranks_per_node == 1:
        single = call.codecs["inter"], "inter"
    return call, levels, single


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
) -> torch.Tensor | Handle:
    """Two-level reduce-scatter of ``input`` (``world × output.numel()``) into ``output``.

    Rank ``r`` gets the sum or mean over all ranks of chunk ``r``, exactly as
    :func:`commpress.reduce_scatter`. Stats go to ``label + ".intra"`` and
    ``label + ".inter"`` (default label ``"hierarchical_reduce_scatter"``).

    Example::

        commpress.hierarchical_reduce_scatter(shard, grads, intra="int8:hadamard=128",
                                              inter="int4:hadamard=128", label="dp.grad")
    """
    call, levels, single = begin_two_level(
        "hierarchical_reduce_scatter", group, label, intra, inter, topology, op=op,
        tensors={"input": input, "output": output},
        check=lambda n: check_sizes("hierarchical_reduce_scatter", input, output, n, "input",
                                    "output"))
    if single:
        return end(run_reduce_scatter(output, input, single[0], call.group, call.stats,
                                      f"{call.label}.{single[1]}", op), async_op)
    return end(_two_level_reduce_scatter(output, input, call, levels, op), async_op)


def _two_level_reduce_scatter(output: torch.Tensor, input: torch.Tensor, call: Call,
                              levels: Levels, op: str) -> Handle:
    intra, inter = call.codecs["intra"], call.codecs["inter"]
    stats, rank = call.stats, call.rank
    L, nodes, m, n = levels.ranks_per_node, levels.nodes, output.numel(), call.world
    unit = math.lcm(max(intra.alignment, 1), max(inter.alignment, 1))
    m_pad = -(-m // unit) * unit
    # (nodes, L, m) chunks → (L, nodes, m): local rank l gets chunks l, L + l, 2L + l, …
    x = chunks.pad_chunks(input.reshape(-1), n, m, m_pad)
    x = x.view(nodes, L, m_pad).transpose(0, 1).reshape(L, nodes * m_pad)
    lab_intra, lab_inter = f"{call.label}.intra", f"{call.label}.inter"
    device = input.device

    # Step 1-2: encode for and exchange inside the node
    ex = start_reduce_scatter(x, intra, levels.intra, stats, lab_intra, rng_stream=rank)
    # Step 3: reduce the node's contributions and re-encode for the slow link. Done
    # now, not in wait(): the fast intra-node exchange is short, and the slow transfer
    # then runs while an async caller (a bucket during backward) goes on computing.
    if intra.requantizes_into(inter):
        with stats.timed(lab_intra, "comm_s", device):
            received = ex.wait()
        with stats.timed(lab_inter, "encode_s", device):
            packet = chunks.packet_of_rows(intra, received, nodes * m_pad, torch.float32)
            rows = chunks.rows_of_packet(
                intra.sum_requantize(packet, inter, rng_stream=rank), nodes)
        inter_ex = _send_rows(rows, levels.inter, stats, lab_inter, m_pad, input)
    else:
        partial = finish_reduce_scatter(ex, intra, stats, lab_intra, input.dtype,
                                        nodes * m_pad, device)
        inter_ex = start_reduce_scatter(partial.view(nodes, m_pad), inter, levels.inter, stats,
                                        lab_inter, rng_stream=rank)
    out, copied = writable_flat(output)

    def finish() -> torch.Tensor:
        # Step 4-5: exchange across nodes, decode, sum (and the inverse rotation, once)
        total = finish_reduce_scatter(inter_ex, inter, stats, lab_inter, torch.float32, m_pad,
                                      device)
        if op == "avg":
            total /= n
        out.copy_(total[:m])
        return write_back(output, out, copied)

    return Handle(finish)


def _send_rows(rows: torch.Tensor, group: dist.ProcessGroup, stats: Stats, label: str,
               m_pad: int, like: torch.Tensor) -> Exchange:
    k = rows.shape[0]
    stats.record(label, calls=1, elements=(k - 1) * m_pad, wire_bytes=(k - 1) * rows.shape[1],
                 raw_bytes=(k - 1) * m_pad * like.element_size())
    with stats.timed(label, "comm_s", like.device):
        return Exchange(rows, group)


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
) -> torch.Tensor | Handle:
    """Two-level all-gather of every rank's ``input`` into ``output`` (rank order).

    Shards cross nodes encoded with ``inter`` among ranks of the same local index,
    then the node shares what it decoded with ``intra`` (default exact: the values
    were quantized once already, and a second quantization would add its error for
    little gain on fast links). Every rank decodes the same bytes, so ``output`` is
    bitwise identical everywhere. One node uses ``intra`` alone, one rank per node
    ``inter`` alone. Stats go to ``label + ".inter"`` and ``label + ".intra"``.

    Example::

        commpress.hierarchical_all_gather(full, shard, inter="int4", label="dp.param")
    """
    call, levels, single = begin_two_level(
        "hierarchical_all_gather", group, label, intra, inter, topology,
        tensors={"input": input, "output": output},
        check=lambda n: check_sizes("hierarchical_all_gather", output, input, n, "output",
                                    "input"))
    if single:
        return end(run_all_gather(output, input, single[0], call.group, call.stats,
                                  f"{call.label}.{single[1]}"), async_op)
    L, nodes, m = levels.ranks_per_node, levels.nodes, input.numel()
    # Step 1: shards cross nodes once, among ranks of this local index
    across = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
    first = run_all_gather(across, input, call.codecs["inter"], levels.inter, call.stats,
                           f"{call.label}.inter")
    out, copied = writable_flat(output)

    def finish() -> torch.Tensor:
        first.wait()
        # Step 2: the node shares what it decoded; local rank l's row holds the nodes'
        # shards l, and rank order is node-major
        local = torch.empty(L * nodes * m, dtype=input.dtype, device=input.device)
        run_all_gather(local, across, call.codecs["intra"], levels.intra, call.stats,
                       f"{call.label}.intra").wait()
        out.view(nodes, L, m).copy_(local.view(L, nodes, m).transpose(0, 1))
        return write_back(output, out, copied)

    return end(Handle(finish), async_op)


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
    ``label + ".inter"`` and ``label + ".gather.intra"``.

    Example::

        commpress.hierarchical_all_reduce(grad, intra="none", inter="int4", label="dp.grad")
    """
    call, levels, single = begin_two_level("hierarchical_all_reduce", group, label, intra,
                                           inter, topology, op=op, tensors={"tensor": tensor})
    if single:
        return end(run_all_reduce(tensor, single[0], call.group, call.stats,
                                  f"{call.label}.{single[1]}", op), async_op)
    return end(_two_level_all_reduce(tensor, call, levels, op), async_op)


def _two_level_all_reduce(tensor: torch.Tensor, call: Call, levels: Levels, op: str) -> Handle:
    stats, label = call.stats, call.label
    n, L, numel = call.world, levels.ranks_per_node, tensor.numel()
    m = -(-numel // L)
    flat, copied = writable_flat(tensor)
    if L * m == numel:
        padded = flat  # gathered into in place below: no copies
    else:
        padded = torch.zeros(L * m, dtype=tensor.dtype, device=tensor.device)
        padded[:numel] = flat
    chunk = torch.empty(m, dtype=tensor.dtype, device=tensor.device)
    # Step 1: reduce inside the node; local rank l holds chunk l of the node's sum
    if is_exact(call.codecs["intra"]):
        # an all-to-all and a sum in local-rank order: deterministic, and on Gloo
        # about twice as fast as its reduce-scatter
        recv = torch.empty_like(padded)
        dist.all_to_all_single(recv, padded, group=levels.intra)
        torch.sum(recv.view(L, m), dim=0, out=chunk)
        size = (L - 1) * m * tensor.element_size()
        stats.record(f"{label}.intra", calls=1, elements=(L - 1) * m, wire_bytes=size,
                     raw_bytes=size)
    else:
        run_reduce_scatter(chunk, padded, call.codecs["intra"], levels.intra, stats,
                           f"{label}.intra", "sum").wait()
    # Step 2: the slow transfer starts now; an async caller prepares other work meanwhile
    across = run_all_reduce(chunk, call.codecs["inter"], levels.inter, stats, f"{label}.inter",
                            "sum")

    def finish() -> torch.Tensor:
        across.wait()
        if op == "avg":
            chunk.div_(n)
        # Step 3: share the result inside the node, exactly
        run_all_gather(padded, chunk, EXACT, levels.intra, stats,
                       f"{label}.gather.intra").wait()
        if padded.data_ptr() != flat.data_ptr():
            flat.copy_(padded[:numel])
        return write_back(tensor, flat, copied)

    return Handle(finish)
