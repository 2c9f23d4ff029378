"""The sub-groups a process group owns: its node levels and, on NCCL, its Gloo control group.

Every sub-group commpress makes belongs to exactly one parent group and is destroyed with
it. Two collectives in flight on two parents over the same ranks (two threads; a DDP
hook's communication thread beside DiLoCo's) then never share a connection, so their
payloads cannot pair up in a different order on different ranks — which is what sharing
sub-groups by rank set did: wrong sums on every rank, then a deadlock. Concurrent calls
on different groups are as safe as torch's own.

**Names.** torch names a group made by its members alone after its ranks and the number
of groups the process holds. That name repeats once a group is destroyed, and differs
between ranks whose threads made groups in another order; a repeated name reads the
previous group's rendezvous keys in the store and hangs. A sub-group is named here after
its parent's name (the same on every member: the parent's own rendezvous used it), the
parent's *incarnation* (how many groups of that name made sub-groups in this process
before: the same on every member, since each incarnation's members make them in the same
agreed call; counted afresh in a re-initialized world), its kind and its ranks: no two
sub-groups of one world share a name. torch's
``new_group`` cannot be given a name, so the group is made by the helper ``new_group``
itself calls, and registered the way ``new_group`` registers one.

**Made without blocking.** Gloo connects a new group's members while holding the GIL:
two threads making sub-groups of two parents at once (each in its parent's first call)
deadlock across ranks when the ranks reach them in different orders — rank 0 waits in
A's connect holding its GIL while rank 1 waits in B's. A Gloo sub-group is therefore made
with ``TORCH_GLOO_LAZY_INIT`` (torch's documented switch: each pair connects at its first
exchange, inside the collective, where the GIL is free), set only while it is made, and
the sub-groups each thread makes use a store connection of their own
(:func:`store_client`). A lazy connect does not honour the group's timeout (a peer that
never comes held a collective 5 s or for as long as the peer stayed away, whatever the
timeout), so every pair is connected at once, by an exchange between all members whose
wait is bounded by the timeout (:func:`_connect_every_pair`): past it, a group behaves as
an eagerly connected one.
The switch is the process's environment: a Gloo group another thread makes in that
instant connects lazily too, which changes when it connects, not what it does (torch
offers no per-group option).

**Known limit:** on NCCL with a default group bound to a device
(``init_process_group(device_id=...)``), torch splits every new NCCL group from the
default communicator, which every rank of the world must join; the node levels of a
group smaller than the world are made by its members alone and would wait (as they did
through ``new_group(use_local_synchronization=True)`` before). Not yet run on a GPU.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_LOCK = threading.Lock()
# per default group (a re-initialized world numbers its groups afresh): name → incarnations
_INCARNATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# per default group: thread → its connection to the store (store_client)
_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def next_incarnation(parent_name: str) -> int:
    """The incarnation of the group named ``parent_name`` (in this default group's world)
    that makes sub-groups now."""
    world = dist.distributed_c10d._get_default_group()
    with _LOCK:
        counts = _INCARNATIONS.setdefault(world, defaultdict(int))
        n = counts[parent_name]
        counts[parent_name] += 1
        return n


def store_client() -> dist.Store:
    """This thread's connection of its own to the default store, for the sub-groups it
    makes (``Store.clone``, torch's way to use a store from several threads). A TCP store
    client serializes its requests, and a Gloo sub-group's first exchange waits in ``get``
    for its peers' addresses: on a client shared with another thread's sub-groups, that
    wait held up their store calls — a peer's sub-group among them, across ranks: a
    deadlock. The sub-groups one thread makes are made in the same order on every rank
    (each in an agreed call), so a wait on its connection is for a peer that reaches that
    sub-group before anything later: they may share it. A new connection can take 5 s
    (BENCHMARKS.md, "Connections to torch's store"): one per thread that makes sub-groups,
    not one per sub-group."""
    world = dist.distributed_c10d._get_default_group()
    with _LOCK:
        clients = _CLIENTS.setdefault(world, {})
        client = clients.get(threading.get_ident())
        if client is None:
            client = clients[threading.get_ident()] = _clone(world)
        return client


def _clone(world: dist.ProcessGroup) -> dist.Store:
    store = dist.distributed_c10d._world.pg_map[world][1]
    try:
        return store.clone()
    except (NotImplementedError, RuntimeError, AttributeError):  # a store of the user's
        return store  # own making without clone(): shared, as every group shares it


def make(parent_name: str, incarnation: int, kind: str, ranks: list[int], backend: str,
         timeout: timedelta | None, store: dist.Store) -> dist.ProcessGroup:
    """A new group of the global ``ranks`` (in this order: group rank ``i`` is
    ``ranks[i]``) for the parent group named ``parent_name``, over ``store``
    (:func:`store_client`): made by its members alone without waiting for them (they
    connect at the first exchange, within the timeout); the parent's context keeps it and
    :func:`destroy` ends it."""
    c10d = dist.distributed_c10d
    name = f"commpress/{parent_name}/{incarnation}/{kind}/{'-'.join(map(str, ranks))}"
    default = c10d._get_default_group()
    backend = c10d.Backend(backend)
    timeout = timeout or c10d._get_default_timeout(backend)
    with _connect_lazily(backend):
        group, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(dist.get_rank()), list(ranks), backend, store, name,
            timeout=timeout, device_id=default.bound_device_id,
            group_desc=f"commpress {kind} of {parent_name}")
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    if "gloo" in str(backend):
        _connect_every_pair(group, name, ranks, timeout)
    return group


def _connect_every_pair(group: dist.ProcessGroup, name: str, ranks: list[int],
                        timeout: timedelta) -> None:
    """An all-to-all (every member sends to every other) waited on for at most
    ``timeout``, in the agreed call that made the group: each lazy pair connects here, where
    the wait is bounded and the GIL free."""
    n = len(ranks)
    work = dist.all_to_all_single(torch.zeros(n), torch.zeros(n), group=group, async_op=True)
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(
            f"commpress: the members of sub-group {name} (global ranks {ranks}) did not all "
            f"connect within its timeout of {timeout.total_seconds():g} s: one never reached "
            f"the call that makes it, or cannot be reached. Cause: {e}") from e


_LAZY = "TORCH_GLOO_LAZY_INIT"
_ENV_LOCK = threading.Lock()


@contextmanager
def _connect_lazily(backend: str):
    """While inside, a new Gloo group connects at its first exchange (module docstring)."""
    if "gloo" not in str(backend):
        yield
        return
    with _ENV_LOCK:
        kept = os.environ.get(_LAZY)
        os.environ[_LAZY] = "1"
        try:
            yield
        finally:
            if kept is None:
                del os.environ[_LAZY]
            else:
                os.environ[_LAZY] = kept


def destroy(groups: list[dist.ProcessGroup]) -> None:
    """Destroy a parent's sub-groups (after its last collective; every member calls it at
    the same point, as it releases the parent). Only there: destroying a group changes the
    count torch names the next groups by, so it must happen alike on every rank — never
    in passing, when one rank happens to notice a dead parent. A parent destroyed with
    torch's own ``destroy_process_group(group)`` leaves its sub-groups until the whole
    world is destroyed."""
    registered = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group in registered:
            dist.destroy_process_group(group)
