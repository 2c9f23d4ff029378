"""Replica groups of a torchft job (one process each, module level: picklable): torchft's
own DiLoCo over its Manager, the Manager's process group plain or compressed by commpress.
The lighthouse runs in the test's process."""

import logging
import os
import time
import traceback
from datetime import timedelta

import torch
from torch.distributed import TCPStore

import commpress
from tests.frontends import workers

H = 4  # inner steps per sync
TIMEOUT = timedelta(seconds=10)


def _pg(policy, timeout=TIMEOUT):
    from torchft.process_group import ProcessGroupGloo

    inner = ProcessGroupGloo(timeout=timeout)
    return inner if policy is None else commpress.torchft.compress(inner, policy,
                                                                  timeout).process_group


def replica(replica_id, lighthouse, policy, syncs, results, die_in_sync=None):
    """Train until ``syncs`` syncs have committed; put the record on ``results``.
    ``die_in_sync=k``: this process exits inside the second all-reduce of its k-th sync
    (one per parameter), before a byte of it is sent: the other replica is then waiting
    in the same call."""
    try:
        results.put((replica_id, _train(replica_id, lighthouse, policy, syncs, die_in_sync)))
    except Exception:  # noqa: BLE001 - the test shows it
        results.put((replica_id, {"exception": traceback.format_exc()}))


def _train(replica_id, lighthouse, policy, syncs, die_in_sync):
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    torch.set_num_threads(1)
    data = workers._data()
    model = workers._model(seed=replica_id)  # different starts: healing must fix that
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    pg = _pg(policy)
    if die_in_sync is not None:
        _die_in_call(pg, (die_in_sync - 1) * len(list(model.parameters())) + 2)
    store = TCPStore("localhost", 0, 1, is_master=True)
    manager = Manager(
        pg=pg, min_replica_size=2, use_async_quorum=False,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=str(replica_id), store_addr="localhost", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse, timeout=TIMEOUT,
        quorum_timeout=timedelta(seconds=120), connect_timeout=TIMEOUT)
    record = {"committed": {}, "errors": [], "losses": []}
    should_commit = manager.should_commit

    def watched_commit(*args, **kwargs):
        if manager.errored() is not None:
            error = manager.errored().original_exception
            record["errors"].append(f"{type(error).__name__}: {error}")
        return should_commit(*args, **kwargs)

    manager.should_commit = watched_commit
    commpress.reset_stats()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H, backup_device=torch.device("cpu"),
                    pin_memory=False):
            # after DiLoCo's own hook: the weights each commit left, with its step
            inner.register_step_post_hook(lambda *_: record["committed"].setdefault(
                manager.current_step(), workers._hash_params(model)))
            _inner_steps(manager, model, inner, data, replica_id, 2, syncs, 4 * H * syncs,
                         record)
        record["stats"] = commpress.stats()
        record["step"] = manager.current_step()
    finally:
        manager.shutdown(wait=False)
    return record


def _inner_steps(manager, model, inner, data, replica_id, parts, syncs, most, record):
    """Inner steps on this replica's part (of ``parts``) of each batch until ``syncs``
    syncs have committed, or ``most`` steps; each loss into ``record``."""
    step = 0
    while manager.current_step() < syncs and step < most:
        x, y = workers._local_batch(data, step, replica_id, parts)
        _, loss = model(x, y)
        loss.backward()
        inner.step()
        inner.zero_grad()
        record["losses"].append(loss.item())
        step += 1


def _die_in_call(pg, n):
    calls = [0]
    allreduce = pg.allreduce

    def dying(tensors, opts):
        calls[0] += 1
        if calls[0] == n:
            os._exit(3)
        return allreduce(tensors, opts)

    pg.allreduce = dying


