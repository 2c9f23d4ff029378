"""What a process holds: a played replica holds every data-parallel rank and stage of its
slice and refuses what it cannot play; the real rank is covered by every training test."""

import pytest

from commpress.train.config import TrainConfig
from commpress.train.holding import PlayedReplica, hold
from commpress.validate import InputError

BASE = dict(model="gpt-tiny", batch_size=8, seq_len=32, max_data_bytes=200_000,
            progress=False)


def test_a_played_replica_holds_every_rank_and_stage_of_its_slice():
    cfg = TrainConfig(**BASE, dp=4, pp=2).resolved()
    held = hold(cfg, played=True, tp_group=None, dp_per_node=2)
    assert isinstance(held, PlayedReplica) and held.mode == "simulate"
    assert held.dp_ranks == [0, 1, 2, 3] and held.stage_indices == [0, 1]
    assert (held.rank, held.world, held.dp_group) == (0, 1, None)
    assert held.identity() == {"simulate": True}
    assert held.layout([1, 2]) == [1, 2] and held.unlayout([1, 2]) == [1, 2]


def test_a_played_replica_without_a_group_of_its_slices_is_refused():
    cfg = TrainConfig(**BASE, dp=2, tp=2).resolved()
    with pytest.raises(InputError, match="tp=2 needs a process group of 2 ranks"):
        hold(cfg, played=True, tp_group=None, dp_per_node=1)


def test_diloco_is_not_played():
    cfg = TrainConfig(**BASE, dp=2, engine="ddp", ddp_hook="commpress", ranks_per_node=1,
                      outer="diloco-int2ef").resolved()
    with pytest.raises(InputError, match="outer='diloco-int2ef': simulate does not play"):
        hold(cfg, played=True, tp_group=None, dp_per_node=1)
