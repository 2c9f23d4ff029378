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


def test_diloco_is_played_with_a_weight_set_per_site():
    import torch

    from commpress.train.ddp_engine import PlayedSites
    from commpress.train.run import Run

    cfg = TrainConfig(**BASE, dp=4, engine="ddp", ddp_hook="commpress", ranks_per_node=2,
                      outer="diloco-int2ef", sync_every=2).resolved()
    run = Run(cfg, played=True)
    sites = run.opts[0]
    assert isinstance(sites, PlayedSites) and (sites.count, sites.per_site) == (2, 2)
    assert [sites.site_of(r) for r in run.held.dp_ranks] == [0, 0, 1, 1]
    run.train_step(0)  # the sites part ways between syncs (their own batches) ...
    first = [p.detach().clone() for p in run.stage.parameters()]
    with run.held.rank_codecs(2, run.stages):
        second = [p.detach().clone() for p in run.stage.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(first, second))
    # ... and the module holds site 0's weights again outside a played rank's block
    assert all(torch.equal(a, p) for a, p in zip(first, run.stage.parameters()))
    run.train_step(1)  # a sync: every site restarts from θ_global (alpha 0)
    first = [p.detach().clone() for p in run.stage.parameters()]
    with run.held.rank_codecs(3, run.stages):
        assert all(torch.equal(a, p) for a, p in zip(first, run.stage.parameters()))
