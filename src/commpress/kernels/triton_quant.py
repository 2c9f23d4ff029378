"""The Triton kernels of group quantization, one module per job, as one namespace (the
twin of :mod:`commpress.kernels.reference` the dispatcher in
:mod:`commpress.kernels` picks):

- :mod:`~commpress.kernels.triton_int`: int8/int4/int2 codes (fused Hadamard + quantize
  + pack, and its inverse);
- :mod:`~commpress.kernels.triton_two_level`: dequantize-reduce-requantize and
  dequantize-sum over ``k`` encoded chunks;
- :mod:`~commpress.kernels.triton_fp8`: float8 e4m3 values;
- :mod:`~commpress.kernels.triton_trits`: int2's ternary codes, five per byte;
- :mod:`~commpress.kernels.triton_tiles` and :mod:`~commpress.kernels.triton_launch`:
  the shared building blocks and launch helpers;
- :mod:`~commpress.kernels.config`: tiles, warps, the kernel family and the product
  precision, resolved once per configuration (override with
  :func:`~commpress.kernels.config.override_kernels`).
"""

from __future__ import annotations

from commpress.kernels.config import resolve, supports
from commpress.kernels.reference import qmax_for_bits
from commpress.kernels.triton_fp8 import fp8_dequantize, fp8_quantize
from commpress.kernels.triton_int import dequantize, quantize
from commpress.kernels.triton_trits import trits_dequantize, trits_quantize
from commpress.kernels.triton_two_level import dequant_reduce_requant, dequantize_sum

__all__ = ["dequant_reduce_requant", "dequantize", "dequantize_sum", "fp8_dequantize",
           "fp8_quantize", "qmax_for_bits", "quantize", "resolve", "supports",
           "trits_dequantize", "trits_quantize"]
