"""Triton kernels against the torch reference, in interpreter mode on CPU.

The codes must be identical; decoded values within 1 ulp of the output dtype. Where
Hadamard is on, the matrix product may sum in another order than torch's, so a code
may differ only for a value within float rounding of a rounding boundary (the test
checks that every differing code is such a tie), and decoded values may differ by
the fp32 summation error of the inverse rotation.
"""

import os

import pytest
import torch

from commpress.kernels import reference as ref
from commpress.kernels.config import override_kernels

triton_quant = pytest.importorskip("commpress.kernels.triton_quant",
                                   reason="Triton is not installed (pip install triton)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs TRITON_INTERPRET=1 on a machine without CUDA",
)

CASES = [(8, 128, 0), (4, 128, 0), (2, 64, 0), (4, 128, 128), (4, 32, 128), (8, 256, 32),
         (4, 2048, 128), (8, 128, 16)]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(x.dtype).eps
    tiny = torch.finfo(x.dtype).tiny
    return (x.float().abs() * eps).clamp_min(tiny)


def _assert_decodes_close(d_ref, d_tri, y_hat, had):
    """Decoded values within 1 ulp of the output dtype; with Hadamard, plus the fp32
    summation error of the inverse rotation, which sums h terms of |ŷ|/h in another
    order than torch: ≤ log2(h)·eps·max|ŷ| over the block (ŷ: the values in the
    rotated domain)."""
    numel = d_ref.numel()
    assert torch.equal(d_ref.isnan(), d_tri.isnan())
    bound = _ulp(d_ref) * 1.01
    if had:
        block_max = y_hat.reshape(-1, had).abs().amax(1).repeat_interleave(had)[:numel]
        bound = bound + had.bit_length() * torch.finfo(torch.float32).eps * block_max
    ok = ~d_ref.isnan()
    assert torch.all((d_ref[ok].float() - d_tri[ok].float()).abs() <= bound[ok])


def _assert_codes_match(x, bits, group, had, sd, keys, c_ref, c_tri):
    if torch.equal(c_ref, c_tri):
        return
    assert had > 0, "codes differ without Hadamard"
    # recompute the pre-rounding values and check every difference is a near-tie
    total = ref.padded_numel(x.numel(), bits, group, had)
    y = torch.zeros(total)
    y[: x.numel()] = x.float()
    y = ref.hadamard_transform(y, had)
    _, s_ref = ref.quantize_rotated(y, bits=bits, group=group, scale_dtype=sd, keys=keys)
    v = y.view(-1, group) * (1.0 / s_ref.float().view(-1, 1))
    if keys is None:
        frac = (v + 0.5) - torch.floor(v + 0.5)
    else:
        u = ref.uniform_from_counter(0, total, keys, "cpu").view_as(v)
        frac = (v + u) - torch.floor(v + u)
    near_tie = torch.minimum(frac, 1 - frac).view(-1) < 1e-4
    q_ref, q_tri = ref.unpack_codes(c_ref, bits), ref.unpack_codes(c_tri, bits)
    differs = q_ref != q_tri
    assert (q_ref - q_tri)[differs].abs().max() == 1, "a code differs by more than one step"
    assert near_tie[differs].all(), "a code differs away from a rounding tie"


