"""The collectives `commpress simulate` plays in one process give, bit for bit, what the
real ones give on every rank of a multi-process Gloo run — over successive calls, so
stochastic-rounding counters and error-feedback memory carry over as they do for real."""

import pytest
import torch

import commpress
from commpress.launch import spawn
from tests.collectives import workers

EF_INT2 = {"codec": "int2:packing=trits,scale_dtype=fp16", "error_feedback": True}


@pytest.mark.parametrize("world,rpn,rule,dtype", [
    (2, 2, "int4:hadamard=128", torch.float32),            # two ranks: one exchange
    (3, 3, "int8:rounding=stochastic", torch.bfloat16),    # reduce-scatter + all-gather
    pytest.param(4, 4, "topk:ratio=0.1", torch.float32,
                 marks=pytest.mark.slow),                   # variable-size rows
    pytest.param(4, 2, {"intra": "none", "inter": EF_INT2}, torch.float32,
                 marks=pytest.mark.slow),                   # int2ef's path
    pytest.param(4, 2, {"intra": "int8:hadamard=128", "inter": "int4:hadamard=128"},
                 torch.bfloat16, marks=pytest.mark.slow),
    pytest.param(6, 2, {"intra": "none", "inter": "int4"}, torch.float32,
                 marks=pytest.mark.slow),                   # three nodes
    pytest.param(6, 3, {"intra": "int8", "inter": EF_INT2}, torch.bfloat16,
                 marks=pytest.mark.slow),
    pytest.param(2, 2, {"intra": "int8", "inter": "int4"}, torch.float32,
                 marks=pytest.mark.slow),                   # one node: intra alone
])
def test_played_all_reduce_equals_the_real_one(world, rpn, rule, dtype):
    numel, calls = 1000 + 13, 3
    real = spawn(workers.real_all_reduces, world, (rule, numel, dtype, calls, rpn),
                 ranks_per_node=rpn)
    assert all(r == real[0] for r in real)  # every rank holds the same bits
    assert workers.played_all_reduces(world, rule, numel, dtype, calls, rpn) == real[0]
    assert len(set(real[0])) == calls  # the calls differ: the check is not vacuous


CPU_CODECS = [n for n in commpress.list_codecs() if n != "nvcomp"]  # nvcomp needs CUDA


@pytest.mark.parametrize("m", [256, 300])  # a chunk the codecs need not pad, and one they do
@pytest.mark.parametrize("rule", [
    *CPU_CODECS,
    *({"codec": n, "error_feedback": True} for n in CPU_CODECS if n != "none"),
    {"intra": "int8:hadamard=128", "inter": "int4:hadamard=128"},  # fused requantization
    {"intra": "none", "inter": EF_INT2},
])
def test_played_steps_do_not_read_their_input_once_they_wait(rule, m):
    """Steps hold only codes while they wait (the played transport holds every rank's
    suspended steps at once): overwriting an input once it is handed over changes no
    result — on every codec, with error feedback, on one level and two, over successive
    calls."""
    world, rpn, calls = 4, 2, 2
    inputs = [workers.played_inputs(r, world * m, torch.float32, calls) for r in range(world)]
    kept = workers.played_reduce_scatters(world, rule, m, inputs, calls, rpn, overwrite=False)
    overwritten = workers.played_reduce_scatters(world, rule, m, inputs, calls, rpn,
                                                 overwrite=True)
    for a, b in zip(kept, overwritten, strict=True):
        assert torch.isfinite(a).all()  # NaN written over an input never arrives
        assert torch.equal(a, b)


# relative error bounds of one call: 8 and 4 bits; ternary codes and top-k 10 % leave most
# of the signal to their error-feedback memory (a biased codec: under the signal's norm)
@pytest.mark.parametrize("rpn,rule,bound", [
    (4, "int8", 0.05),
    (2, {"intra": "int8:hadamard=128", "inter": "int4:hadamard=128"}, 0.3),  # fused
    pytest.param(2, {"intra": "none", "inter": EF_INT2}, 1.0, marks=pytest.mark.slow),
    pytest.param(4, "topk:ratio=0.1", 1.0, marks=pytest.mark.slow),  # variable-size rows
    pytest.param(4, "none", 0.0, marks=pytest.mark.slow),
])
def test_reduce_scatter_of_uneven_parts_sums_each_ranks_part_and_plays_bit_for_bit(
        rpn, rule, bound):
    """Parts of any length — empty, shorter than a quantization group, unaligned — reach
    only their rank, summed within the codec's error (exactly for ``none``), equal when
    played; ranks whose lengths differ are told so."""
    world, calls, sizes = 4, 2, [300, 0, 7, 130]
    real = spawn(workers.real_reduce_scatter_parts, world, (rule, sizes, calls, rpn),
                 ranks_per_node=rpn)
    played = workers.played_reduce_scatter_parts(world, rule, sizes, calls, rpn)
    offsets = [sum(sizes[:r]) for r in range(world)]
    for c in range(calls):
        inputs = [workers.played_inputs(r, sum(sizes), torch.float32, calls)[c]
                  for r in range(world)]
        for r, (results, mismatch) in enumerate(real):
            assert results[c] == played[c][r]
            exact = inputs[0][offsets[r]:offsets[r] + sizes[r]].clone()
            for x in inputs[1:]:
                exact += x[offsets[r]:offsets[r] + sizes[r]]
            got = torch.tensor(results[c])
            assert got.shape == exact.shape
            if rule == "none":
                assert torch.equal(got, exact)
            elif c == 0:  # later calls carry error-feedback memory
                assert (got - exact).norm() <= bound * exact.norm(), (r, rule)
            assert "sizes differs" in mismatch
