"""commpress inside torchft: torchft's own DiLoCo, Manager and lighthouse (started here, in
this process), two replica groups as two processes on Gloo, the Manager's process group
compressed by commpress — healthy, with a replica killed inside a compressed all-reduce
and a new one joining, and with replicas on different policies."""

import math
import multiprocessing
import queue
import time

import pytest
import torch
import torch.distributed as dist
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo

import commpress
from commpress.validate import InputError
from tests.engines import torchft_workers as workers

pytestmark = pytest.mark.engine
SYNCS = 3
WAIT_S = 240  # for each replica's record; a hang fails here, not at CI's limit


def run(policies, syncs=SYNCS, die=None, restart=False, failing=False):
    """Replica ``i`` trains with ``policies[i]``; ``die=(i, k)``: replica ``i`` dies inside
    an all-reduce of its k-th sync and, with ``restart``, a new replica ``i`` joins.
    ``failing``: a replica's training may raise (its record holds the traceback)."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = {}

    def start(i, die_in_sync=None):
        procs[i] = ctx.Process(target=workers.replica, args=(
            i, lighthouse.address(), policies[i], syncs, results, die_in_sync))
        procs[i].start()

    try:
        for i in range(len(policies)):
            start(i, die[1] if die and die[0] == i else None)
        if die:
            procs[die[0]].join(WAIT_S)
            exitcode = procs[die[0]].exitcode
            assert exitcode == 3, f"the replica meant to die exited with {exitcode}"
            if restart:
                start(die[0])
        records = {}
        deadline = time.monotonic() + WAIT_S
        while len(records) < len(procs):
            try:
                i, record = results.get(timeout=1)
            except queue.Empty:
                dead = [i for i, p in procs.items() if p.exitcode not in (None, 0)]
                assert not dead, f"replica {dead[0]} exited with {procs[dead[0]].exitcode}"
                assert time.monotonic() < deadline, f"no result within {WAIT_S} s (a hang)"
                continue
            assert failing or "exception" not in record, record["exception"]
            records[i] = record
        return joined(procs, records)
    finally:
        stop(procs, lighthouse)


def joined(procs, records):
    """``records``, once every replica process has ended (or 30 s each)."""
    for p in procs.values():
        p.join(30)
    return records


def stop(procs, lighthouse):
    """Kill the replica processes still alive, then the lighthouse."""
    for p in procs.values():
        if p.is_alive():
            p.kill()
    lighthouse.shutdown()


def same_commits(a, b):
    """Steps both replicas committed (step 0 is before any sync) and whether their weights
    after each were the same bits."""
    steps = sorted(set(a["committed"]) & set(b["committed"]) - {0})
    return steps, all(a["committed"][s] == b["committed"][s] for s in steps)


@pytest.fixture(scope="module")
def healthy():
    return {"exact": run([None, None]), "int4": run(["diloco-int4"] * 2)}


def test_int4_pseudo_gradients_keep_replicas_identical_at_an_eighth_of_the_bytes(healthy):
    for name, records in healthy.items():
        steps, identical = same_commits(records[0], records[1])
        assert steps == list(range(1, SYNCS + 1)), (name, steps)
        assert identical, name
        assert records[0]["errors"] == [] and records[1]["errors"] == []
    stats = healthy["int4"][0]["stats"]["outer.grad"]
    assert 8 * stats["wire_bytes"] / stats["elements"] < 4.3  # int4 + scales: 4.25, vs 32
    assert "outer.grad" not in healthy["exact"][0]["stats"]
    # compressed pseudo-gradients move the weights (not an exact copy) and train as well
    assert healthy["int4"][0]["committed"][SYNCS] != healthy["exact"][0]["committed"][SYNCS]
    exact, int4 = healthy["exact"][0]["losses"], healthy["int4"][0]["losses"]
    assert abs(sum(int4[-H:]) - sum(exact[-H:])) / sum(exact[-H:]) < 0.05


H = workers.H


def test_a_replica_killed_inside_a_compressed_all_reduce_rejoins_identical():
    # replica 1 dies in its 2nd sync's all-reduces; replica 0 waits there, times out with
    # the call named, commits nothing, and a new replica 1 heals from it
    records = run(["diloco-int4"] * 2, die=(1, 2), restart=True)
    survivor, newcomer = records[0], records[1]
    assert survivor["step"] == newcomer["step"] == SYNCS
    # the survivor committed sync 1 before the death; the newcomer got it from the survivor
    assert 1 in survivor["committed"] and min(set(newcomer["committed"]) - {0}) > 1
    assert any("CollectiveTimeoutError" in e or "Connection" in e for e in survivor["errors"]), \
        survivor["errors"]
    # a torchft process has no default store: the diagnosis says so, not that it is gone
    timeouts = [e for e in survivor["errors"] if "CollectiveTimeoutError" in e]
    assert all("no torch.distributed default store" in e for e in timeouts), timeouts
    steps, identical = same_commits(survivor, newcomer)
    assert steps and identical, steps


def test_replicas_on_different_policies_stop_their_loops_naming_why():
    records = run(["diloco-int4", "diloco-int8"], syncs=1, failing=True)
    for record in records.values():  # not retried forever: raised from should_commit
        assert "CollectiveMismatchError" in record["exception"], record
        assert "replicas disagree on the policy" in record["exception"], record


def pair(policies, quorums=1):
    """Two replicas on bare quorums (:func:`workers.pg_pair`): what each reported."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=workers.pg_pair, args=(r, store.port, policies[r], results,
                                                       quorums)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=WAIT_S) for _ in procs)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def test_a_0d_loss_and_every_float_dtype_reduce_like_torchft_own():
    ours, theirs = pair(["diloco-int4"] * 2), pair([None, None])
    for rank in range(2):
        assert "values" in ours[rank], ours[rank]
        # exact on these values (1 and 2 reduce to 3 and 1.5 in every codec here)
        assert ours[rank]["values"] == theirs[rank]["values"], (ours[rank], theirs[rank])


