"""Weight differences to a reference both sides hold: the arithmetic of qWD.

SDP4Bit's qWD (Jia et al., NeurIPS 2024) all-gathers 4-bit codes of
``Δ = lowp(new master) − W`` instead of the weights ``W`` themselves: weight updates
are small and smooth, so 4 bits lose little, and since every rank — the owner too —
applies ``W += Δ̂`` the quantization error is corrected at the next step (the master
weights never see it). Quantizing W directly (qW) hurt the loss badly in the paper.

The caller owns the reference: :func:`apply_difference` returns ``reference + Δ̂`` in the
reference's dtype, computed in fp32, identically on every rank;
:func:`commpress.delta_all_gather` moves the codes.
"""

from __future__ import annotations

import torch

from commpress.validate import InputError


def difference(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``Δ = x − reference`` in fp32: what qWD encodes."""
    if x.shape != reference.shape:
        raise InputError(f"difference: x shape {tuple(x.shape)} != reference shape "
                         f"{tuple(reference.shape)}")
    return x.float() - reference.float()


def apply_difference(reference: torch.Tensor, diff: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``reference + Δ̂`` summed in fp32, cast to the reference's dtype — the same bits on
    every rank that holds the same reference and codes. ``out`` may alias it."""
    result = (reference.float() + diff.view(reference.shape)).to(reference.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