def pg_pair(rank, store_port, policy, results, quorums=1):
    """One of two replicas on bare quorums (no Manager): torchft's process group,
    compressed with ``policy`` (None: torchft's own), configured ``quorums`` times over a
    shared store (a new quorum each time, as torchft reconfigures after a failed step);
    then all-reduces of a 0-d loss and of every float dtype. Puts what each gave, or what
    each ``configure`` raised and what ``errored()`` then raised."""
    from torch.distributed import ReduceOp

    try:
        pg = _pg(policy, timeout=timedelta(seconds=3))
        refused = []
        for quorum in range(quorums):
            try:
                pg.configure(f"localhost:{store_port}/quorum/{quorum}", str(rank), rank, 2)
                if policy is None and quorums > 1:  # torchft's own, in step with its peer
                    time.sleep(4)  # (its lighthouse would hold it in the quorum)
                continue
            except Exception as e:  # noqa: BLE001 - the test reads it
                refused.append({"configure": f"{type(e).__name__}: {e}", "errored": None})
            try:
                pg.errored()
            except Exception as again:  # noqa: BLE001 - should_commit would raise this
                refused[-1]["errored"] = f"{type(again).__name__}: {again}"
                break
        if refused:
            results.put((rank, {"refused": refused}))
            return
        out = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for op in (ReduceOp.SUM, ReduceOp.AVG):
                t = torch.tensor(float(rank + 1), dtype=dtype)  # a 0-d loss
                pg.allreduce([t], op).wait()
                out[(str(dtype), str(op))] = t.item()
        results.put((rank, {"values": out}))
    except Exception:  # noqa: BLE001 - the test shows it
        results.put((rank, {"exception": traceback.format_exc()}))


def ef_replica(replica_id, lighthouse, policy, syncs, results, fragments=1, pause_at=None,
               together=None, init_sync=True):
    """A replica group training with :class:`commpress.torchft.DiLoCo` (error feedback
    kept per fragment) until ``syncs`` syncs have committed. Puts ``("step", id, s)`` at
    each committed sync, then its record. ``pause_at=k``: once ``k`` syncs committed, it
    stops inside the next sync after the quorum formed, before its all-reduce (its peer
    waits in it), and puts ``("paused", id, pid)``: the test kills it there.
    ``together``: a barrier the replicas pass once their Managers run, so that the first
    quorum holds them all. The replicas start from different weights (seeds): with
    ``init_sync=False`` nothing heals them at the start."""
    try:
        results.put((replica_id, _train_ef(replica_id, lighthouse, policy, syncs, results,
                                           fragments, pause_at, together, init_sync)))
    except Exception:  # noqa: BLE001 - the test shows it
        results.put((replica_id, {"exception": traceback.format_exc()}))


class _Said(logging.Handler):
    """commpress's warnings, and the residuals each fragment held when one was said."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines, self.residuals, self.sync = [], [], None

    def emit(self, record):
        self.lines.append(record.getMessage())
        if self.sync is not None:
            self.residuals.append([sum(len(level.get("residuals", {})) for level in
                                       f.dp.state_dict()["grad"].values())
                                   for f in self.sync.fragments])


def _train_ef(replica_id, lighthouse, policy, syncs, results, fragments, pause_at, together,
              init_sync):
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    said = _Said()
    logging.getLogger("commpress").addHandler(said)
    logging.getLogger("commpress").addHandler(logging.StreamHandler())  # beside torchft's
    data = workers._data()
    model = workers._model(seed=replica_id)  # different starts: healing must fix that
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    store = TCPStore("localhost", 0, 1, is_master=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=2, use_async_quorum=False,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=str(replica_id), store_addr="localhost", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse, timeout=TIMEOUT,
        quorum_timeout=timedelta(seconds=120), connect_timeout=TIMEOUT, init_sync=init_sync)
    sync = commpress.torchft.DiLoCo(manager, model, inner, sync_every=H, policy=policy,
                                    fragments=fragments)
    if together is not None:
        together.wait(120)
    said.sync = sync
    record = {"committed": {}, "losses": []}

    def after_step(*_):  # after the synchronizer's own hook: what each commit left
        step = manager.current_step()
        if step and step not in record["committed"]:
            record["committed"][step] = _hash_tensors(sync.global_weights())
            results.put(("step", replica_id, step))

    inner.register_step_post_hook(after_step)
    if pause_at is not None:
        start = sync._start

        def pausing(*args):
            if manager.current_step() == pause_at:
                results.put(("paused", replica_id, os.getpid()))
                time.sleep(600)
            return start(*args)

        sync._start = pausing
    commpress.reset_stats()
    try:
        _inner_steps(manager, model, inner, data, replica_id, 4, syncs, 8 * H * syncs, record)
        record["stats"] = commpress.stats()
        record["step"] = manager.current_step()
        record["said"] = list(zip(said.lines, said.residuals))
        record["local"] = workers._hash_params(model)
    finally:
        sync.remove()
        manager.shutdown(wait=False)
    return record


def _hash_tensors(tensors):
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
