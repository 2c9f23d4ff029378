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
3. ``dequant_reduce_requant``: decode the node's chunks, sum in fp32, re-encode with
   the ``inter`` codec (4-bit) — still in the rotated domain, no second rotation;
4. all-to-all across nodes among ranks with the same local index;
5. decode, sum, inverse Hadamard → this rank's shard (of the global reduce-scatter).

Steps 1, 3 and 5 fuse into single kernels when both codecs are group quantizers with
the same Hadamard size; otherwise each level uses its codec's own encode/decode (any
codec works, at the cost of an extra rotation). One node, or one rank per node,
falls back to a single level.

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

from commpress import kernels
from commpress.codecs.quantize import _GroupQuantizer
from commpress.collectives import chunks
from commpress.collectives.agreement import check_agreement
from commpress.collectives.all_gather import all_gather
from commpress.collectives.all_reduce import all_reduce
from commpress.collectives.comm import Exchange, check_op, check_sizes, describe, resolve_group
from commpress.collectives.handle import Handle
from commpress.collectives.reduce_scatter import (
    check_float,
    finish_reduce_scatter,
    is_exact,
    reduce_scatter,
    resolve_codec,
    start_reduce_scatter,
)
from commpress.collectives.stats import record, timed
from commpress.collectives.topology import Topology


def _single_level(levels, intra, inter) -> tuple | None:
    """``(codec, level name)`` when there is one level only — one node, or one rank per
    node — else None."""
    if levels.nodes == 1:
        return intra, "intra"
    if levels.ranks_per_node == 1:
        return inter, "inter"
    return None


def _fusable(intra, inter) -> bool:
    return (isinstance(intra, _GroupQuantizer) and isinstance(inter, _GroupQuantizer)
            and intra.hadamard == inter.hadamard and intra.bit_packed and inter.bit_packed)


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
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

        commpress.hierarchical_reduce_scatter(shard, grads, "int8:hadamard=128",
                                              "int4:hadamard=128", label="dp.grad")
    """
    group = resolve_group(group)
    intra, inter = resolve_codec(intra), resolve_codec(inter)
    check_op(op)
    check_float("input", input)
    label = label or "hierarchical_reduce_scatter"
    levels = (topology or Topology()).resolve(group)
    n = dist.get_world_size(group)
    check_sizes("hierarchical_reduce_scatter", input, output, n, "input", "output")
    if single := _single_level(levels, intra, inter):
        return reduce_scatter(output, input, single[0], group=group, op=op,
                              label=f"{label}.{single[1]}", async_op=async_op)
    check_agreement(group, "hierarchical_reduce_scatter", input.device, label=label,
                    intra=intra.spec(), inter=inter.spec(), op=op,
                    ranks_per_node=levels.ranks_per_node, **describe(input))

    L, nodes, m = levels.ranks_per_node, levels.nodes, output.numel()
    unit = math.lcm(max(intra.alignment, 1), max(inter.alignment, 1))
    m_pad = -(-m // unit) * unit
    # (nodes, L, m) chunks → (L, nodes, m): local rank l gets chunks l, L + l, 2L + l, …
    x = chunks.pad_chunks(input.reshape(-1), n, m, m_pad)
    x = x.view(nodes, L, m_pad).transpose(0, 1).reshape(L, nodes * m_pad)
    lab_intra, lab_inter = f"{label}.intra", f"{label}.inter"
    fused = _fusable(intra, inter)
    rank = dist.get_rank(group)

    # Step 1-2: encode for and exchange inside the node
    ex, _ = start_reduce_scatter(x, intra, levels.intra, lab_intra, stream=rank)
    # Step 3: reduce the node's contributions and re-encode for the slow link. Done
    # now, not in wait(): the fast intra-node exchange is short, and the slow transfer
    # then runs while an async caller (a bucket during backward) goes on computing.
    if fused:
        with timed(lab_intra, "comm_s", input.device):
            received = ex.wait()
        with timed(lab_inter, "encode_s", input.device):
            rows = _dequant_reduce_requant(received, intra, inter, nodes, m_pad, rank)
        inter_ex = _send_rows(rows, inter, levels.inter, lab_inter, m_pad, input)
    else:
        partial = finish_reduce_scatter(ex, intra, lab_intra, input.dtype, nodes * m_pad,
                                        input.device)
        inter_ex, _ = start_reduce_scatter(partial.view(nodes, m_pad), inter, levels.inter,
                                           lab_inter, stream=rank)

    def finish() -> torch.Tensor:
        # Step 4-5: exchange across nodes, decode, sum (and inverse rotation)
        if fused:
            with timed(lab_inter, "comm_s", input.device):
                received = inter_ex.wait()
            with timed(lab_inter, "decode_s", input.device):
                total = _decode_sum_rotated(received, inter, m_pad)
        else:
            total = finish_reduce_scatter(inter_ex, inter, lab_inter, torch.float32, m_pad,
                                          input.device)
        if op == "avg":
            total /= n
        output.view(-1).copy_(total[:m])
        return output

    handle = Handle(finish)
    return handle if async_op else handle.wait()


def _split(rows: torch.Tensor, codec, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, row_bytes)`` rows of a group quantizer → (codes ``(k, ·)``, scales ``(k, ·)``)."""
    code_bytes = numel * codec.bits // 8
    codes = rows[:, :code_bytes].contiguous()
    scales = rows[:, code_bytes:].contiguous().view(codec.torch_scale_dtype)
    return codes, scales.view(rows.shape[0], -1)


