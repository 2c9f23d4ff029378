"""The checks every saved state goes through before anything is restored."""

import pytest
import torch
import torch.nn as nn

import commpress
from commpress.validate import InputError, check_saved_state

MINE = {"policy": {"name": "sdp4bit"}, "world_size": 4, "layout": [["a", "b"], ["c"]]}


def _saved(**changes):
    return {"format": "kind/1", **MINE, **changes}


def test_a_matching_state_passes():
    check_saved_state(_saved(), "kind/1", "kind", MINE, "resume alike")


@pytest.mark.parametrize("state", [None, [], {"format": "kind/2", **MINE}, dict(MINE)])
def test_another_kind_of_state_is_refused_naming_the_format(state):
    with pytest.raises(InputError, match=r"not a kind state \(expected format 'kind/1'"):
        check_saved_state(state, "kind/1", "kind", MINE, "resume alike")


def test_a_known_other_format_is_named_with_how_to_load_it():
    formats = {"kind-whole/1": "a whole state: load it with elastic=True"}
    with pytest.raises(InputError, match=r"not a kind state: its format 'kind-whole/1' is a "
                                         r"whole state: load it with elastic=True"):
        check_saved_state(_saved(format="kind-whole/1"), "kind/1", "kind", MINE, "x", None,
                          formats)


def test_a_differing_dict_is_named_by_its_first_differing_key():
    mine = {**MINE, "config": {"sync_every": 8, "fragments": 2}}
    saved = _saved(config={"sync_every": 4, "fragments": 2})
    with pytest.raises(InputError, match=r"kind checkpoint config.sync_every 4 does not match "
                                         r"this run's 8; resume alike"):
        check_saved_state(saved, "kind/1", "kind", mine, "resume alike")


def test_the_first_differing_field_is_named_with_both_values_and_the_advice():
    with pytest.raises(InputError, match=r"kind checkpoint world_size 2 does not match this "
                                         r"run's 4; resume alike"):
        check_saved_state(_saved(world_size=2), "kind/1", "kind", MINE, "resume alike")


def test_a_missing_field_is_named_not_a_key_error():
    state = _saved()
    del state["layout"]
    with pytest.raises(InputError, match="kind checkpoint has no 'layout'; resume alike"):
        check_saved_state(state, "kind/1", "kind", MINE, "resume alike")


def test_a_long_value_is_cut_in_the_message():
    names = [[f"blocks.{i}.weight" for i in range(5000)]]
    with pytest.raises(InputError) as e:
        check_saved_state(_saved(layout=names), "kind/1", "kind", MINE, "resume alike")
    assert len(str(e.value)) < 1000 and "characters)" in str(e.value)


def test_a_view_reads_the_saved_field_before_comparing():
    check_saved_state(_saved(codecs=[{}, {}]), "kind/1", "kind", {"codecs": 2}, "alike",
                      views={"codecs": len})
    with pytest.raises(InputError, match="codecs 3 does not match this run's 2"):
        check_saved_state(_saved(codecs=[{}] * 3), "kind/1", "kind", {"codecs": 2}, "alike",
                          views={"codecs": len})


def _optimizer(width: int) -> commpress.ShardedOptimizer:
    torch.manual_seed(0)
    return commpress.ShardedOptimizer(nn.Sequential(nn.Linear(width, 8), nn.Linear(8, 2)),
                                      torch.optim.AdamW, "none", lr=1e-3)


def test_an_optimizer_state_with_a_field_removed_is_refused_and_nothing_is_restored():
    saved = _optimizer(4).state_dict()
    del saved["bucket_names"]
    opt = _optimizer(4)
    before = [b.master.detach().clone() for b in opt.buckets]
    with pytest.raises(InputError, match="has no 'bucket_names'"):
        opt.load_state_dict(saved)
    assert all(torch.equal(a, b.master) for a, b in zip(before, opt.buckets))


def test_an_optimizer_state_of_another_model_is_refused_naming_the_layout():
    with pytest.raises(InputError, match="ShardedOptimizer checkpoint bucket_numels"):
        _optimizer(4).load_state_dict(_optimizer(6).state_dict())


@pytest.mark.parametrize("key", ["master", "params"])
@pytest.mark.parametrize("change", ["fewer", "shape"])
def test_optimizer_tensors_of_another_count_or_shape_are_refused_before_any_is_written(
        key, change):
    saved = _optimizer(4).state_dict()
    saved[key] = saved[key][:-1] if change == "fewer" else [t[:-1] for t in saved[key]]
    opt = _optimizer(4)
    opt.buckets[0].master.data.fill_(7.0)
    with pytest.raises(InputError, match=rf"optimizer checkpoint {key}: not \d+ tensors"):
        opt.load_state_dict(saved)
    assert bool((opt.buckets[0].master == 7.0).all())
