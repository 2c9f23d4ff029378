"""Kernels: group quantization (int8/int4/int2 codes, or float8 e4m3 values) with
optional Hadamard smoothing, and top-k selection, on any device.

Each entry point picks its implementation once per call site from the tensor's
device: the Triton kernels on CUDA (when Triton is installed and the configuration
is one they support), the torch reference elsewhere. ``COMMPRESS_KERNELS=reference``
forces the reference everywhere (for debugging or comparison);
``COMMPRESS_KERNELS=triton`` runs Triton on every device for every configuration it
supports (on CPU that needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from types import ModuleType

import torch

from commpress.kernels import reference
from commpress.kernels.reference import (
    padded_numel,
    padded_unit,
    qmax_for_bits,
    stream_keys,
)

KERNEL_CHOICES = ("auto", "reference", "triton")


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"commpress.kernels.{name}")
    except ImportError:
        return None


def _pick(device: torch.device, module: str, supported) -> ModuleType:
    """The reference, or the Triton ``module`` when the environment and device ask for it
    and ``supported(module)`` says it handles the call."""
    choice = os.environ.get("COMMPRESS_KERNELS", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"COMMPRESS_KERNELS={choice!r} is not valid; allowed: {', '.join(KERNEL_CHOICES)}"
        )
    if choice == "reference":
        return reference
    tq = _triton_module(module)
    if choice == "triton" and tq is None:
        raise ImportError("COMMPRESS_KERNELS=triton needs Triton: pip install triton")
    if tq is not None and supported(tq) and (choice == "triton" or device.type == "cuda"):
        return tq
    return reference


def backend_for(device: torch.device, bits: int, group: int, hadamard: int,
                trits: bool = False) -> ModuleType:
    """The module (reference or Triton) that runs this configuration on ``device``
    (``trits``: int2 codes packed five per byte)."""
    return _pick(device, "triton_quant", lambda tq: tq.supports(bits, group, hadamard, trits))


def quantize(x: torch.Tensor, *, bits: int, group: int, hadamard: int = 0,
             scale_dtype: torch.dtype = torch.float32,
             keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` to ``(codes, scales)``; see :func:`reference.quantize`."""
    impl = backend_for(x.device, bits, group, hadamard)
    piece = _piece(x.numel(), impl, (bits, group, hadamard))
    if piece:
        flat = x.reshape(-1)
        parts = [reference.quantize(flat[i:i + piece], bits=bits, group=group,
                                    hadamard=hadamard, scale_dtype=scale_dtype, keys=keys,
                                    start=i) for i in range(0, flat.numel(), piece)]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    return impl.quantize(x, bits=bits, group=group, hadamard=hadamard,
                         scale_dtype=scale_dtype, keys=keys)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, bits: int,
               group: int, hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``(codes, scales)`` to a flat tensor of ``numel`` elements (written into
    ``out``, flat and contiguous in ``out_dtype``, if given: no allocation)."""
    impl = backend_for(codes.device, bits, group, hadamard)
    piece = _piece(numel, impl, (bits, group, hadamard))
    if piece:
        if out is None:
            out = torch.empty(numel, dtype=out_dtype, device=codes.device)
        for i in range(0, numel, piece):
            n = min(piece, numel - i)
            reference.dequantize(*_columns(codes, scales, i, piece, bits, group), n,
                                 bits=bits, group=group, hadamard=hadamard,
                                 out_dtype=out_dtype, out=out[i:i + n])
        return out
    return impl.dequantize(codes, scales, numel, bits=bits, group=group, hadamard=hadamard,
                           out_dtype=out_dtype, out=out)


# The reference runs long tensors in pieces of about this many elements: its several
# passes then stay in the CPU's caches (16 Mi elements at once ran 2-4x slower). The
# pieces are whole groups and blocks and keep their element indices for stochastic
# rounding: without Hadamard the codes are the same bytes; with it, the rotation's
# matrix product may round differently for another number of rows (as it may on another
# BLAS), so a code at a rounding tie may differ. Real and played runs call with the
# same sizes, so they still agree bit for bit.
REFERENCE_PIECE = 1 << 20


def _piece(numel: int, impl: ModuleType, *configs: tuple[int, int, int], rows: int = 1) -> int:
    """The piece length per row of ``rows`` (whole groups and blocks of every
    ``(bits, group, hadamard)`` in ``configs``) the reference runs ``numel`` elements in;
    0: all at once (and for any other implementation)."""
    if impl is not reference or numel <= 2 * REFERENCE_PIECE:
        return 0
    unit = math.lcm(*(padded_unit(*c) for c in configs))
    return max(unit, REFERENCE_PIECE // rows // unit * unit)


def _columns(codes: torch.Tensor, scales: torch.Tensor, start: int, piece: int, bits: int,
             group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales (last dimension) of elements ``start … start + piece``."""
    return (codes[..., start * bits // 8:(start + piece) * bits // 8],
            scales[..., start // group:(start + piece) // group])


def fp8_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` as float8 e4m3 with per-group scales; see :func:`reference.fp8_quantize`."""
    impl = backend_for(x.device, 8, group, hadamard)
    return impl.fp8_quantize(x, group=group, hadamard=hadamard, scale_dtype=scale_dtype)


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                   hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode :func:`fp8_quantize`'s ``(codes, scales)`` to ``numel`` values."""
    impl = backend_for(codes.device, 8, group, hadamard)
    return impl.fp8_dequantize(codes, scales, numel, group=group, hadamard=hadamard,
                               out_dtype=out_dtype, out=out)


def trits_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                   scale_dtype: torch.dtype = torch.float32,
                   keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int2's ternary codes, five per byte; see :func:`reference.trits_quantize`."""
    impl = backend_for(x.device, 2, group, hadamard, trits=True)
    return impl.trits_quantize(x, group=group, hadamard=hadamard, scale_dtype=scale_dtype,
                               keys=keys)


def trits_dequantize(packed: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                     hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode :func:`trits_quantize`'s bytes to ``numel`` values."""
    impl = backend_for(packed.device, 2, group, hadamard, trits=True)
    return impl.trits_dequantize(packed, scales, numel, group=group, hadamard=hadamard,
                                 out_dtype=out_dtype, out=out)


def dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group: int,
                   hadamard: int = 0) -> torch.Tensor:
    """Decode ``k`` chunks (rows) and sum them in fp32; see :func:`reference.dequantize_sum`."""
    impl = backend_for(codes.device, bits, group, hadamard)
    k, chunk = codes.shape[0], codes.shape[1] * 8 // bits
    piece = _piece(k * chunk, impl, (bits, group, hadamard), rows=k)
    if piece:
        out = torch.empty(chunk, dtype=torch.float32, device=codes.device)
        for i in range(0, chunk, piece):
            out[i:i + piece] = reference.dequantize_sum(
                *_columns(codes, scales, i, piece, bits, group), bits=bits, group=group,
                hadamard=hadamard)
        return out
    return impl.dequantize_sum(codes, scales, bits=bits, group=group, hadamard=hadamard)


def dequant_reduce_requant(codes: torch.Tensor, scales: torch.Tensor, *, bits_in: int,
                           group_in: int, bits_out: int, group_out: int,
                           scale_dtype: torch.dtype = torch.float32,
                           keys: tuple[int, int] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``k`` encoded chunks and re-encode; see :func:`reference.dequant_reduce_requant`."""
    impl = backend_for(codes.device, bits_in, group_in, 0)
    if impl is not reference and not impl.supports(bits_out, group_out, 0):
        impl = reference
    k, chunk = codes.shape[0], codes.shape[1] * 8 // bits_in
    piece = _piece(k * chunk, impl, (bits_in, group_in, 0), (bits_out, group_out, 0), rows=k)
    if piece:
        parts = [reference.dequant_reduce_requant(
            *_columns(codes, scales, i, piece, bits_in, group_in), bits_in=bits_in,
            group_in=group_in, bits_out=bits_out, group_out=group_out,
            scale_dtype=scale_dtype, keys=keys, start=i) for i in range(0, chunk, piece)]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    return impl.dequant_reduce_requant(codes, scales, bits_in=bits_in, group_in=group_in,
                                       bits_out=bits_out, group_out=group_out,
                                       scale_dtype=scale_dtype, keys=keys)


def topk_select(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude elements as ``(values, indices, flag)``; see
    :func:`reference.topk_select`."""
    impl = _pick(flat.device, "triton_topk", lambda tt: tt.supports(flat.dtype, flat.numel()))
    return impl.topk_select(flat, k)


__all__ = [
    "backend_for",
    "dequant_reduce_requant",
    "dequantize",
    "dequantize_sum",
    "fp8_dequantize",
    "fp8_quantize",
    "padded_numel",
    "padded_unit",
    "qmax_for_bits",
    "quantize",
    "reference",
    "stream_keys",
    "topk_select",
    "trits_dequantize",
    "trits_quantize",
]