@pytest.mark.parametrize(("bits", "group", "had"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("numel", [1, 1000, pytest.param(9000, marks=pytest.mark.slow)])
def test_encode_decode_match_reference(bits, group, had, dtype, stochastic, numel):
    x = (torch.randn(numel) * 2).to(dtype)
    x[numel // 2] = float("nan") if numel > 1 else x[0]
    keys = ref.stream_keys(5, 9, 2) if stochastic else None
    for sd in (torch.float32, torch.float16):
        c_ref, s_ref = ref.quantize(x, bits=bits, group=group, hadamard=had, scale_dtype=sd,
                                    keys=keys)
        c_tri, s_tri = triton_quant.quantize(x, bits=bits, group=group, hadamard=had,
                                             scale_dtype=sd, keys=keys)
        assert c_tri.shape == c_ref.shape and s_tri.dtype == s_ref.dtype
        _assert_codes_match(x, bits, group, had, sd, keys, c_ref, c_tri)
        torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=0, equal_nan=True)
        d_ref = ref.dequantize(c_ref, s_ref, numel, bits=bits, group=group, hadamard=had,
                               out_dtype=dtype)
        d_tri = triton_quant.dequantize(c_ref, s_ref, numel, bits=bits, group=group,
                                        hadamard=had, out_dtype=dtype)
        _assert_decodes_close(d_ref, d_tri, ref.dequantize_rotated(c_ref, s_ref, bits=bits,
                                                                   group=group), had)


@pytest.mark.parametrize(("bits", "group", "had"), [(8, 128, 128), (4, 128, 128), (2, 128, 128),
                                                    (4, 16, 16), (2, 64, 64), (4, 256, 64),
                                                    (8, 512, 128), (4, 2048, 128), (2, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_equal_the_flat_tile_kernels(bits, group, had, dtype):
    """The row kernels (groups of whole Hadamard blocks) give the flat-tile kernels'
    bytes and values exactly, stochastic and fp16 scales included, a partial last tile too."""
    n = 3 * 4096 + 5 * group + 7
    x = (torch.randn(n) * torch.rand(n).pow(4) * 50).to(dtype)
    x[[3, n - 2]] = torch.tensor([float("inf"), float("nan")]).to(dtype)
    for keys in (None, ref.stream_keys(3, 1, 4)):
        for sd in (torch.float32, torch.float16):
            runs = []
            for rows in (True, False):
                with override_kernels(row_kernels=rows):
                    c, s = triton_quant.quantize(x, bits=bits, group=group, hadamard=had,
                                                 scale_dtype=sd, keys=keys)
                    d = triton_quant.dequantize(c, s, n, bits=bits, group=group,
                                                hadamard=had, out_dtype=dtype)
                runs.append((c, s, d))
            for a, b in zip(*runs):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(("bits_in", "bits_out", "group", "had"),
                         [(8, 4, 128, 128), (8, 2, 64, 0), (4, 4, 32, 32), (2, 8, 256, 0),
                          (8, 4, 4096, 0)])
def test_two_level_row_kernels_equal_the_flat_tile_kernels(bits_in, bits_out, group, had):
    """dequantize-reduce-requantize and dequantize-sum: the same bytes either way."""
    k, chunk = 3, 2 * 4096 + 3 * group
    enc = [ref.quantize_rotated(torch.randn(chunk) * (i + 1), bits=bits_in, group=group,
                                scale_dtype=torch.float32, keys=None) for i in range(k)]
    codes, scales = torch.stack([e[0] for e in enc]), torch.stack([e[1] for e in enc])
    scales[1, 2] = float("nan")  # a non-finite group stays one
    for keys in (None, ref.stream_keys(2, 7, 1)):
        runs = []
        for rows in (True, False):
            with override_kernels(row_kernels=rows):
                runs.append((*triton_quant.dequant_reduce_requant(
                    codes, scales, bits_in=bits_in, group_in=group, bits_out=bits_out,
                    group_out=group, scale_dtype=torch.float16, keys=keys),
                    triton_quant.dequantize_sum(codes, scales, bits=bits_in, group=group,
                                                hadamard=had)))
        for a, b in zip(*runs):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(("bits_in", "bits_out", "group"), [(8, 4, 128), (8, 8, 64), (4, 2, 32)])
def test_dequant_reduce_requant_matches_reference(k, bits_in, bits_out, group):
    chunk = 4096 + 2 * group
    enc = [ref.quantize_rotated(torch.randn(chunk), bits=bits_in, group=group,
                                scale_dtype=torch.float32, keys=None) for _ in range(k)]
    codes = torch.stack([e[0] for e in enc])
    scales = torch.stack([e[1] for e in enc])
    for keys in (None, ref.stream_keys(1, 2, 3)):
        c_ref, s_ref = ref.dequant_reduce_requant(codes, scales, bits_in=bits_in, group_in=group,
                                                  bits_out=bits_out, group_out=group, keys=keys)
        c_tri, s_tri = triton_quant.dequant_reduce_requant(
            codes, scales, bits_in=bits_in, group_in=group, bits_out=bits_out, group_out=group,
            keys=keys)
        assert torch.equal(c_ref, c_tri)
        assert torch.equal(s_ref, s_tri)


def test_supports():
    assert triton_quant.supports(4, 128, 128)
    assert not triton_quant.supports(4, 100, 0)
    assert not triton_quant.supports(4, 128, 8)
    assert not triton_quant.supports(4, 128, 256)  # its fp32 matrix outgrows shared memory


@pytest.mark.parametrize(("bits", "group", "had"), [(8, 128, 0), (4, 128, 128), (4, 32, 128)])
@pytest.mark.parametrize("sd", [torch.float32, torch.float16])
def test_values_near_fp32_max_saturate_as_the_reference_does(bits, group, had, sd):
    top = torch.finfo(torch.float32).max
    x = (torch.rand(1024) * 2 - 1) * 3e38  # finite and huge
    x[:8] = torch.tensor([top, -top, 1e37, -3e38, 1.0, float("nan"), 2.0, 3.0])
    c_ref, s_ref = ref.quantize(x, bits=bits, group=group, hadamard=had, scale_dtype=sd)
    c_tri, s_tri = triton_quant.quantize(x, bits=bits, group=group, hadamard=had, scale_dtype=sd)
    torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=0, equal_nan=True)
    d_ref = ref.dequantize(c_ref, s_ref, x.numel(), bits=bits, group=group, hadamard=had)
    d_tri = triton_quant.dequantize(c_tri, s_tri, x.numel(), bits=bits, group=group,
                                    hadamard=had)
    for d in (d_ref, d_tri):
        # only the groups (blocks) holding the NaN decode to NaN; the rest stay finite
        width = max(group, had)
        nan_block = torch.zeros(x.numel(), dtype=torch.bool)
        nan_block[5 // width * width: (5 // width + 1) * width] = True
        assert d[nan_block].isnan().all() and torch.isfinite(d[~nan_block]).all()


def _fp8_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


def test_fp8_bits_equal_torchs_cast_on_every_code_and_tie():
    # every finite e4m3 value, the midpoints between neighbours (ties: to even), points
    # just off the midpoints, both signs and both zeros, through the quantize kernel
    # (group 1, scale 1/448·448 = 1: the scale is exactly 1 for a group at 448)
    values = _fp8_values(torch.arange(0, 127, dtype=torch.uint8))  # 0 … 448
    mids = (values[1:] + values[:-1]) / 2
    eps = torch.finfo(torch.float32).eps
    probe = torch.cat([values, mids, mids * (1 + 4 * eps), mids * (1 - 4 * eps),
                       torch.tensor([0.0, 1e-30, 2.0**-10, 2.0**-6 * (1 - eps)])])
    probe = torch.cat([probe, -probe])
    x = torch.stack([probe, torch.full_like(probe, 448.0)], dim=1).reshape(-1)  # group 2
    c_ref, s_ref = ref.fp8_quantize(x, group=2)
    c_tri, s_tri = triton_quant.fp8_quantize(x, group=2)
    assert torch.equal(s_tri, s_ref) and torch.equal(c_tri, c_ref)
    assert torch.equal(triton_quant.fp8_dequantize(c_ref, s_ref, x.numel(), group=2),
                       ref.fp8_dequantize(c_ref, s_ref, x.numel(), group=2))


@pytest.mark.parametrize(("group", "had"), [(128, 0), (32, 0), (128, 128), (256, 32),
                                            (32, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 1000, pytest.param(9000, marks=pytest.mark.slow)])
def test_fp8_encode_decode_match_reference(group, had, dtype, numel):
    x = (torch.randn(numel) * 3).to(dtype)
    x[numel // 2] = float("nan") if numel > 1 else x[0]
    if numel > 8:
        x[3] = -0.0
    for sd in (torch.float32, torch.float16):
        c_ref, s_ref = ref.fp8_quantize(x, group=group, hadamard=had, scale_dtype=sd)
        c_tri, s_tri = triton_quant.fp8_quantize(x, group=group, hadamard=had, scale_dtype=sd)
        assert c_tri.shape == c_ref.shape and s_tri.dtype == s_ref.dtype
        if had:  # rotation sums in another order: scales within rounding, codes at ties
            torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=0, equal_nan=True)
            differs = c_ref != c_tri
            a, b = _fp8_values(c_ref[differs]), _fp8_values(c_tri[differs])
            assert differs.float().mean() < 0.01, "fp8 codes differ beyond rounding ties"
            assert torch.all((a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8 + 2.0**-9)
        else:
            assert torch.equal(c_tri, c_ref) and torch.equal(s_tri.isnan(), s_ref.isnan())
            assert torch.equal(s_tri[~s_tri.isnan()], s_ref[~s_ref.isnan()])
        d_ref = ref.fp8_dequantize(c_ref, s_ref, numel, group=group, hadamard=had,
                                   out_dtype=dtype)
        d_tri = triton_quant.fp8_dequantize(c_ref, s_ref, numel, group=group, hadamard=had,
                                            out_dtype=dtype)
        _assert_decodes_close(d_ref, d_tri, _fp8_values(c_ref).view(-1, group)
                              * s_ref.float().view(-1, 1), had)


def test_fp8_near_fp32_max_saturates_as_the_reference_does():
    top = torch.finfo(torch.float32).max
    x = (torch.rand(1024) * 2 - 1) * 3e38
    x[:6] = torch.tensor([top, -top, 1e37, -3e38, 1.0, float("nan")])
    for had in (0, 128):
        c_ref, s_ref = ref.fp8_quantize(x, group=128, hadamard=had)
        c_tri, s_tri = triton_quant.fp8_quantize(x, group=128, hadamard=had)
        torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=0, equal_nan=True)
        d = triton_quant.fp8_dequantize(c_tri, s_tri, x.numel(), group=128, hadamard=had)
        assert d[:128].isnan().all() and torch.isfinite(d[128:]).all()


@pytest.mark.parametrize(("group", "had"), [(128, 0), (16, 0), (256, 0), (128, 128), (64, 16),
                                            (32, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("numel", [1, pytest.param(5000, marks=pytest.mark.slow)])
def test_trits_encode_decode_match_reference(group, had, dtype, stochastic, numel):
    x = (torch.randn(numel) * 2).to(dtype)
    x[numel // 2] = float("nan") if numel > 1 else x[0]
    keys = ref.stream_keys(3, 1, 4) if stochastic else None
    for sd in (torch.float32, torch.float16):
        c_ref, s_ref = ref.trits_quantize(x, group=group, hadamard=had, scale_dtype=sd,
                                          keys=keys)
        c_tri, s_tri = triton_quant.trits_quantize(x, group=group, hadamard=had, scale_dtype=sd,
                                                   keys=keys)
        assert c_tri.shape == c_ref.shape and s_tri.dtype == s_ref.dtype
        if had:  # rotation sums in another order: a trit may differ at a rounding tie
            torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=0, equal_nan=True)
            q_ref, q_tri = ref.trit_values(c_ref, group), ref.trit_values(c_tri, group)
            assert (q_ref - q_tri).abs().max() <= 1
            assert (q_ref != q_tri).float().mean() < 0.01
        else:
            assert torch.equal(c_tri, c_ref)
            torch.testing.assert_close(s_tri, s_ref, rtol=0, atol=0, equal_nan=True)
        d_ref = ref.trits_dequantize(c_ref, s_ref, numel, group=group, hadamard=had,
                                     out_dtype=dtype)
        d_tri = triton_quant.trits_dequantize(c_ref, s_ref, numel, group=group, hadamard=had,
                                              out_dtype=dtype)
        _assert_decodes_close(d_ref, d_tri, ref.trit_values(c_ref, group).float().view(-1, group)
                              * s_ref.float().view(-1, 1), had)


def test_trits_supported_groups():
    assert triton_quant.supports(2, 128, 128, trits=True)
    assert not triton_quant.supports(2, 8, 0, trits=True)   # tl.dot needs 16 columns
    assert not triton_quant.supports(2, 512, 0, trits=True)
    assert not triton_quant.supports(4, 128, 0, trits=True)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(("bits", "group", "had"), [(8, 128, 128), (4, 128, 128), (4, 32, 128),
                                                    (8, 64, 0), (2, 128, 16)])
def test_dequantize_sum_matches_reference(k, bits, group, had, fp32_dot="ieee"):
    # TLq-HS step 5 fused: decode k chunks, sum in row order, rotate back once
    chunk = 4096 + 2 * max(group, had)
    enc = [ref.quantize_rotated(torch.randn(chunk) * (i + 1), bits=bits, group=group,
                                scale_dtype=torch.float32, keys=None) for i in range(k)]
    codes = torch.stack([e[0] for e in enc])
    scales = torch.stack([e[1] for e in enc])
    scales[0, 3] = float("nan")  # a non-finite group stays non-finite in the sum
    d_ref = ref.dequantize_sum(codes, scales, bits=bits, group=group, hadamard=had)
    with override_kernels(fp32_dot=fp32_dot):
        d_tri = triton_quant.dequantize_sum(codes, scales, bits=bits, group=group,
                                            hadamard=had)
    assert d_tri.dtype == torch.float32 and d_tri.shape == d_ref.shape
    if not had:  # the same additions in the same order
        assert torch.equal(d_ref.isnan(), d_tri.isnan())
        assert torch.equal(d_ref.nan_to_num(), d_tri.nan_to_num())
        return
    summed = ref.sum_rows(torch.stack([ref.dequantize_rotated(c, s, bits=bits, group=group)
                                       for c, s in zip(codes, scales)]))
    _assert_decodes_close(d_ref, d_tri, summed, had)


@pytest.mark.parametrize("rows", [True, False])
def test_dequantize_sum_with_tf32x3_products_matches_reference(rows):
    # the H200's choice for this kernel (TUNED): three tf32 products stand for one fp32
    with override_kernels(row_kernels=rows):
        test_dequantize_sum_matches_reference(2, 4, 128, 128, fp32_dot="tf32x3")

