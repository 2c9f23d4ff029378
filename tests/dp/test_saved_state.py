"""The envelope every holder of codec state saves, and the one check on resume."""

import logging

import pytest

from commpress import InputError, Policy
from commpress.dp.saved_state import check_resume, envelope

INT2EF = Policy.resolve("int2ef")
ADVICE = "resume with the same things"


def _check(state, rank=1, world=4, elastic=False, policy=INT2EF, layout=(3, 5)):
    return check_resume(state, "test/1", "test holder", policy, rank, world, elastic, ADVICE,
                        {"layout": list(layout)})


def _saved(**changes):
    fields = {"rank": 1, "world_size": 4, "layout": [3, 5], **changes}
    return envelope("test/1", INT2EF, fields.pop("rank"), fields.pop("world_size"), **fields)


def test_a_state_of_this_rank_and_world_keeps_its_memory():
    state = _saved(codecs=[1, 2])
    assert state["format"] == "test/1" and state["policy"] == INT2EF.to_dict()
    assert state["rank"] == 1 and state["world_size"] == 4 and state["codecs"] == [1, 2]
    assert _check(state) is True
    assert _check(state, elastic=True) is True  # elastic, but nothing changed


@pytest.mark.parametrize("state, needle", [
    ({"format": "other/1"}, "not a test holder state (expected format 'test/1'; found "
                               "'other/1')"),
    ([], "not a test holder state"),
    (_saved(world_size=2), "test holder checkpoint world_size 2 does not match this run's 4"),
    (_saved(rank=0), "test holder checkpoint rank 0 does not match this run's 1"),
    (_saved(rank=0, world_size=2), "checkpoint world_size 2 does not match"),
    (_saved(layout=[3, 6]), "checkpoint layout [3, 6] does not match this run's [3, 5]"),
    ({**_saved(), "policy": Policy.resolve("sdp4bit").to_dict()},
     "test holder checkpoint policy.name 'sdp4bit' does not match this run's 'int2ef'"),
    ({k: v for k, v in _saved().items() if k != "layout"}, "checkpoint has no 'layout'"),
])
def test_another_rank_world_policy_or_field_is_refused_naming_it(state, needle):
    with pytest.raises(InputError) as e:
        _check(state)
    assert needle in str(e.value) and (ADVICE in str(e.value) or "format" in str(e.value))


def test_an_elastic_resume_from_another_rank_or_world_starts_the_memory_fresh(caplog):
    caplog.set_level(logging.WARNING, "commpress")
    # another world: rank 0 says it once per (what, worlds); the other ranks say nothing
    assert _check(_saved(world_size=2), rank=0, elastic=True) is False
    assert _check(_saved(world_size=2), rank=0, elastic=True) is False
    assert _check(_saved(world_size=2), rank=1, elastic=True) is False
    # the same world, another rank's state: the rank that took it says so, once
    assert _check(_saved(rank=0), rank=1, elastic=True) is False
    assert _check(_saved(rank=0), rank=1, elastic=True) is False
    said = [r.getMessage() for r in caplog.records]
    tail = "error-feedback memory and rounding streams start fresh (they were laid out for the"
    assert said == [f"test holder: resuming state saved on 2 ranks on 4: {tail} world that "
                    "saved them)", f"test holder: resuming state of rank 0 on rank 1 "
                    f"(elastic): {tail} rank that saved them)"]
    # the policy and the holder's fields still must match
    with pytest.raises(InputError, match="layout"):
        _check(_saved(world_size=2, layout=[1]), rank=0, elastic=True)
    with pytest.raises(InputError, match="policy"):
        _check(_saved(world_size=2), rank=0, elastic=True, policy=Policy.resolve("none"))


def test_a_malformed_state_is_refused_by_name_not_raised_raw():
    # a resume check that trips over a malformed state (a missing key) on one rank must
    # still reach the agreement; without a group the refusal is raised here
    from commpress.dp.saved_state import on_every_rank

    with pytest.raises(InputError, match=r"test holder: the saved state is malformed "
                                         r"\(KeyError: 'global'\)"):
        on_every_rank(None, "test holder", lambda: {}["global"])
    assert on_every_rank(None, "test holder", lambda: 7) == 7
