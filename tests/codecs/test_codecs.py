"""Every registered codec in one matrix: shapes, dtypes, wire bytes, determinism,
non-finite handling. Numerics of the quantizers are in test_quantize.py."""

import math

import pytest
import torch

import commpress
from commpress.codecs import codec, list_codecs, packet_to_bytes
from commpress.kernels import override_kernels

CPU_CODECS = [n for n in list_codecs() if n != "nvcomp"]  # nvcomp needs CUDA (tests/gpu)
# chunked top-k refuses a tensor smaller than a chunk: the matrix runs it with chunks of
# two (the shapes of one element are checked to be refused, below); its defaults have
# their own tests in test_chunk_topk.py
SMALL = {"chunktopk": "chunktopk:chunk=2,k=1"}
SPECS = [SMALL.get(n, n) for n in CPU_CODECS] + [
                      "int4:hadamard=128", "int8:group=64,rounding=stochastic,seed=5",
                      "int4:group=32,hadamard=64,scale_dtype=fp16",
                      "int2:packing=trits,group=64,scale_dtype=fp16",
                      "fp8:hadamard=64,scale_dtype=fp16"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Relative L2 error bounds on Gaussian data, loose enough for every dtype: the codec's
# own error (int4 group 128 ≈ 0.12, int2 ternary ≈ 0.76, sign ≈ 0.60, nf2 ≈ 0.34,
# top-1% ≈ 0.99).
MAX_REL_ERR = {"none": 0.0, "bf16": 0.01, "fp16": 0.01, "fp8": 0.05, "int8": 0.02,
               "int4": 0.2, "int2": 0.85, "sign": 0.65, "nf2": 0.4, "topk": 1.0, "zfp": 0.1,
               "chunktopk": 1.0}


def _refused_as_too_small(c, numel):
    """Chunked top-k and fewer elements than a chunk (but some): refused, by name."""
    if c.name != "chunktopk" or not 0 < numel < c.chunk:
        return False
    with pytest.raises(commpress.InputError, match=f"{numel} elements is smaller than one chunk"):
        c.encode(torch.randn(numel))
    return True


def test_every_codec_is_in_the_matrix():
    assert set(CPU_CODECS) | {"nvcomp"} == set(list_codecs())
    assert set(MAX_REL_ERR) == set(CPU_CODECS)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 13), (300, 11)])
def test_roundtrip_shape_dtype_and_error(spec, dtype, shape):
    c = codec(spec)
    x = torch.randn(shape).to(dtype)
    if _refused_as_too_small(c, x.numel()):
        return
    packet = c.encode(x)
    y = c.decode(packet)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel() >= 100:
        rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
        assert rel <= MAX_REL_ERR[c.name] + (0.01 if dtype != torch.float32 else 0.0)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 5000])
def test_wire_bytes_is_exact(spec, numel):
    c = codec(spec)
    if _refused_as_too_small(c, numel):
        return
    for dtype in DTYPES:
        packet = c.encode(torch.randn(numel).to(dtype))
        assert packet_to_bytes(packet).numel() == packet.nbytes
        if c.fixed_rate:
            assert c.wire_bytes(numel, dtype) == packet.nbytes
        else:
            assert c.wire_bytes(numel, dtype) is None


def test_int4_group128_fp32_scales_is_4_25_bits():
    assert codec("int4").bits_per_element(128 * 1000) == pytest.approx(4.25)
    assert codec("int8").bits_per_element(128 * 1000) == pytest.approx(8.25)
    assert codec("int4:group=2048").bits_per_element(2048 * 10) == pytest.approx(4 + 32 / 2048)
    assert codec("int4:scale_dtype=fp16").bits_per_element(128 * 10) == pytest.approx(4.125)


@pytest.mark.parametrize("spec", SPECS)
def test_packet_roundtrips_through_bytes(spec):
    c = codec(spec)
    x = torch.randn(999)
    packet = c.encode(x)
    rebuilt = c.packet_from_bytes(packet_to_bytes(packet).clone(), x.numel(), x.shape, x.dtype)
    assert torch.equal(c.decode(rebuilt), c.decode(packet))


