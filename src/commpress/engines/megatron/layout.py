"""Wire layouts that keep TP-replicated parameters bitwise identical across TP ranks.

Megatron packs tensor-parallel slices (``tensor_model_parallel``) and parameters every
TP rank holds a replica of (norms, row-parallel biases, position embeddings) into the
same buckets. A quantizer's group (its scale, its Hadamard block) that spans both
kinds makes a replicated element's code depend on its sliced neighbours, which differ
from TP rank to TP rank: the replicas would drift apart. commpress's own optimizer
keeps the two kinds in different buckets; Megatron's buckets are fixed, so their
elements are reordered on the wire instead: each row (a data-parallel rank's chunk of
the bucket, whose owner Megatron fixes) becomes ``[identical | pad | others | pad]``,
each part padded to the codec's alignment, and every row to the same width. No group
mixes the kinds, and an identical element sits at the same place on every TP rank.

Which elements are identical depends on what is sent. Weights: every replicated
parameter's. Gradients: the replicated parameters' except those Megatron sums across
TP ranks after the data-parallel reduction (sequence parallelism's norms and biases,
each rank's part computed on its own slice of the sequence) — their parts differ
between TP ranks until that sum.

Without a mix (TP 1, or a bucket of one kind) the layout is the identity and nothing
is copied.
"""

from __future__ import annotations

import torch


def _pad(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Layout:
    """A reordering of ``rows × row_numel`` elements into ``rows × width`` wire rows.

    ``index[r, j]`` is the element of row ``r`` at wire position ``j``, or ``row_numel``
    for padding (a zero).
    """

    def __init__(self, replicated: torch.Tensor, rows: int, unit: int) -> None:
        numel = replicated.numel()
        assert numel % rows == 0, "a bucket splits into equal rows"
        self.rows, self.row_numel = rows, numel // rows
        mask = replicated.view(rows, self.row_numel)
        parts = [(torch.nonzero(m).view(-1), torch.nonzero(~m).view(-1)) for m in mask]
        self.width = _pad(max(_pad(len(a), unit) + _pad(len(b), unit) for a, b in parts), unit)
        index = torch.full((rows, self.width), self.row_numel, dtype=torch.int64)
        for r, (a, b) in enumerate(parts):
            start = _pad(len(a), unit)
            index[r, : len(a)] = a
            index[r, start : start + len(b)] = b
        self.index = index.to(replicated.device)

    def to_wire(self, x: torch.Tensor) -> torch.Tensor:
        """``(rows, row_numel)`` values → ``(rows, width)`` in wire order (pads are 0)."""
        padded = torch.cat([x.view(self.rows, self.row_numel),
                            x.new_zeros(self.rows, 1)], dim=1)
        return padded.gather(1, self.index)

    def row_to_wire(self, x: torch.Tensor, r: int) -> torch.Tensor:
        """Row ``r`` (``row_numel`` values) → ``width`` values in wire order."""
        padded = torch.cat([x.reshape(-1), x.new_zeros(1)])
        return padded[self.index[r]]

    def from_wire(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``(rows, width)`` wire values back into ``out`` (``rows × row_numel``)."""
        full = out.new_empty(self.rows, self.row_numel + 1)
        full.scatter_(1, self.index, wire.view(self.rows, self.width).to(out.dtype))
        out.view(self.rows, self.row_numel).copy_(full[:, : self.row_numel])

    def row_from_wire(self, wire: torch.Tensor, r: int, out: torch.Tensor) -> None:
        """Write row ``r``'s ``width`` wire values back into ``out`` (``row_numel``)."""
        full = out.new_empty(self.row_numel + 1)
        full.scatter_(0, self.index[r], wire.reshape(-1).to(out.dtype))
        out.view(-1).copy_(full[: self.row_numel])


def identical_mask(bucket, positions: dict, identical: dict) -> torch.Tensor | None:
    """Per element of ``bucket``: True where a parameter whose values are ``identical`` on
    every TP rank lies, or None when the bucket holds one kind only (padding counts as
    not identical: it is zero everywhere).

    ``positions[param]`` is the parameter's ``(start, end)`` in the bucket.
    """
    if len({identical[p] for p in bucket.params_list}) < 2:
        return None
    mask = torch.zeros(bucket.grad_data.numel(), dtype=torch.bool, device=bucket.grad_data.device)
    for p in bucket.params_list:
        if identical[p]:
            start, end = positions[p]
            mask[start:end] = True
    return mask
