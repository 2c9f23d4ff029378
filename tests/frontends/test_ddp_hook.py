"""The DDP comm hook next to DDP's own collectives, on real Gloo ranks.

DDP all-reduces its unused-parameter map, broadcasts buffers and rebuilds buckets on
its own group while the hook reduces on its communication thread; these runs make it do
so (``find_unused_parameters=True`` with ranks that leave out a block, ``no_sync``, a
static graph) and compare with DDP's own all-reduce: codec ``none`` bit for bit, every
codec with replicas bitwise identical after every step.
"""

import pytest
import torch
import torch.nn as nn

import commpress
from commpress.frontends.ddp import grad_policy
from commpress.launch import spawn
from tests.dp import guard_workers
from tests.frontends import ddp_workers

STEPS = 6
# a hang would show as the group's timeout (with the rank named), not a stuck test
PG_TIMEOUT_S = 30.0


def _run(policy, world=2, ranks_per_node=None, **options):
    return spawn(ddp_workers.ddp_run, world, (policy, STEPS, options),
                 ranks_per_node=ranks_per_node, pg_timeout_s=PG_TIMEOUT_S, timeout=300)


def _assert_replicas_identical(ranks, groups=None):
    for ranks_of_group in groups or [list(range(len(ranks)))]:
        for step in range(STEPS):
            assert len({ranks[r]["hashes"][step] for r in ranks_of_group}) == 1, step


UNUSED_AND_SKIPPING = {"find_unused": True, "schedule": "varying"}


@pytest.mark.slow
def test_exact_codec_with_a_rank_skipping_a_block_is_plain_ddp():
    plain = _run(None, **UNUSED_AND_SKIPPING)
    hooked = _run("none", **UNUSED_AND_SKIPPING)
    # bit for bit: a division by a power of two commutes with the sum
    assert [r["hashes"] for r in hooked] == [r["hashes"] for r in plain]
    _assert_replicas_identical(hooked)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    pytest.param({**UNUSED_AND_SKIPPING, "micro": 2}, id="no_sync"),
    pytest.param({"static_graph": True, "schedule": "fixed"}, id="static_graph"),
    pytest.param({**UNUSED_AND_SKIPPING, "overlap": False}, id="in_order"),
])
def test_exact_codec_is_plain_ddp(options):
    plain = _run(None, **options)
    hooked = _run("none", **options)
    assert [r["hashes"] for r in hooked] == [r["hashes"] for r in plain]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["int2ef", "sdp4bit"])
def test_compressed_hook_with_a_rank_skipping_a_block_keeps_replicas_identical(policy):
    # one rank per node: the cross-node (compressed) level of both presets runs
    piped = _run(policy, ranks_per_node=1, **UNUSED_AND_SKIPPING)
    in_order = _run(policy, ranks_per_node=1, overlap=False, **UNUSED_AND_SKIPPING)
    _assert_replicas_identical(piped)
    # the communication thread changes when buckets are reduced, never the values
    assert [r["hashes"] for r in piped] == [r["hashes"] for r in in_order]


@pytest.mark.slow
def test_hook_reduces_over_the_ddp_modules_process_group():
    groups = [[0, 2], [1, 3]]
    ranks = _run("int2ef", world=4, ranks_per_node=1, dp_groups=groups,
                 **UNUSED_AND_SKIPPING)
    _assert_replicas_identical(ranks, groups)
    # the groups draw different batches: had the hook averaged over all four ranks,
    # every replica would be the same
    assert ranks[0]["hashes"][-1] != ranks[1]["hashes"][-1]


def test_a_mismatch_inside_the_hook_raises_the_mismatch_on_every_rank():
    ranks = spawn(ddp_workers.hook_error, 2, ("policies",), pg_timeout_s=PG_TIMEOUT_S)
    for r in ranks:
        assert "CollectiveMismatchError" in r["error"] and "ranks disagree" in r["error"]
        assert "Unable to cast" not in r["error"]