def test_replicas_on_another_policy_are_raised_into_the_loop_at_once():
    # torchft retries a failed step forever; this error reaches should_commit instead
    records = pair(["diloco-int4", "diloco-int8"], quorums=3)
    for rank in range(2):
        refused = records[rank]["refused"]
        assert len(refused) == 1, refused  # the first quorum: no retry can mend it
        assert f"replicas disagree on the policy: rank {rank} has " in refused[0]["configure"]
        assert refused[0]["errored"] == refused[0]["configure"]


def test_a_replica_without_commpress_is_raised_after_a_few_quorums_not_at_the_first():
    # the compressed replica cannot tell a peer without commpress from one that died as the
    # quorum formed: a retryable error, until the same happens in SILENT_QUORUMS quorums
    records = pair(["diloco-int4", None], quorums=commpress.torchft.SILENT_QUORUMS)
    refused = records[0]["refused"]
    assert len(refused) == commpress.torchft.SILENT_QUORUMS
    assert all("replica ranks [1] of this quorum announced no commpress policy" in r["configure"]
               for r in refused)
    assert [r["errored"] is None for r in refused] == [True, True, False]
    assert "in 3 quorums in a row" in refused[-1]["errored"]


@pytest.mark.parametrize("policy", ["diloco-int2ef", "diloco-sparse"])
def test_policies_with_memory_are_refused_naming_why(policy):
    with pytest.raises(InputError, match="error feedback"):
        commpress.torchft.compress(ProcessGroupGloo(), policy)


def test_only_in_process_groups_are_taken():
    with pytest.raises(InputError, match="pg=str is not allowed"):
        commpress.torchft.compress("gloo", "diloco-int4")
    import commpress.torchft as by_import  # the name users import

    assert by_import is commpress.torchft


