"""Top-k selection: the reference against a sort, and the Triton radix select against
the reference (same bytes), in interpreter mode on CPU."""

import os

import pytest
import torch

from commpress.kernels import reference as ref

triton_topk = pytest.importorskip("commpress.kernels.triton_topk",
                                  reason="Triton is not installed (pip install triton)")
needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs TRITON_INTERPRET=1 on a machine without CUDA",
)


def _by_sort(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The specification by a stable sort: largest keys first, ties by lowest index,
    then the chosen indices in increasing order."""
    order = torch.sort(ref.magnitude_key(flat).long(), descending=True, stable=True).indices
    return order[:k].sort().values


def _inputs(n: int, dtype: torch.dtype, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(n, generator=g)
    elif kind == "few":  # only 5 distinct magnitudes, both signs: ties everywhere
        x = torch.randint(-5, 6, (n,), generator=g).float()
    elif kind == "zeros":  # +0 and -0 only: one key
        x = torch.zeros(n) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "wide":  # magnitudes from subnormal to near the dtype's max
        e = torch.randint(-140, 120, (n,), generator=g).float()
        x = torch.randn(n, generator=g).sign() * 2.0**e
    else:
        raise ValueError(kind)
    x = x.to(dtype)
    if kind == "wide":
        x = x.nan_to_num(posinf=0.0, neginf=0.0)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
@pytest.mark.parametrize("kind", ["gauss", "few", "zeros", "wide"])
def test_reference_selects_what_a_stable_sort_selects(dtype, kind):
    x = _inputs(1000, dtype, kind)
    for k in (1, 7, 100, 999, 1000):
        values, idx, flag = ref.topk_select(x, k)
        expected = _by_sort(x, k)
        assert torch.equal(idx.long(), expected), (dtype, kind, k)
        assert torch.equal(values.view(torch.uint8), x[expected].view(torch.uint8))
        assert idx.dtype == torch.int32 and flag.item() == 0.0


def test_reference_takes_nan_and_inf_first_and_flags_them():
    x = torch.tensor([1.0, float("nan"), -3.0, float("-inf"), 2.0, float("inf")])
    values, idx, flag = ref.topk_select(x, 3)
    assert idx.tolist() == [1, 3, 5] and flag.isnan().all()
    _, _, flag = ref.topk_select(x[[0, 2, 4]], 1)
    assert flag.item() == 0.0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gauss", "few", "zeros", "wide"])
@pytest.mark.parametrize("n", [1, 4095, 4096 * 4 * 2 + 17])
def test_triton_select_equals_the_reference(dtype, kind, n):
    x = _inputs(n, dtype, kind, seed=n)
    for k in sorted({1, max(1, n // 100), n // 2 + 1, n}):
        expected = ref.topk_select(x, k)
        got = triton_topk.topk_select(x, k)
        for e, g, name in zip(expected, got, ("values", "indices", "flag")):
            assert e.dtype == g.dtype, (name, k)
            assert torch.equal(e.view(torch.uint8), g.view(torch.uint8)), (name, dtype, kind, n, k)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_select_with_non_finite_values(dtype):
    x = _inputs(5000, dtype, "gauss")
    x[[10, 4000]] = float("nan")
    x[[7, 4999]] = float("-inf")
    x[3000] = float("inf")
    x[11] = -float("nan")  # a NaN with its sign bit set: the flag's bytes stay the same
    for k in (1, 3, 6, 50):
        expected, got = ref.topk_select(x, k), triton_topk.topk_select(x, k)
        assert torch.equal(expected[1], got[1]), k
        assert torch.equal(expected[0].view(torch.uint8), got[0].view(torch.uint8))
        assert got[2].isnan().all()
        assert torch.equal(expected[2].view(torch.int32), got[2].view(torch.int32))


@needs_triton
def test_triton_select_reads_a_strided_input():
    x = _inputs(6000, torch.float32, "gauss").view(3000, 2).t()[0]
    expected, got = ref.topk_select(x, 30), triton_topk.topk_select(x, 30)
    assert torch.equal(expected[1], got[1]) and torch.equal(expected[0], got[0])