@pytest.mark.slow
def test_a_rank_late_past_the_ddp_groups_timeout_is_named():
    # the hook's group keeps the DDP group's 4 s timeout (not torch's 30 min default)
    ranks = spawn(ddp_workers.hook_error, 2, ("late",), pg_timeout_s=4.0, timeout=120)
    error = ranks[0]["error"]
    assert "CollectiveTimeoutError" in error and "ranks [1] never reached it" in error, error
    assert "Unable to cast" not in error


def test_a_codec_spec_is_the_policy_of_every_bucket():
    policy = grad_policy("int4:hadamard=128")
    assert policy.rule("dp", "grad").codec == "int4:hadamard=128"
    assert not policy.two_level()
    assert grad_policy("int2ef").two_level()  # a preset name stays the preset


@pytest.mark.parametrize("spec, message", [
    ("int4:hadamard=127", r"policy='int4:hadamard=127'.*hadamard=127 is not allowed; "
                          r"allowed: 0 \(off\) or a power of two"),
    ("int9", r"policy='int9' is neither a policy preset \(allowed: none, .*unknown codec "
             r"'int9'; allowed: .*int4"),
])
def test_a_bad_codec_spec_is_refused_naming_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        commpress.ddp_hook(nn.Linear(2, 2), spec)


@pytest.mark.parametrize("field, value, allowed", [
    ("overlap", "no", "allowed: True or False"),  # a non-empty string is truthy: mode on
    ("overlap", 1, "allowed: True or False"),
    ("bucket_numel", 0, "allowed: an integer >= 1"),
    ("bucket_numel", 1.5, "allowed: an integer >= 1"),
])
def test_bad_options_are_refused_naming_the_field_and_value(field, value, allowed):
    with pytest.raises(commpress.InputError) as info:
        commpress.ddp_hook(nn.Linear(2, 2), "int2ef", **{field: value})
    message = str(info.value)
    assert f"ddp_hook: {field}" in message and repr(value) in message, message
    assert allowed in message, message


@pytest.mark.slow
def test_a_codec_spec_trains_as_its_one_codec_policy():
    spec = "int4:hadamard=128"
    by_spec = _run(spec, ranks_per_node=1)
    by_dict = _run({"name": spec, "dp": {"grad": spec}}, ranks_per_node=1)
    assert [r["hashes"] for r in by_spec] == [r["hashes"] for r in by_dict]
    _assert_replicas_identical(by_spec)


@pytest.mark.slow  # waits out the 4 s timeout and the 5 s diagnosis grace
def test_a_rank_skipping_a_block_without_find_unused_parameters_fails_on_every_rank():
    ranks = spawn(ddp_workers.hook_error, 2, ("unused",), pg_timeout_s=4.0, timeout=120)
    # DDP refuses the next step on the rank whose reduction never finished; the other
    # rank's hook names it instead of waiting for it
    assert "Expected to have finished reduction" in ranks[1]["error"], ranks[1]["error"]
    assert "CollectiveTimeoutError" in ranks[0]["error"], ranks[0]["error"]


def test_the_played_hook_takes_a_codec_spec_like_the_hook():
    from commpress.frontends.played.ddp import PlayedDDPHook

    played = PlayedDDPHook(nn.Linear(4, 4), "int4:hadamard=128", ranks=2, ranks_per_node=1)
    assert played.policy == grad_policy("int4:hadamard=128")
    with pytest.raises(ValueError, match="policy='int9' is neither a policy preset"):
        PlayedDDPHook(nn.Linear(4, 4), "int9", ranks=2, ranks_per_node=1)


