"""commpress inside torchtitan: its llama3 debug model sharded by its own
``apply_fsdp_to_decoder`` on an HSDP mesh (2 nodes x 2 ranks, Gloo), then
``commpress.torchtitan.compress``. torchtitan must be installed: a missing engine fails."""

import numpy as np
import pytest
import torch

from commpress.launch import spawn
from tests.engines import torchtitan_workers as workers
from tests.reliability.killing import assert_survivors_name_the_dead_rank

pytestmark = pytest.mark.engine

WORLD, PER_NODE = 4, 2
# AdamW at lr 1e-3: the loss falls 8.2 -> 3.2 in 20 steps. At lr 3e-3 it falls 8.2 -> 3.3
# in 5 and zeropp's int4 gradients alone (int8 weights alone: 0.3 %) move single steps of
# that plunge by up to 5 % either way, then the runs meet again (mean of the last ten of
# 25 steps: +0.26 %): trajectory noise, not a bias — which the gradient test checks.
STEPS, LR = 20, 1e-3


def test_torchtitan_llama3_hsdp_zeropp_tracks_stock():
    results = spawn(workers.titan_runs, WORLD, ([None, "zeropp"], STEPS, LR),
                    ranks_per_node=PER_NODE)
    stock, zeropp = ([rank[i] for rank in results] for i in range(2))
    # tok_embeddings, 2 layers, norm, lm_head and the root
    assert zeropp[0]["comm"] == ("FSDPCompression", 6)
    calls = zeropp[0]["stats"]["dp.grad.inter"]["calls"]
    assert calls == 4 * STEPS  # the modules holding parameters of their own
    losses, base = np.array(zeropp[0]["losses"]), np.array(stock[0]["losses"])
    # each step within 2 % (measured at most 0.8 %): weights gathered stale, or an update
    # lost, would put a step's loss on the wrong side of a 0.6-per-step fall; the end of
    # the run within the project's 1 % (measured +0.39 %, last ten steps)
    assert np.all(np.abs(losses / base - 1) <= 0.02), (losses, base)
    assert abs(losses[-10:].mean() / base[-10:].mean() - 1) <= 0.01, (losses, base)
    for r in range(PER_NODE):  # the two nodes' replicas of each shard agree bit for bit
        assert zeropp[r]["local"] == zeropp[r + PER_NODE]["local"]
    inter = zeropp[0]["stats"]["dp.grad.inter"]
    assert inter["wire_bytes"] * 8 / inter["elements"] < 4.5


@pytest.fixture(scope="module")
def gradients():
    """One backward on the same batch: the exact codec with torchtitan's divide factor
    1.0, stock FSDP averaging, the exact codec and zeropp with FSDP averaging (full
    gradients, numpy)."""
    runs = [("none", True), (None, False), ("none", False), ("zeropp", False)]
    return spawn(workers.titan_gradients, WORLD, (runs,), ranks_per_node=PER_NODE)[0]


def test_torchtitan_exact_codec_gradient_equals_stock_bit_for_bit(gradients):
    _, stock, exact, _ = gradients
    assert all(np.array_equal(a, b) for a, b in zip(exact, stock))


def test_torchtitan_gradient_division_off_sums_across_every_rank(gradients):
    summed, averaged, _, _ = gradients
    for a, b in zip(summed, averaged):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b) * WORLD,
                                   rtol=1e-5, atol=1e-7)


def test_torchtitan_zeropp_gradient_is_the_stock_gradient_plus_int4_noise(gradients):
    # AdamW barely sees a gradient's scale, so a loss comparison cannot catch a wrongly
    # scaled reduction (a sum for a mean, a divide by the wrong group): the gradient's
    # projection on the stock one must be 1 (measured 1.009); int4 codes (group 128) in
    # the node and again across nodes leave a relative error of 0.11 (bound 0.2)
    _, stock, _, zeropp = (np.concatenate([g.ravel() for g in run]) for run in gradients)
    assert zeropp @ stock / (stock @ stock) == pytest.approx(1.0, abs=0.03)
    assert np.linalg.norm(zeropp - stock) / np.linalg.norm(stock) < 0.2


def test_a_rank_killed_mid_step_is_named_by_the_ranks_that_wait_for_it():
    """Rank 3 dies. Its node peer (rank 2) waits for it in the shard reduce-scatter and
    its replica peer (rank 1) in the replicate all-reduce: both name it; rank 0 waits only
    for survivors, which fail first, and names a rank it waited for. Every survivor fails
    within the timeout."""
    ranks = spawn(workers.titan_killed_mid_step, WORLD, (3,), ranks_per_node=PER_NODE,
                  pg_timeout_s=15, timeout=300, allow_errors=True)
    assert_survivors_name_the_dead_rank(ranks, victim=3, timeout_s=15, naming={1, 2})


def test_what_a_user_gets_wrong_is_refused_by_name_and_remove_gives_stock_fsdp_back():
    """Misuse, ranks on different policies, swapped and truncated state, and a NaN on one
    rank, on the llama3 HSDP mesh."""
    ranks = spawn(workers.titan_adversarial, WORLD, (), ranks_per_node=PER_NODE,
                  pg_timeout_s=60, timeout=300)
    for rank, out in enumerate(ranks):
        # every rank is told, not only those sharing a group with the one that differs
        # (rank 3 shares none with rank 0: its groups' peers tell it), and none waits
        assert "CollectiveMismatchError" in out["policies"], out["policies"]
        if rank in (0, 1, 2):
            assert "zeropp" in out["policies"] and "sdp4bit" in out["policies"]
        else:
            assert "other_groups_of_the_mesh differs" in out["policies"], out["policies"]
        empty, not_a_module = out["parts"]
        assert "InputError" in empty and "model_parts" in empty
        assert "InputError" in not_a_module and "'layers'" in not_a_module
        assert "compressed already" in out["twice"] and "remove()" in out["twice"]
        assert f"not this rank's ('rank{rank}')" in out["other_rank"]
        assert "truncated or corrupt" in out["truncated"]
        assert "world_size" in out["smaller_world"] and "elastic" in out["smaller_world"]
        assert out["own"] is None
        # compress, refused again, remove (twice): then FSDP2's own steps, bit for bit
        assert out["removed"] == out["stock"]
        # rank 3's NaN crosses both levels: nothing stock leaves non-finite is finite
        assert out["nan_stock"] > 0 and out["nan_made_finite"] == 0, out
