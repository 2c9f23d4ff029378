"""The reference kernels against float64 definitions."""

import pytest
import torch

from commpress.kernels import reference as ref


@pytest.mark.parametrize("h", [16, 32, 64, 128, 256])
def test_hadamard_is_orthogonal_up_to_h(h):
    H = ref.hadamard_pm1(h).double()
    assert torch.equal(H @ H, h * torch.eye(h, dtype=torch.float64))
    x = torch.randn(h * 5)
    back = ref.hadamard_transform(ref.hadamard_transform(x, h), h) / h
    assert torch.allclose(back, x, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    u = torch.randint(0, 2**bits, (64 * 8,), dtype=torch.int32)
    packed = ref.pack_codes(u, bits)
    assert packed.numel() == u.numel() * bits // 8
    assert torch.equal(ref.unpack_codes(packed, bits), u)


def test_hash_matches_python_and_is_well_spread():
    x = torch.arange(0, 100_000, dtype=torch.int64)
    h = ref.hash32(x)
    assert [ref.hash32_int(int(v)) for v in x[:50]] == h[:50].tolist()
    u = ref.uniform_from_counter(0, 100_000, ref.stream_keys(1, 2, 3), "cpu")
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert counts.min() > 0.9 * 100_000 / 16


def test_quantize_matches_float64_definition():
    x = torch.randn(1024) * 3
    codes, scales = ref.quantize(x, bits=4, group=128)
    g = x.double().view(-1, 128)
    scale64 = g.abs().amax(1, keepdim=True) / 7
    q = torch.floor(g / scale64 + 0.5).clamp(-7, 7)
    assert torch.equal(ref.unpack_codes(codes, 4).view(-1, 128) - 8, q.int())
    assert torch.allclose(scales.double(), scale64.view(-1), rtol=1e-7)


def test_dequant_reduce_requant_equals_sum_then_quantize():
    chunks = [torch.randn(512) for _ in range(3)]
    enc = [ref.quantize_rotated(c, bits=8, group=128, scale_dtype=torch.float32, keys=None)
           for c in chunks]
    codes = torch.stack([e[0] for e in enc])
    scales = torch.stack([e[1] for e in enc])
    out_c, out_s = ref.dequant_reduce_requant(codes, scales, bits_in=8, group_in=128,
                                              bits_out=4, group_out=128)
    total = sum(ref.dequantize_rotated(c, s, bits=8, group=128) for c, s in enc)
    exp_c, exp_s = ref.quantize_rotated(total, bits=4, group=128, scale_dtype=torch.float32,
                                        keys=None)
    assert torch.equal(out_c, exp_c) and torch.equal(out_s, exp_s)