def test_the_handle_saves_its_policy_refuses_anothers_and_stops_with_remove():
    comp = commpress.torchft.compress(ProcessGroupGloo(), "diloco-int4")
    other = commpress.torchft.compress(ProcessGroupGloo(), "diloco-int8")
    comp.load_state_dict(comp.state_dict())  # its own: taken
    with pytest.raises(InputError, match="of policy 'diloco-int8'.*compresses with 'diloco-int4'"):
        comp.load_state_dict(other.state_dict())
    with pytest.raises(InputError, match="format None is not allowed"):
        comp.load_state_dict({"policy": comp.state_dict()["policy"]})
    comp.remove()
    with pytest.raises(RuntimeError, match="compression was removed"):
        comp.process_group.allreduce([torch.ones(2)], dist.ReduceOp.SUM)


def run_ef(policy, syncs=6, kill_at=2, fragments=1, replicas=2, restart=True,
           init_sync=True):
    """``replicas`` replica groups on :class:`commpress.torchft.DiLoCo` with ``policy``;
    the last is killed (SIGKILL, by its process id) inside sync ``kill_at + 1`` — the
    quorum formed, the others waiting in the all-reduce — and, with ``restart``, a new one
    is started. Returns each live replica's record (the new one's for the last). Each
    process has a queue of its own: one killed while writing holds only its own lock.
    ``kill_at=None``: nobody is killed, and a replica's exception is its record."""
    import os
    import signal

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = multiprocessing.get_context("spawn")
    procs, queues, records = {}, {}, {}
    last = replicas - 1
    together = ctx.Barrier(replicas)  # the first quorum holds every replica

    def start(i, pause_at=None, first=True):
        queues[i] = ctx.Queue()
        procs[i] = ctx.Process(target=workers.ef_replica, args=(
            i, lighthouse.address(), policy, syncs, queues[i], fragments, pause_at,
            together if first else None, init_sync))
        procs[i].start()

    def messages():
        for q in list(queues.values()):
            try:
                yield q.get_nowait()
            except queue.Empty:
                pass  # nothing from this replica yet

    try:
        for i in range(last):
            start(i)
        start(last, pause_at=kill_at)  # None: never paused
        deadline = time.monotonic() + 2 * WAIT_S
        while len(records) < (replicas if restart else last):
            got = list(messages())
            if not got:
                assert time.monotonic() < deadline, f"no result within {2 * WAIT_S} s (a hang)"
                dead = [i for i, p in procs.items() if p.exitcode not in (None, 0)]
                assert not dead, f"replica {dead[0]} exited with {procs[dead[0]].exitcode}"
                time.sleep(0.2)
            for message in got:
                if message[0] == "paused":
                    os.kill(message[2], signal.SIGKILL)
                    procs[last].join(30)
                    assert procs[last].exitcode == -signal.SIGKILL
                    if restart:
                        start(last, first=False)
                    else:
                        del procs[last], queues[last]
                elif message[0] != "step":
                    i, record = message
                    assert kill_at is None or "exception" not in record, record["exception"]
                    records[i] = record
        return joined(procs, records)
    finally:
        stop(procs, lighthouse)


