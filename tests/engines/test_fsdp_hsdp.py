"""FSDP2 HSDP (a 2-D (replicate, shard) mesh) with compressed collectives: the
replicate dimension's gradient all-reduce goes through the policy's inter-node codec
(label ``dp.grad.inter``) — 4 ranks as 2 nodes x 2 on Gloo."""

import pytest
import torch

import commpress
from commpress.launch import spawn
from tests.engines import hsdp_workers

WORLD, PER_NODE, STEPS = 4, 2, 3


def _runs(policies):
    results = spawn(hsdp_workers.hsdp_runs, WORLD, (policies, STEPS), ranks_per_node=PER_NODE)
    return [[rank[i] for rank in results] for i in range(len(policies))]


def _replicas_identical(results):
    # ranks r and r + PER_NODE hold the same shard on the two nodes
    for r in range(PER_NODE):
        assert results[r]["local"] == results[r + PER_NODE]["local"]
    assert len({r["full"] for r in results}) == 1


def _check_node_local(results):
    # only the replicate all-reduce leaves the node: the weight all-gather and the
    # gradient reduce-scatter stay on the shard group, the ranks of one node
    for rank, r in enumerate(results):
        node = list(range(rank - rank % PER_NODE, rank - rank % PER_NODE + PER_NODE))
        replicas = list(range(rank % PER_NODE, WORLD, PER_NODE))
        assert r["groups"] and all(g == (node, node, replicas) for g in r["groups"]), r["groups"]


def _check_compressed(results, policy, stock_losses):
    losses = results[0]["losses"]
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, stock_losses)), (losses,
                                                                                 stock_losses)
    _replicas_identical(results)
    _check_node_local(results)
    inter = results[0]["stats"]["dp.grad.inter"]
    codec = commpress.Policy.resolve(policy).codec_for("dp", "grad", "inter")
    bits = inter["wire_bytes"] * 8 / inter["elements"]
    assert bits == pytest.approx(codec.bits_per_element(inter["elements"] // inter["calls"]),
                                 rel=0.02)
    assert bits < 5  # 4-bit codes across nodes, not fp32
    assert results[0]["state_keys"] == ["grad", "param", "replicate"]


def test_hsdp_replicate_all_reduce_goes_through_the_inter_codec():
    stock, exact, zeropp = _runs([None, "none", "zeropp"])
    # the exact codec is stock HSDP bit for bit, its replicate all-reduce commpress's
    assert [r["losses"] for r in exact] == [r["losses"] for r in stock]
    assert [r["full"] for r in exact] == [r["full"] for r in stock]
    assert exact[0]["stats"]["dp.grad.inter"]["calls"] == 3 * STEPS  # 3 FSDP modules
    _replicas_identical(exact)
    _check_compressed(zeropp, "zeropp", stock[0]["losses"])


@pytest.mark.slow
def test_hsdp_sdp4bit_tracks_stock_with_identical_replicas():
    stock, sdp4bit = _runs([None, "sdp4bit"])
    _check_compressed(sdp4bit, "sdp4bit", stock[0]["losses"])


@pytest.mark.slow
def test_hsdp_gradient_averaging_matches_stock_for_every_divide_factor():
    # None: FSDP averages; 2.0, the shard size: FSDP passes AVG to the reduce-scatter and
    # sums across replicas; 6.0: PREMUL_SUM(1/6) (Gloo has none: no stock run to compare)
    runs = [(None, None), ("none", None), (None, 2.0), ("none", 2.0), ("none", 6.0)]
    stock, exact, stock_2, exact_2, exact_6 = [
        [torch.from_numpy(g) for g in grads] for grads in
        spawn(hsdp_workers.hsdp_gradients, WORLD, (runs,), ranks_per_node=PER_NODE)[0]]
    assert all(torch.equal(a, b) for a, b in zip(exact, stock))
    assert all(torch.equal(a, b) for a, b in zip(exact_2, stock_2))
    assert not all(torch.equal(a, b) for a, b in zip(stock_2, stock))
    for a, b in zip(exact_6, stock):  # the sum over the 4 ranks, divided by 6
        torch.testing.assert_close(a, b * WORLD / 6.0, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_hsdp_layouts_not_covered_are_refused_by_name():
    errors = spawn(hsdp_workers.hsdp_refusals, WORLD, (["shard_size_1", "no_all_reduce"],),
                   ranks_per_node=PER_NODE)[0]
    shard1, no_all_reduce = errors["shard_size_1"], errors["no_all_reduce"]
    assert shard1.startswith("InputError") and "shard dimension of size 1" in shard1
    assert "mesh (4, 1)" in shard1
    assert no_all_reduce.startswith("RuntimeError")
    assert "set_requires_all_reduce(False)" in no_all_reduce


@pytest.mark.slow
def test_hsdp_replicate_all_reduce_overlaps_backward_with_the_same_bits():
    # on CPU the replicate all-reduces of a backward pass run while it goes on and finish
    # at its end; a pass that accumulates into .grad finishes each one in place
    out = spawn(hsdp_workers.hsdp_overlap, WORLD, ("zeropp",), ranks_per_node=PER_NODE)
    for rank in out:
        overlap, in_place = rank["overlap"], rank["in place"]
        assert overlap["in_flight"] == [3, 0]  # 3 FSDP modules in flight, then none
        assert in_place["in_flight"] == [0, 0]
        for a, b in zip(overlap["grads"], in_place["grads"]):
            assert all((ga == gb).all() for ga, gb in zip(a, b))
    assert all((a == b).all() for a, b in zip(out[0]["overlap"]["grads"][1],
                                              out[1]["overlap"]["grads"][1]))


def test_remove_gives_fsdp_its_own_collectives_and_mesh_back():
    """``remove()`` before training: stock HSDP bit for bit; midway: no commpress
    collective after it and the replicas stay identical; compressing a compressed model is
    refused, compressing it again after ``remove()`` is not."""
    ranks = spawn(hsdp_workers.hsdp_remove, WORLD, ("sdp4bit", 4), ranks_per_node=PER_NODE)
    for r in ranks:
        assert r["removed at once"]["losses"] == r["stock"]["losses"]
        assert r["removed at once"]["local"] == r["stock"]["local"]
        assert r["removed midway"]["stats"] == []  # nothing of commpress's after remove()
        assert "compressed already; remove() the first" in r["twice"]
        assert "dp.grad.inter" in r["again stats"]
    for rank in range(PER_NODE):  # the replicas: the same shard on the two nodes
        assert ranks[rank]["removed midway"]["local"] == ranks[rank + PER_NODE][
            "removed midway"]["local"]
