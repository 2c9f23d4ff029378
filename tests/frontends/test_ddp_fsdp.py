"""The DDP comm hook and the FSDP2 integration on real Gloo ranks."""

import pytest

from commpress.launch import spawn
from tests.frontends import workers


def _close(a, b, rel):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.mark.slow
def test_ddp_hook_with_the_exact_codec_is_ddps_own_averaging():
    steps = 8
    plain = spawn(workers.ddp_hook_training, 2, (None, steps))
    exact = spawn(workers.ddp_hook_training, 2, ("none", steps))
    # bit for bit: a division by a power of two commutes with the sum
    assert [r["hashes"] for r in exact] == [r["hashes"] for r in plain]


@pytest.mark.slow
def test_ddp_hook_sdp4bit_tracks_uncompressed_training():
    steps = 8
    sdp4bit = spawn(workers.ddp_hook_training, 4, ("sdp4bit", steps), ranks_per_node=2)
    plain4 = spawn(workers.ddp_hook_training, 4, (None, steps), ranks_per_node=2)
    # 4-bit gradients: within a few percent of the loss along the way
    assert _close(sdp4bit[0]["losses"], plain4[0]["losses"], 0.03)
    for step in range(steps):
        assert len({r["hashes"][step] for r in sdp4bit}) == 1


@pytest.mark.slow
def test_ddp_hook_int2ef_pipelined_equals_in_order_and_tracks_uncompressed():
    steps = 8
    piped = spawn(workers.ddp_hook_training, 4, ("int2ef", steps), ranks_per_node=2)
    in_order = spawn(workers.ddp_hook_training, 4, ("int2ef", steps, False), ranks_per_node=2)
    plain = spawn(workers.ddp_hook_training, 4, (None, steps), ranks_per_node=2)
    # the communication thread reorders collectives across buckets, never the values
    assert [r["hashes"] for r in piped] == [r["hashes"] for r in in_order]
    for step in range(steps):
        assert len({r["hashes"][step] for r in piped}) == 1
    # error feedback sends the ~85 % of elements that round to zero steps later, so the
    # first steps lag (by ~10 % here at lr 3e-3 without warm-up; in 150-step runs the
    # final loss matches, BENCHMARKS.md) — but it trains
    losses = piped[0]["losses"]
    assert losses[-1] < losses[0] - 0.8
    assert _close(losses, plain[0]["losses"], 0.12)


@pytest.mark.slow
def test_fsdp2_compressed_collectives_track_uncompressed_training():
    steps = 6
    plain = spawn(workers.fsdp_training, 2, (None, steps))
    comp = spawn(workers.fsdp_training, 2, ("zeropp", steps))
    assert _close(comp[0]["losses"], plain[0]["losses"], 0.03)
    stats = comp[0]["stats"]
    assert stats["dp.param"]["calls"] > 0 and stats["dp.grad.intra"]["calls"] > 0


@pytest.mark.slow
def test_ddp_hook_buckets_do_not_follow_ddp_rebuckets():
    # DDP hands the whole model as one bucket in its first iteration and re-buckets
    # after it; the hook compresses its own fixed buckets of named parameters throughout
    policy = {"name": "ef", "dp": {"grad": {"intra": "int8",
                                            "inter": {"codec": "int2", "error_feedback": True}}}}
    ranks = spawn(workers.ddp_hook_training, 4, (policy, 4), ranks_per_node=2)
    for step in range(4):
        assert len({r["hashes"][step] for r in ranks}) == 1
    layout = ranks[0]["layout"]
    names = [n for bucket in layout for n in bucket]
    assert len(layout) > 1 and len(names) == len(set(names)), layout
    assert all(r["layout"] == layout for r in ranks)
