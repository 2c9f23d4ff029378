"""Empty tensors (0 elements) through every codec and every collective."""

import pytest
import torch

from commpress.codecs import ErrorFeedback, codec, list_codecs, packet_to_bytes
from commpress.collectives import chunks
from commpress.launch import spawn
from tests.collectives import empty_workers

# every registered codec with its defaults, plus the option sets that change the packet
# layout (a rotation, trits packing, fp16 scales); nvcomp needs CUDA (tests/gpu)
SPECS = [n for n in list_codecs() if n != "nvcomp"] + [
    "int4:hadamard=128", "int2:packing=trits", "int8:group=64,scale_dtype=fp16"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", empty_workers.DTYPES)
def test_every_codec_encodes_and_decodes_an_empty_tensor(spec, dtype):
    c = codec(spec)
    packet = c.encode(torch.empty(0, dtype=dtype))
    wire = packet_to_bytes(packet)
    assert c.wire_bytes(0, dtype) in (None, wire.numel())
    back = c.packet_from_bytes(wire, 0, (0,), dtype)
    assert c.decode(back).shape == (0,) and c.decode(back).dtype == dtype
    out = torch.empty(0, dtype=dtype)
    assert c.decode(packet, out=out).shape == (0,)
    # two chunks of nothing, as a two-rank reduce-scatter of 0 elements sends them
    for memory in (None, ErrorFeedback()):
        rows = chunks.encode_rows(c, torch.empty(2, 0, dtype=dtype), rng_stream=0,
                                  key="empty", memory=memory)
        assert chunks.decode_rows(c, rows, 0, dtype).shape == (2, 0)
        assert chunks.decode_sum_rows(c, rows, 0, dtype).shape == (0,)


def _assert_all_empty(ranks: list[dict]) -> None:
    for r in ranks:
        failed = {call: result for call, result in r.items() if result != (0,)}
        assert not failed, failed


@pytest.mark.parametrize("dtype", [
    torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_every_codec_through_every_collective_on_empty_tensors(dtype):
    ranks = spawn(empty_workers.empty_collectives, 2, (SPECS, (dtype,), 2), timeout=120)
    _assert_all_empty(ranks)
    assert len(ranks[0]) == len(SPECS) * 10  # every call ran


@pytest.mark.slow
def test_two_level_collectives_on_empty_tensors():
    """4 ranks in 2 nodes: the two-level paths (sub-groups, rows across nodes)."""
    two_level = ("hierarchical_reduce_scatter", "hierarchical_all_gather",
                 "hierarchical_all_reduce", "delta_all_gather")
    ranks = spawn(empty_workers.empty_collectives, 4,
                  (SPECS, empty_workers.DTYPES, 2, two_level), ranks_per_node=2, timeout=300)
    _assert_all_empty(ranks)


@pytest.mark.parametrize("spec", SPECS)
def test_played_collectives_on_empty_tensors(spec):
    """The collectives `simulate` plays in one process take empty tensors as the real ones."""
    from commpress.collectives.byte_stats import Stats
    from commpress.collectives.compressed_all_gather import all_gather_steps
    from commpress.collectives.compressed_all_reduce import all_reduce_steps
    from commpress.collectives.compressed_reduce_scatter import reduce_scatter_steps
    from commpress.collectives.delta_gather import delta_gather_steps
    from commpress.collectives.played import Played, played_peers, played_transfer

    codecs = [codec(spec) for _ in range(2)]
    empties = [torch.empty(0), torch.empty(0)]
    stats, weights, one = Stats(), torch.empty(0), played_peers(0, 1, 1)[1]
    collectives = {
        "rs": lambda r, x: reduce_scatter_steps(x, 0, codecs[r], played_peers(r, 2, 2)[0],
                                                stats, "rs", "avg"),
        "ar": lambda r, x: all_reduce_steps(x, codecs[r], played_peers(r, 2, 2)[0], stats,
                                            "ar", "avg"),
        "ag": lambda r, x: all_gather_steps(x, codecs[r], played_peers(r, 2, 2)[0], stats,
                                            "ag"),
        "delta": lambda r, x: delta_gather_steps(weights, x, codecs[r], one,
                                                 played_peers(r, 2, 2)[0], stats, "delta"),
    }
    for name, steps in collectives.items():
        played = Played(2, steps)
        for rank, x in enumerate(empties):
            played.add(rank, x)
        shape = (2, 0) if name == "ag" else (0,)  # a gather: every rank's (empty) shard
        assert [o.shape for o in played.finish().values()] == [shape, shape], name
    sent = played_transfer(codecs[0], codecs[1], torch.empty(0), rng_stream=0, key="k")
    assert sent.shape == (0,)