@pytest.mark.parametrize("policy,fragments", [("diloco-int2ef", 1), ("diloco-sparse", 2)])
def test_error_feedback_on_torchft_goes_on_identical_after_a_replica_is_killed(policy,
                                                                                fragments):
    records = run_ef(policy, fragments=fragments)
    survivor, newcomer = records[0], records[1]
    assert survivor["step"] == newcomer["step"] == 6
    steps = sorted(set(survivor["committed"]) & set(newcomer["committed"]))
    assert steps and min(steps) > 2, steps  # the newcomer committed after healing
    assert all(survivor["committed"][s] == newcomer["committed"][s] for s in steps)
    if fragments == 1:  # alpha 0: local weights are θ_global after a sync of every one
        assert survivor["local"] == newcomer["local"]
    stats = survivor["stats"]["outer.grad.inter"]  # each replica group is a site
    assert 8 * stats["wire_bytes"] / stats["elements"] < (2.3 if policy == "diloco-int2ef"
                                                           else 0.3)
    # the memory rule, said: the newcomer heals with no memory; the survivor keeps its own
    healed = [(line, held) for line, held in newcomer["said"] if "healed" in line]
    assert healed and all(n == 0 for n in healed[0][1]), newcomer["said"]
    assert "error-feedback memory starts fresh" in healed[0][0]
    # the survivor's sync with the killed replica is discarded, its memory as before it
    dropped = [(line, held) for line, held in survivor["said"] if "not committed" in line]
    assert dropped and "its all-reduce failed" in dropped[0][0], survivor["said"]
    kept = [(line, held) for line, held in survivor["said"] if "keeps its" in line]
    assert kept and any(n > 0 for n in kept[0][1]), survivor["said"]
    # the loss goes on: the last syncs' inner losses below the first ones', all finite
    losses = survivor["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-H:]) < sum(losses[:H])


def test_the_torchft_diloco_refuses_what_it_cannot_run_on():
    from torchft.manager import Manager

    model = torch.nn.Linear(4, 4)
    with pytest.raises(InputError, match="manager=str is not allowed"):
        commpress.torchft.DiLoCo("manager", model)
    with pytest.raises(InputError, match="topology= is not allowed"):
        commpress.torchft.DiLoCo(object.__new__(Manager), model, topology=commpress.Topology(1))
    with pytest.raises(InputError, match="a convergence guard .* is not allowed yet"):
        commpress.torchft.DiLoCo(object.__new__(Manager), model, guard=0.3)
    manager = object.__new__(Manager)
    manager._use_async_quorum = True
    with pytest.raises(InputError, match="use_async_quorum=True is not allowed"):
        commpress.torchft.DiLoCo(manager, model)
    manager._use_async_quorum = False
    manager._user_state_dicts = {}
    with pytest.raises(InputError, match="Manager without state_dict/load_state_dict is not"):
        commpress.torchft.DiLoCo(manager, model)
    manager._user_state_dicts = {commpress.torchft.STATE_KEY: dict}
    with pytest.raises(InputError, match="already serves a DiLoCo's state"):
        commpress.torchft.DiLoCo(manager, model)
    manager._user_state_dicts = {"set_state_dict_fns": dict}
    manager._pg = commpress.torchft.compress(ProcessGroupGloo(), "diloco-int4").process_group
    with pytest.raises(InputError, match="Manager on CompressedProcessGroup is not allowed"):
        commpress.torchft.DiLoCo(manager, model)


def test_a_quorum_that_shrinks_starts_the_survivors_memory_fresh():
    # 3 replicas, one killed inside a sync and not replaced: the 2 left go on in a quorum
    # of 2, where the memory's layout (the group's padded length, this rank's chunk)
    # differs — so it starts fresh, said, rather than being added to other values
    records = run_ef("diloco-int2ef", replicas=3, restart=False)
    a, b = records[0], records[1]
    assert a["step"] == b["step"] == 6
    steps = sorted(set(a["committed"]) & set(b["committed"]))
    assert steps == list(range(1, 7)), steps
    assert all(a["committed"][s] == b["committed"][s] for s in steps)
    for record in (a, b):
        fresh = [(line, held) for line, held in record["said"]
                 if "new quorum" in line and "starts fresh" in line]
        assert fresh and "of 2 (was" in fresh[0][0] and "of 3)" in fresh[0][0], record["said"]
        assert fresh[0][1] == [0]  # no residual left when it was said


def test_replicas_that_start_apart_without_healing_are_named_not_averaged():
    # init_sync=False and other seeds: each replica's θ_global is its own start; averaging
    # pseudo-gradients of different θ_global would keep them apart for good
    records = run_ef("diloco-int2ef", kill_at=None, init_sync=False)
    for record in records.values():
        assert "CollectiveMismatchError" in record["exception"], record
        assert "global_weights differs" in record["exception"], record["exception"][-600:]
