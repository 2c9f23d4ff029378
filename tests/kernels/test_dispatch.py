"""The kernels' entry points: on CPU, long tensors run the reference in pieces (cache-sized)
and give the reference's codes and values on the whole tensor (bit for bit without
Hadamard; with it, within the rotation's fp32 rounding)."""

import pytest
import torch

from commpress import kernels
from commpress.kernels import reference as ref


@pytest.fixture
def small_pieces():
    with kernels.override_kernels(kernels="reference", reference_piece=1000):  # a few groups
        yield


def _same(a: torch.Tensor, b: torch.Tensor, had: int = 0) -> bool:
    """Equal, NaN where NaN (a rotation of a NaN group may flip the NaN's sign bit); with
    Hadamard, within the rotation's fp32 rounding (the product of fewer rows may sum in
    another order)."""
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    eps = torch.finfo(a.dtype).eps  # one rounding of the output dtype
    a, b = a.nan_to_num().float(), b.nan_to_num().float()
    if not had:
        return torch.equal(a, b)
    bound = eps * a.abs() + had * torch.finfo(torch.float32).eps * a.abs().max()
    return bool(((a - b).abs() <= bound).all())


def _codes_close(c: torch.Tensor, c_ref: torch.Tensor, bits: int, had: int) -> bool:
    """Equal codes; with Hadamard, a code may differ by one step at a rounding tie."""
    if not had:
        return torch.equal(c, c_ref)
    q, q_ref = ref.unpack_codes(c, bits).float(), ref.unpack_codes(c_ref, bits).float()
    return bool((q - q_ref).abs().max() <= 1) and float((q != q_ref).float().mean()) < 1e-3


@pytest.mark.parametrize(("bits", "group", "had"), [(8, 128, 128), (4, 128, 0), (2, 64, 16),
                                                    (4, 256, 64), (8, 32, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_equal_the_whole(small_pieces, bits, group, had, dtype):
    n = 7 * 1000 + 333
    x = (torch.randn(n) * 3).to(dtype)
    x[[11, n // 2]] = torch.tensor([float("nan"), float("inf")]).to(dtype)
    for keys in (None, ref.stream_keys(1, 2, 3)):
        for sd in (torch.float32, torch.float16):
            c, s = kernels.quantize(x, bits=bits, group=group, hadamard=had, scale_dtype=sd,
                                    keys=keys)
            c_ref, s_ref = ref.quantize(x, bits=bits, group=group, hadamard=had,
                                        scale_dtype=sd, keys=keys)
            assert _codes_close(c, c_ref, bits, had) and _same(s, s_ref, had)
            out = torch.empty(n, dtype=dtype)
            d = kernels.dequantize(c_ref, s_ref, n, bits=bits, group=group, hadamard=had,
                                   out_dtype=dtype, out=out)
            assert d.data_ptr() == out.data_ptr()
            assert _same(d, ref.dequantize(c_ref, s_ref, n, bits=bits, group=group,
                                           hadamard=had, out_dtype=dtype), had)


@pytest.mark.parametrize(("bits_in", "group_in", "bits_out", "group_out", "had"),
                         [(8, 128, 4, 128, 128), (8, 64, 2, 256, 0), (4, 32, 4, 32, 32)])
def test_two_level_pieces_equal_the_whole(small_pieces, bits_in, group_in, bits_out,
                                          group_out, had):
    k, chunk = 3, 9 * 512
    enc = [ref.quantize_rotated(torch.randn(chunk) * (i + 1), bits=bits_in, group=group_in,
                                scale_dtype=torch.float32, keys=None) for i in range(k)]
    codes, scales = torch.stack([e[0] for e in enc]), torch.stack([e[1] for e in enc])
    scales[1, 5] = float("nan")
    for keys in (None, ref.stream_keys(4, 5, 6)):
        got = kernels.dequant_reduce_requant(codes, scales, bits_in=bits_in, group_in=group_in,
                                             bits_out=bits_out, group_out=group_out, keys=keys)
        want = ref.dequant_reduce_requant(codes, scales, bits_in=bits_in, group_in=group_in,
                                          bits_out=bits_out, group_out=group_out, keys=keys)
        assert torch.equal(got[0], want[0]) and _same(got[1], want[1])
    assert _same(kernels.dequantize_sum(codes, scales, bits=bits_in, group=group_in,
                                        hadamard=had),
                 ref.dequantize_sum(codes, scales, bits=bits_in, group=group_in, hadamard=had),
                 had)