@pytest.mark.parametrize("spec", SPECS)
def test_encode_is_deterministic_for_a_fresh_codec(spec):
    x = torch.randn(3000)
    a = packet_to_bytes(codec(spec).encode(x))
    b = packet_to_bytes(codec(spec).encode(x))
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_never_decodes_finite(spec, bad):
    c = codec(spec)
    for dtype in DTYPES:
        x = torch.randn(1000).to(dtype)
        x[333] = bad
        y = c.decode(c.encode(x))
        assert not torch.isfinite(y[333]), f"{spec} {dtype}: {bad} decoded to {y[333]}"


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_input(spec):
    c = codec(spec)
    base = torch.randn(64, 40)
    x = base.t()  # (40, 64), non-contiguous
    assert not x.is_contiguous()
    y = c.decode(c.encode(x))
    y_ref = c.decode(codec(spec).encode(x.contiguous()))
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_into_out(spec):
    c = codec(spec)
    x = torch.randn(10, 30)
    packet = c.encode(x)
    out = torch.empty_like(x)
    assert c.decode(packet, out=out) is out
    assert torch.equal(out, c.decode(packet))
    # another dtype, or a non-contiguous out: written through a copy, the same values
    wide = torch.empty(10, 30, dtype=torch.float64)
    assert torch.equal(c.decode(packet, out=wide), out.double())
    strided = torch.empty(30, 10).t()
    assert torch.equal(c.decode(packet, out=strided), out)


@pytest.mark.parametrize("spec", ["int4", "int8:hadamard=128", "fp8", "fp8:hadamard=32",
                                  "int2:packing=trits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decoders_write_into_out_without_a_temporary(spec, dtype):
    # the lean host path: a decoded bucket lands in the caller's buffer; no tensor of its
    # size is allocated on the way (counted at the dispatcher, Triton in interpreter mode)
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountBig(TorchDispatchMode):
        big = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if (func.name().startswith("aten::empty") and isinstance(result, torch.Tensor)
                    and result.numel() >= 4096):
                CountBig.big += 1
            return result

    with override_kernels(kernels="triton"):
        c = codec(spec)
        x = torch.randn(4096).to(dtype)
        packet = c.encode(x)
        expected = c.decode(packet)
        out = torch.full_like(x, float("nan"))
        with CountBig():
            assert c.decode(packet, out=out) is out
        assert CountBig.big == 0
        assert torch.equal(out, expected)
        with CountBig():  # without out= the decoder allocates its result (the count works)
            c.decode(packet)
        assert CountBig.big >= 1


def test_spec_string_dict_and_kwargs_agree():
    a = codec("int4:group=64,hadamard=32,rounding=stochastic,seed=3")
    b = codec({"name": "int4", "group": 64, "hadamard": 32, "rounding": "stochastic", "seed": 3})
    c = codec("int4", group=64, hadamard=32, rounding="stochastic", seed=3)
    assert a == b == c
    assert codec(a.spec()) == a
    assert commpress.codec(a.to_dict()) == a


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("int5", "unknown codec 'int5'; allowed: bf16"),
        ("int4:grp=128", "has no option 'grp'; allowed: group, hadamard"),
        ("int4:group=abc", "group='abc' is not a valid int"),
        ("int4:group=0", "group=0 is not allowed"),
        ("int4:hadamard=100", "hadamard=100 is not allowed"),
        ("int4:hadamard=512", "hadamard=512 is not allowed"),
        ("int4:rounding=up", "rounding='up' is not allowed; allowed: nearest, stochastic"),
        ("int4:scale_dtype=bf16", "allowed: fp32, fp16"),
        ("topk:ratio=0", "ratio=0.0 is not allowed"),
        ("int2:packing=nibbles", "packing='nibbles' is not allowed; allowed: bits, trits"),
        ("sign:group=12", "group=12 is not allowed; allowed: a positive multiple of 8"),
        ("zfp:rate=0.5", "rate=0.5 is not allowed"),
        ("int4:group", "is not of the form key=value"),
        ("int4:group=128,group=64", "option 'group' is given twice; allowed: each option once"),
        ("nvcomp:algorithm=zstd", "allowed: ans, bitcomp, gdeflate"),
    ],
)
def test_bad_specs_name_the_field_value_and_allowed(spec, needle):
    with pytest.raises(ValueError, match=None) as info:
        codec(spec)
    assert needle in str(info.value)


def test_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match="does not support dtype float64; allowed: float32"):
        codec("int4").encode(torch.randn(10, dtype=torch.float64))


def test_stochastic_state_roundtrip():
    c = codec("int4:rounding=stochastic,seed=1")
    x = torch.randn(500)
    c.encode(x)
    state = c.state_dict()
    nxt = packet_to_bytes(c.encode(x))
    d = codec("int4:rounding=stochastic,seed=1")
    d.load_state_dict(state)
    assert torch.equal(packet_to_bytes(d.encode(x)), nxt)


def test_topk_keeps_the_largest():
    x = torch.zeros(1000)
    x[[5, 500, 999]] = torch.tensor([3.0, -7.0, 1.0])
    c = codec("topk:ratio=0.003")
    assert torch.equal(c.decode(c.encode(x)), x)
    assert c.wire_bytes(1000) == 3 * (4 + 4) + 4
    assert math.isclose(codec("topk").k(10_000), 100)
