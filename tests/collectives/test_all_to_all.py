"""commpress.all_to_all: uneven splits, rows encoded on their own, torch's own call with
``none``, one set of steps for real and played ranks, and every disagreement named on
every rank."""

import pytest
import torch

from commpress.launch import spawn
from tests.collectives import all_to_all_workers as workers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uneven_rows_through_every_codec(dtype):
    # width 100: not a multiple of any codec's group, so every row is padded on its own
    for r in spawn(workers.exchange, 3, (100, dtype)):
        flags = {k: v for k, v in r.items() if not k.endswith("_error")}
        assert all(flags.values()), [k for k, ok in flags.items() if not ok]
        assert r["fp8_error"] < 0.08 and r["int8_error"] < 0.02, r
        assert r["int4:hadamard=128_error"] < 0.15, r


def test_a_rank_with_no_tokens_takes_part():
    ranks = spawn(workers.no_rows, 3)
    assert set(ranks[0].values()) == {(0, 40)} and set(ranks[1].values()) == {(6, 40)}, ranks


def test_splits_may_be_numpy_arrays():
    assert spawn(workers.bad_splits, 2, ("numpy",)) == [None, None]


def test_non_finite_tokens_stay_non_finite():
    # every rank's rows 0 and 1 (a NaN and an Inf) go to rank 0; rows 2 and 3 to rank 1
    ranks = spawn(workers.non_finite, 2)
    assert ranks[0]["rows_finite"] == [False] * 4 and ranks[1]["rows_finite"] == [True] * 4


@pytest.mark.parametrize("case,expected", [
    ("disagree", r"CollectiveMismatchError: .*rank 0 sends 3 rows to rank 0, which expects 2"),
    ("sum", r"input_split_sizes=\[2, 1\] sums to 3; allowed: splits summing to the tensor's "
            r"4 rows"),
    ("int", r"input must be a floating-point tensor; got dtype torch.int64"),
    ("codec", r"codec differs"),
    ("spec", r"unknown codec 'int9'"),
])
def test_what_ranks_get_wrong_is_named_on_every_rank(case, expected):
    import re
    errors = spawn(workers.bad_splits, 2, (case,), pg_timeout_s=20)
    for e in errors:
        assert e is not None and re.search(expected, e), errors


def test_two_levels_send_each_link_its_codec():
    for r in spawn(workers.two_levels, 4, (200,), ranks_per_node=2):
        assert r["rows"], r
        assert r["intra"]["wire_bytes"] == r["intra"]["raw_bytes"], r  # exact in the node
        assert r["inter"]["wire_bytes"] < 0.4 * r["inter"]["raw_bytes"], r  # int8 across