def _dequant_reduce_requant(received, intra, inter, nodes: int, m_pad: int,
                            stream: int) -> torch.Tensor:
    codes, scales = _split(received, intra, nodes * m_pad)
    out_codes, out_scales = kernels.dequant_reduce_requant(
        codes, scales, bits_in=intra.bits, group_in=intra.group, bits_out=inter.bits,
        group_out=inter.group, scale_dtype=inter.torch_scale_dtype,
        keys=inter.next_keys(stream))
    return torch.cat([out_codes.view(nodes, -1), out_scales.view(torch.uint8).view(nodes, -1)],
                     dim=1)


def _send_rows(rows: torch.Tensor, codec, group, label: str, m_pad: int,
               like: torch.Tensor) -> Exchange:
    k = rows.shape[0]
    record(label, calls=1, elements=(k - 1) * m_pad, wire_bytes=(k - 1) * rows.shape[1],
           raw_bytes=(k - 1) * m_pad * like.element_size())
    with timed(label, "comm_s", like.device):
        return Exchange(rows, group)


def _decode_sum_rotated(received: torch.Tensor, codec, m_pad: int) -> torch.Tensor:
    codes, scales = _split(received, codec, m_pad)
    total = torch.zeros(m_pad, dtype=torch.float32, device=received.device)
    for i in range(codes.shape[0]):
        total += kernels.dequantize(codes[i], scales[i], m_pad, bits=codec.bits,
                                    group=codec.group)
    if codec.hadamard:
        total = kernels.reference.hadamard_transform(total, codec.hadamard) / codec.hadamard
    return total


def hierarchical_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
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

        commpress.hierarchical_all_gather(full, shard, "int4", label="dp.grad.gather")
    """
    group = resolve_group(group)
    inter, intra = resolve_codec(inter), resolve_codec(intra)
    check_float("input", input)
    label = label or "hierarchical_all_gather"
    levels = (topology or Topology()).resolve(group)
    n = dist.get_world_size(group)
    check_sizes("hierarchical_all_gather", output, input, n, "output", "input")
    if single := _single_level(levels, intra, inter):
        return all_gather(output, input, single[0], group=group, label=f"{label}.{single[1]}",
                          async_op=async_op)
    check_agreement(group, "hierarchical_all_gather", input.device, label=label,
                    intra=intra.spec(), inter=inter.spec(),
                    ranks_per_node=levels.ranks_per_node, **describe(input))
    L, nodes, m = levels.ranks_per_node, levels.nodes, input.numel()
    across = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
    first = all_gather(across, input, inter, group=levels.inter, label=f"{label}.inter",
                       async_op=True)

    def finish() -> torch.Tensor:
        first.wait()
        local = torch.empty(L * nodes * m, dtype=input.dtype, device=input.device)
        all_gather(local, across, intra, group=levels.intra, label=f"{label}.intra")
        # local is (L, nodes, m): local rank l's row holds nodes' shards l; rank order
        # is node-major
        output.view(nodes, L, m).copy_(local.view(L, nodes, m).transpose(0, 1))
        return output

    handle = Handle(finish)
    return handle if async_op else handle.wait()


def hierarchical_all_reduce(
    tensor: torch.Tensor,
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

        commpress.hierarchical_all_reduce(grad, "none", "int4", label="dp.grad")
    """
    group = resolve_group(group)
    intra, inter = resolve_codec(intra), resolve_codec(inter)
    check_op(op)
    check_float("tensor", tensor)
    label = label or "hierarchical_all_reduce"
    levels = (topology or Topology()).resolve(group)
    if single := _single_level(levels, intra, inter):
        return all_reduce(tensor, single[0], group=group, op=op, label=f"{label}.{single[1]}",
                          async_op=async_op)
    check_agreement(group, "hierarchical_all_reduce", tensor.device, label=label,
                    intra=intra.spec(), inter=inter.spec(), op=op,
                    ranks_per_node=levels.ranks_per_node, **describe(tensor))
    n, L, numel = dist.get_world_size(group), levels.ranks_per_node, tensor.numel()
    m = -(-numel // L)
    if L * m == numel and tensor.is_contiguous():
        padded = tensor.view(-1)  # gathered into in place below: no copies
    else:
        padded = torch.zeros(L * m, dtype=tensor.dtype, device=tensor.device)
        padded[:numel] = tensor.reshape(-1)
    chunk = torch.empty(m, dtype=tensor.dtype, device=tensor.device)
    if is_exact(intra):
        # an all-to-all and a sum in local-rank order: deterministic, and on Gloo
        # about twice as fast as its reduce-scatter
        recv = torch.empty_like(padded)
        dist.all_to_all_single(recv, padded, group=levels.intra)
        torch.sum(recv.view(L, m), dim=0, out=chunk)
        size = (L - 1) * m * tensor.element_size()
        record(f"{label}.intra", calls=1, elements=(L - 1) * m, wire_bytes=size, raw_bytes=size)
    else:
        reduce_scatter(chunk, padded, intra, group=levels.intra, op="sum", label=f"{label}.intra")
    # the slow transfer starts now; an async caller prepares other work meanwhile
    across = all_reduce(chunk, inter, group=levels.inter, op="sum", label=f"{label}.inter",
                        async_op=True)

    def finish() -> torch.Tensor:
        across.wait()
        if op == "avg":
            chunk.div_(n)
        all_gather(padded, chunk, "none", group=levels.intra, label=f"{label}.gather.intra")
        if padded.data_ptr() != tensor.data_ptr():
            tensor.view(-1).copy_(padded[:numel])
        return tensor

    handle = Handle(finish)
    return handle if async_op else handle.wait()
