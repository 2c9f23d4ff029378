"""Chunked top-k: the Triton select against the reference, in interpreter mode on CPU
(the sm_90 compile is tests/kernels/test_compile_for_gpu.py)."""

import os

import pytest
import torch

from commpress.kernels import reference as ref

triton_chunk_topk = pytest.importorskip("commpress.kernels.triton_chunk_topk",
                                        reason="Triton is not installed (pip install triton)")
needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs TRITON_INTERPRET=1 on a machine without CUDA",
)


def _inputs(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "gauss":
        x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)[torch.randperm(n, generator=g)]
    elif kind == "ties":  # few magnitudes, both signs: ties at the threshold everywhere
        x = torch.randint(-3, 4, (n,), generator=g).float()
    elif kind == "nonfinite":
        x = torch.randn(n, generator=g)
        x[3] = float("nan")
        x[n // 2 + 1] = float("-inf")
    else:  # huge: magnitudes near fp32's maximum (bf16 shares its range)
        x = torch.randn(n, generator=g).sign() * 3.0e38
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize("kind", ["gauss", "ties", "nonfinite", "huge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk, k, bits", [(256, 16, 2), (128, 7, 3)])
def test_the_triton_select_keeps_what_the_reference_keeps(kind, dtype, chunk, k, bits):
    x = _inputs(kind, chunk * 3 - 5, dtype)  # the last chunk padded
    want = ref.chunk_topk_select(x, chunk=chunk, k=k, bits=bits, sigmas=6.0)
    got = triton_chunk_topk.chunk_topk_select(x, chunk=chunk, k=k, bits=bits, sigmas=6.0)
    assert torch.equal(got[1], want[1])  # the same elements, in the same order
    # a value on a bin's edge may fall next door (sums in another order): rarely
    assert (got[0] != want[0]).float().mean() <= 0.02
    same_codes = bool(torch.equal(got[0], want[0]))
    if same_codes:  # then the tables agree to the last bits of their sums
        torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2 ** -7, atol=0,
                                   equal_nan=True)
    assert torch.equal(got[2].isnan(), want[2].isnan())
    assert torch.isfinite(got[2]).all() or kind == "nonfinite"


@needs_triton
def test_the_codec_decodes_the_triton_select_as_the_reference():
    from commpress.codecs import codec
    from commpress.kernels import override_kernels

    c = codec("chunktopk:chunk=256,k=16")
    x = _inputs("gauss", 256 * 4, torch.float32)
    with override_kernels(kernels="reference"):
        want = c.decode(c.encode(x))
    with override_kernels(kernels="triton"):
        got = c.decode(c.encode(x))
    assert torch.equal(got != 0, want != 0)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0)
