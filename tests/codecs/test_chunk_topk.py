"""Chunked top-k with quantized values (SparseLoCo's code): what it keeps, what each kept
value decodes to, its exact bytes, and what it refuses."""

import math

import pytest
import torch

import commpress
from commpress.codecs import codec, packet_to_bytes
from commpress.kernels.reference import pack_rows, unpack_rows


def test_the_defaults_send_a_quarter_bit_per_element():
    c = codec("chunktopk")
    assert (c.chunk, c.k, c.bits, c.index_bits) == (4096, 64, 2, 12)
    # per chunk: 64 two-bit codes, 64 twelve-bit indices, 4 bf16 table values
    assert c.wire_bytes(4096 * 10) == 10 * (16 + 96 + 8)
    assert c.bits_per_element(4096 * 10) == pytest.approx(0.234375)
    x = torch.randn(4096 * 3 + 5)  # the last chunk padded
    assert packet_to_bytes(c.encode(x)).numel() == c.wire_bytes(x.numel()) == 4 * 120


@pytest.mark.parametrize("chunk, k, bits", [(4096, 64, 2), (256, 16, 3), (64, 5, 1),
                                            (1024, 1023, 8)])
def test_each_chunk_keeps_its_k_largest_decoded_through_its_bins_means(chunk, k, bits):
    c = codec(f"chunktopk:chunk={chunk},k={k},bits={bits}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(chunk * 3, generator=g) * torch.logspace(-3, 1, chunk * 3)
    y = c.decode(c.encode(x))
    for row in range(3):
        xs, ys = x[row * chunk:(row + 1) * chunk], y[row * chunk:(row + 1) * chunk]
        kept = set(xs.abs().topk(k).indices.tolist())
        assert set(ys.nonzero().view(-1).tolist()) <= kept  # zero only where a bin mean is
        # every kept value decodes to the mean of the kept values sharing its decoded value
        for value in ys[list(kept)].unique():
            members = [i for i in kept if ys[i] == value]
            mean = xs[members].double().mean().item()
            assert value.item() == pytest.approx(mean, rel=2 ** -7, abs=1e-30)


def test_ties_go_to_the_lowest_index_and_encoding_is_deterministic():
    c = codec("chunktopk:chunk=16,k=3")
    x = torch.zeros(16)
    x[[2, 5, 9, 12]] = 1.0  # four equal magnitudes, three kept
    y = c.decode(c.encode(x))
    assert y.nonzero().view(-1).tolist() == [2, 5, 9]
    z = torch.randn(4096 * 2)
    assert torch.equal(packet_to_bytes(c.encode(z)), packet_to_bytes(codec(c.spec()).encode(z)))


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 12, 16])
def test_bits_pack_and_unpack_row_by_row(width):
    g = torch.Generator().manual_seed(width)
    values = torch.randint(0, 1 << width, (5, 13), generator=g)
    packed = pack_rows(values, width)
    assert packed.dtype == torch.uint8 and packed.shape == (5, math.ceil(13 * width / 8))
    assert torch.equal(unpack_rows(packed, width, 13), values)


def test_a_packet_splits_chunk_by_chunk():
    # a collective encodes once and sends each destination its chunks' bytes
    c = codec("chunktopk:chunk=256,k=8")
    x = torch.randn(256 * 4)
    whole = c.encode(x)
    for part in range(4):
        piece = c.encode(x[part * 256:(part + 1) * 256])
        for t_whole, t_piece in zip(whole.tensors, piece.tensors):
            n = t_piece.numel()
            assert torch.equal(t_whole[part * n:(part + 1) * n], t_piece)


def test_non_finite_chunks_decode_to_nan_whole_and_finite_ones_stay_finite():
    c = codec("chunktopk:chunk=64,k=4")
    x = torch.randn(64 * 3)
    x[70] = float("inf")  # a value top-k may well keep
    x[130] = float("nan")
    y = c.decode(c.encode(x))
    assert y[:64].isfinite().all() and y[64:].isnan().all()
    huge = torch.full((64,), 3.0e38)
    huge[::2] *= -1
    assert c.decode(c.encode(huge)).isfinite().all()
    assert c.decode(c.encode(torch.zeros(64))).eq(0).all()  # no spread: no noise


@pytest.mark.parametrize("spec, needle", [
    ("chunktopk:chunk=3000", "chunk=3000 is not allowed; allowed: a power of two"),
    ("chunktopk:chunk=64,k=64", "k=64 is not allowed; allowed: 1 <= k < chunk (64)"),
    ("chunktopk:k=0", "k=0 is not allowed"),
    ("chunktopk:bits=0", "bits=0 is not allowed; allowed: 1 to 8"),
    ("chunktopk:bits=9", "bits=9 is not allowed; allowed: 1 to 8"),
    ("chunktopk:sigmas=0", "sigmas=0"),
])
def test_bad_options_are_refused_by_name(spec, needle):
    with pytest.raises(commpress.InputError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        codec(spec)


def test_a_tensor_smaller_than_a_chunk_is_refused_and_an_empty_one_sends_nothing():
    c = codec("chunktopk")
    with pytest.raises(commpress.InputError, match="4095 elements is smaller than one chunk"):
        c.encode(torch.randn(4095))
    empty = c.encode(torch.randn(0))
    assert empty.nbytes == 0 and c.decode(empty).numel() == 0


def test_with_error_feedback_what_is_sent_catches_up_with_what_came():
    # biased alone (1/16 of each chunk sent): with memory the sum of what was sent follows
    # the sum of the inputs (a small common drift, as pseudo-gradients carry)
    c = codec("chunktopk:chunk=256,k=16")
    memory = commpress.ErrorFeedback()
    g = torch.Generator().manual_seed(1)
    came, sent, alone = torch.zeros(1024), torch.zeros(1024), torch.zeros(1024)
    for _ in range(200):
        x = torch.randn(1024, generator=g) + 0.05
        came += x
        sent += c.decode(memory.encode(c, x, key="bucket"))
        alone += c.decode(c.encode(x))
    assert (came - sent).norm() / came.norm() < 0.15  # measured 0.096
    assert (came - alone).norm() / came.norm() > 0.6  # measured 0.78
