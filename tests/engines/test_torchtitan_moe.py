"""commpress inside torchtitan's mixture of experts: a tiny Qwen3-MoE with torchtitan's
own expert parallelism (EP = 2 and 4 ranks, Gloo), its token all-to-alls through the
policy's ``ep`` codecs. torchtitan must be installed: a missing engine fails."""

import pytest

from commpress.launch import spawn
from tests.engines import torchtitan_moe_workers as workers

pytestmark = pytest.mark.engine

STEPS = 3
EXACT = {"name": "exact-ep", "ep": dict.fromkeys(
    ["dispatch", "combine", "dispatch_grad", "combine_grad"], "none")}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_tokens_go_through_the_ep_codecs(world):
    ranks = spawn(workers.moe_runs, world, ([None, "ep-int8"], STEPS), timeout=600)
    for r in ranks:
        stock, int8 = r[None], r["ep-int8"]
        assert int8["handle"] == "ExpertCompression", int8
        # every direction of both layers, every step: 2 layers x STEPS calls each
        assert {k: v["calls"] for k, v in int8["stats"].items()} == dict.fromkeys(
            ["ep.dispatch", "ep.combine", "ep.dispatch_grad", "ep.combine_grad"],
            2 * STEPS), int8["stats"]
        assert all(v["wire_bytes"] < 0.6 * v["raw_bytes"] for v in int8["stats"].values())
        # int8 tokens: the loss follows stock's closely, not exactly
        assert int8["losses"] != stock["losses"]
        for a, b in zip(int8["losses"], stock["losses"]):
            assert abs(a - b) < 0.01 * b, (int8["losses"], stock["losses"])
        # remove() gives the stock dispatchers back: no ep traffic of commpress's
        assert int8["stats_after_remove"] == {}, int8


def test_ep_rules_of_none_are_stock_bit_for_bit():
    """A policy naming ep rules of ``none``: the tokens go through commpress's exchange
    (counted, agreed) as torch's own all-to-all: the wiring (splits, order, the backward's
    reverse exchange) is checked bit for bit against stock."""
    for r in spawn(workers.moe_runs, 2, ([None, EXACT], STEPS), timeout=600):
        stock, ours = r[None], r["exact-ep"]
        assert ours["stats"]["ep.dispatch"]["calls"] == 2 * STEPS, ours
        assert ours["losses"] == stock["losses"] and ours["hash"] == stock["hash"]


def test_what_the_adapter_refuses():
    errors = spawn(workers.refused, 2, ("sdp4bit",))
    assert all("no FSDPModule" in e for e in errors), errors
