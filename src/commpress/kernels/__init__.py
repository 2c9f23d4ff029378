"""Kernels: group quantization (int8/int4/int2 codes, or float8 e4m3 values) with
optional Hadamard smoothing, and top-k selection, on any device.

Each entry point runs the implementation its :class:`~commpress.kernels.config.KernelConfig`
names, resolved once per (kernel, bits, group, Hadamard block, device type): the Triton
kernels on CUDA (when Triton is installed and supports the configuration), the torch
reference elsewhere. The environment variable ``COMMPRESS_KERNELS`` and the override
for tests and scripts (:func:`override_kernels`) are documented in
:mod:`commpress.kernels.config`.
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType

import torch

from commpress.kernels import reference
from commpress.kernels.config import (
    KERNEL_CHOICES,
    KERNELS_ENV,
    KernelConfig,
    override_kernels,
    resolve,
    supports,
)
from commpress.kernels.reference import (
    padded_numel,
    padded_unit,
    qmax_for_bits,
    stream_keys,
)


@functools.cache
def _triton_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"commpress.kernels.{name}")
    except ImportError as e:
        raise ImportError(f"the Triton kernels did not import ({e}): pip install triton, or "
                          f"{KERNELS_ENV}=reference") from e


def _impl(cfg: KernelConfig, module: str = "triton_quant") -> ModuleType:
    return reference if cfg.backend == "reference" else _triton_module(module)


def backend_for(device: torch.device, bits: int, group: int, hadamard: int,
                trits: bool = False) -> ModuleType:
    """The module (reference or Triton) that encodes this configuration on ``device``
    (``trits``: int2 codes packed five per byte)."""
    kernel = "trits_quantize" if trits else "quantize"
    return _impl(resolve(kernel, bits, group, hadamard, device))


def quantize(x: torch.Tensor, *, bits: int, group: int, hadamard: int = 0,
             scale_dtype: torch.dtype = torch.float32,
             keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` to ``(codes, scales)``; see :func:`reference.quantize`."""
    cfg = resolve("quantize", bits, group, hadamard, x.device)
    impl = _impl(cfg)
    piece = _piece(x.numel(), impl, cfg, (bits, group, hadamard))
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
    cfg = resolve("dequantize", bits, group, hadamard, codes.device)
    impl = _impl(cfg)
    piece = _piece(numel, impl, cfg, (bits, group, hadamard))
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


def _piece(numel: int, impl: ModuleType, cfg: KernelConfig, *configs: tuple[int, int, int],
           rows: int = 1) -> int:
    """The piece length per row of ``rows`` (whole groups and blocks of every
    ``(bits, group, hadamard)`` in ``configs``) the reference runs ``numel`` elements in
    (about ``cfg.reference_piece``: see ``config.REFERENCE_PIECE``); 0: all at once (and
    for any other implementation)."""
    piece = cfg.reference_piece
    if impl is not reference or numel <= 2 * piece:
        return 0
    unit = math.lcm(*(padded_unit(*c) for c in configs))
    return max(unit, piece // rows // unit * unit)


def _columns(codes: torch.Tensor, scales: torch.Tensor, start: int, piece: int, bits: int,
             group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales (last dimension) of elements ``start … start + piece``."""
    return (codes[..., start * bits // 8:(start + piece) * bits // 8],
            scales[..., start // group:(start + piece) // group])


def fp8_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` as float8 e4m3 with per-group scales; see :func:`reference.fp8_quantize`."""
    impl = _impl(resolve("fp8_quantize", 8, group, hadamard, x.device))
    return impl.fp8_quantize(x, group=group, hadamard=hadamard, scale_dtype=scale_dtype)


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                   hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode :func:`fp8_quantize`'s ``(codes, scales)`` to ``numel`` values."""
    impl = _impl(resolve("fp8_dequantize", 8, group, hadamard, codes.device))
    return impl.fp8_dequantize(codes, scales, numel, group=group, hadamard=hadamard,
                               out_dtype=out_dtype, out=out)


def trits_quantize(x: torch.Tensor, *, group: int, hadamard: int = 0,
                   scale_dtype: torch.dtype = torch.float32,
                   keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int2's ternary codes, five per byte; see :func:`reference.trits_quantize`."""
    impl = _impl(resolve("trits_quantize", 2, group, hadamard, x.device))
    return impl.trits_quantize(x, group=group, hadamard=hadamard, scale_dtype=scale_dtype,
                               keys=keys)


def trits_dequantize(packed: torch.Tensor, scales: torch.Tensor, numel: int, *, group: int,
                     hadamard: int = 0, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode :func:`trits_quantize`'s bytes to ``numel`` values."""
    impl = _impl(resolve("trits_dequantize", 2, group, hadamard, packed.device))
    return impl.trits_dequantize(packed, scales, numel, group=group, hadamard=hadamard,
                                 out_dtype=out_dtype, out=out)


def dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group: int,
                   hadamard: int = 0) -> torch.Tensor:
    """Decode ``k`` chunks (rows) and sum them in fp32; see :func:`reference.dequantize_sum`."""
    cfg = resolve("dequantize_sum", bits, group, hadamard, codes.device)
    impl = _impl(cfg)
    k, chunk = codes.shape[0], codes.shape[1] * 8 // bits
    piece = _piece(k * chunk, impl, cfg, (bits, group, hadamard), rows=k)
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
    cfg = resolve("dequant_reduce_requant", bits_in, group_in, 0, codes.device)
    impl = _impl(cfg) if supports(bits_out, group_out, 0) else reference
    k, chunk = codes.shape[0], codes.shape[1] * 8 // bits_in
    piece = _piece(k * chunk, impl, cfg, (bits_in, group_in, 0), (bits_out, group_out, 0), rows=k)
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
    impl = _impl(resolve("topk", device=flat.device), "triton_topk")
    if impl is not reference and not impl.supports(flat.dtype, flat.numel()):
        impl = reference
    return impl.topk_select(flat, k)


def chunk_topk_encode(flat: torch.Tensor, *, chunk: int, k: int, bits: int,
                      sigmas: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseLoCo's chunked top-k code of flat ``x`` as packed ``(codes, indices,
    table)``: the selection of :func:`reference.chunk_topk_select` (the Triton one where
    it runs), packed by :func:`reference.pack_chunk_codes`."""
    impl = _impl(resolve("topk", device=flat.device), "triton_chunk_topk")
    if impl is not reference and not impl.supports(chunk, bits, flat.dtype):
        impl = reference
    code, index, table = impl.chunk_topk_select(flat, chunk=chunk, k=k, bits=bits,
                                                sigmas=sigmas)
    return reference.pack_chunk_codes(code, index, table, chunk=chunk, bits=bits)


__all__ = [
    "KERNEL_CHOICES",
    "KernelConfig",
    "backend_for",
    "chunk_topk_encode",
    "dequant_reduce_requant",
    "dequantize",
    "dequantize_sum",
    "fp8_dequantize",
    "fp8_quantize",
    "override_kernels",
    "padded_numel",
    "padded_unit",
    "qmax_for_bits",
    "quantize",
    "reference",
    "resolve",
    "stream_keys",
    "topk_select",
    "trits_dequantize",
    "trits_quantize",
]
