"""On a CUDA machine: the stream rules with CUDA tensors — over Gloo with ranks sharing a
GPU, and NCCL with one rank. Skipped where no GPU is visible (CI has none; on a CUDA
machine: ``PYTHONPATH=src python -m pytest tests/gpu``)."""

import pytest
import torch

from commpress.launch import spawn
from tests.collectives import workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_async_inputs_reusable_with_cuda_tensors_over_gloo():
    for r in spawn(workers.async_inputs_reusable, 4, ("cuda",), device="cuda"):
        assert all(r.values()), [k for k, ok in r.items() if not ok]


def test_async_inputs_reusable_over_nccl_with_one_rank():
    for r in spawn(workers.async_inputs_reusable, 1, ("cuda",), backend="nccl",
                   device="cuda"):
        assert all(r.values()), [k for k, ok in r.items() if not ok]


def test_codecs_never_sync_with_the_host():
    import commpress

    # the Triton kernels run here (fp8 and trits included), encode and decode into out=

    x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for spec in ("int8", "int4:hadamard=128", "int2", "int2:packing=trits", "fp8",
                     "fp8:hadamard=128", "int8:rounding=stochastic", "bf16"):
            c = commpress.codec(spec)
            out = torch.empty_like(x)
            c.decode(c.encode(x), out=out)
            c.decode(c.encode(x))
    finally:
        torch.cuda.set_sync_debug_mode("default")