@pytest.mark.parametrize("other, field", [
    (dict(ranks=4, ranks_per_node=2), "ranks"),
    (dict(ranks=2, ranks_per_node=2), "ranks_per_node"),
    (dict(ranks=2, ranks_per_node=1, policy="sdp4bit"), "policy"),
    (dict(ranks=2, ranks_per_node=1, bucket_numel=8), "layout"),
])
def test_the_played_hooks_state_of_another_run_is_refused_naming_the_field(other, field):
    from commpress.frontends.played.ddp import PlayedDDPHook

    def played(ranks, ranks_per_node, policy="int2ef", bucket_numel=1000):
        torch.manual_seed(0)
        return PlayedDDPHook(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), policy,
                             ranks=ranks, ranks_per_node=ranks_per_node,
                             bucket_numel=bucket_numel)

    saved = played(2, 1).state_dict()
    played(2, 1).load_state_dict(saved)  # the same run's state loads
    with pytest.raises(commpress.InputError, match=f"PlayedDDPHook checkpoint {field}[ .]"):
        played(**other).load_state_dict(saved)
    with pytest.raises(commpress.InputError, match="not a PlayedDDPHook state"):
        played(2, 1).load_state_dict({"ranks": 2, "codecs": saved["codecs"]})


def test_a_parameter_ddp_ignores_is_left_to_ddp_not_waited_for():
    """DDP never hands a hook a parameter it was told to ignore: a hook bucket holding one
    never completed, and backward hung past the group's timeout. The hooks leave it out:
    with codec ``none`` the run is plain DDP's bit for bit (the ignored parameter keeps
    its local gradient in both), compressed the reduced parameters stay identical."""
    hooks = [None, "none", "int2ef", "lowrank"]
    ranks = spawn(ddp_workers.ignored_parameter_runs, 2, (hooks,), ranks_per_node=1,
                  pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for r in ranks:
        assert r["none"]["every"] == r["None"]["every"]
    for hook in ("int2ef", "lowrank"):
        assert ranks[0][hook]["reduced"] == ranks[1][hook]["reduced"], hook
    assert ranks[0]["None"]["every"] != ranks[1]["None"]["every"]  # the ignored one is local


def test_a_policy_that_compresses_nothing_on_this_topology_is_said_once_on_rank_0():
    """``int2ef`` is exact inside a node: under ``torchrun --standalone`` (one node) it
    sends DDP's own bytes, and a user saw no gain and no reason."""
    ranks = spawn(ddp_workers.uncompressed_warnings, 2, ranks_per_node=2,
                  pg_timeout_s=PG_TIMEOUT_S, timeout=120)
    message = ranks[0]["messages"]
    assert ranks[0]["after_each"] == [1, 1, 1] and ranks[1]["messages"] == []
    assert "policy 'int2ef' compresses nothing here" in message[0]
    assert "2 ranks in 1 node(s) of 2 have no inter-node link" in message[0]
    assert "'int4:hadamard=128'" in message[0]


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [(4, 2), (2, 4)])
def test_an_elastic_resume_on_another_number_of_ranks_starts_the_memory_fresh(tmp_path,
                                                                               saved, resumed):
    """DDP hook (int2ef), low-rank hook and DiLoCo: a state of another world is refused
    unless the user asks for an elastic resume; then what every rank holds alike is kept,
    the memory starts fresh, rank 0 says so once, and the replicas stay identical."""
    spawn(ddp_workers.elastic, saved, (str(tmp_path), "save"), ranks_per_node=1,
          pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    ranks = spawn(ddp_workers.elastic, resumed, (str(tmp_path), "load"), ranks_per_node=1,
                  pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for front in ("int2ef", "lowrank", "diloco"):
        for r in ranks:
            refused = r[f"{front} strict"]
            assert "checkpoint rank" in refused or "checkpoint world_size" in refused
            assert "elastic=True" in refused
            # DiLoCo's sites hold the same weights after a sync (step 4), the hooks' always
            assert r[front][-1:] == ranks[0][front][-1:], front
            assert front == "diloco" or r[front] == ranks[0][front], front
    # the elastic load's fresh memory is no memory at all: the same bits as the hook
    # started from the saved weights without any codec state
    assert all(r["int2ef"] == r["int2ef fresh"] for r in ranks)
    assert all("DDP hook checkpoint lowrank.rank 3 does not match" in r["lowrank other config"]
               for r in ranks)
    said = ranks[0]["logged"]
    # once per kind of state (the two hooks' states are the DDP hook's), on rank 0 only
    assert [m.split(":")[0] for m in said] == ["DDP hook", "DiLoCo"]
    assert all(f"saved on {saved} ranks on {resumed}" in m for m in said)
    assert all(r["logged"] == [] for r in ranks[1:])


@pytest.mark.parametrize("lowrank", [False, True])
def test_a_backward_after_remove_is_refused_by_name(lowrank):
    for r in spawn(ddp_workers.backward_after_remove, 2, (lowrank,)):
        assert r["error"] is not None and "the hook was removed (remove())" in r["error"], r
        assert r["saved"], r


@pytest.mark.parametrize("options", [{}, UNUSED_AND_SKIPPING])
def test_after_the_first_step_one_hook_bucket_a_step_carries_a_header(options):
    # the other hook buckets replay what every rank agreed before. DDP rebuilds its
    # buckets after the first step, so the hook buckets' order changes on every rank
    # alike: agreed again, with headers, then replayed. Where ranks leave blocks out of
    # the graph in turn, every bucket still completes in its order
    ranks = _run("int8", **options)
    r = ranks[0]
    assert r["buckets"] >= 3, r
    assert r["headers"][0] == r["buckets"] and r["headers"][3:] == [1] * (STEPS - 3), r
    _assert_replicas_identical(ranks)


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_guarded_hook_promotes_on_every_rank_alike_and_resumes_the_same(overlap):
    """int2 without Hadamard, guarded at 0.3 over 2 samples: the hook's buckets are
    promoted after the second iteration on both ranks (the decision taken where the hook
    issues its calls, the communication thread with overlap), replicas stay bitwise
    identical, and a run resumed at step 4 from the hook's state decides the same."""
    naive = {"name": "naive-int2", "dp": {"grad": "int2:hadamard=0"}}
    guard = {"max_rel_error": 0.3, "window": 2, "every": 4}
    a, b = spawn(guard_workers.hooked, 2, (naive, guard, 7, None, overlap), timeout=300)
    assert a["hashes"] == b["hashes"] and a["events"] == b["events"]
    assert a["events"] and {e["step"] for e in a["events"]} == {1}, a["sampled"]
    assert all("int4" in e["to"] for e in a["events"])
    assert a["codecs"][0] != a["codecs"][1]  # in use from the next backward
    assert len(a["said"]) == len(a["events"]) and not b["said"]  # logged once, by rank 0
    # dense sampling after a promotion (steps 2, 3), then every 4 (step 4; not 5, 6)
    assert [r is not None for r in a["sampled"]] == [True] * 5 + [False] * 2
    assert all(e < 0.3 for e in a["sampled"][4]["rel_error"])  # int4 is under budget
    resumed = spawn(guard_workers.hooked, 2, (naive, guard, 7, 4, overlap), timeout=300)
    assert resumed[0]["hashes"] == a["hashes"] and resumed[0]["events"] == a["events"]


@pytest.mark.slow
def test_hooks_with_different_guards_are_refused_on_every_rank():
    said = spawn(guard_workers.hooked_with_differing_guards, 2, (), timeout=120)
    assert all(s is not None and "guard" in s for s in said), said


@pytest.mark.slow
def test_a_corrupt_guard_state_on_one_rank_is_refused_on_every_rank():
    """Were it refused by rank 1 alone, rank 0 would go on and wait for it in its next
    backward; checked inside the agreed resume check, both ranks raise, naming rank 1."""
    said = spawn(guard_workers.hooked_with_a_corrupt_guard_state, 2, (), timeout=120)
    assert all(s is not None and "guard state" in s for s in said), said
    assert "rank 1" in said[0], said[0]
