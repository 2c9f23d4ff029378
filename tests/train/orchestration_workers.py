"""Rank functions for the run-orchestration tests (importable by spawned ranks)."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SILENT_S = 5.0  # how long the silent ranks stay away: far longer than the timeout
TIMEOUT_S = 1.0  # the default group's timeout once every rank has arrived


def wait_in_sub_groups(rank, world):
    """Only rank 0 calls; it waits in a mesh sub-group and in both node-level groups
    (2 ranks per node). Returns, per group, how long it waited before the wait failed."""
    from commpress.collectives.group_context import context
    from commpress.parallel.mesh import MeshShape, build_mesh

    # a short timeout only now: the ranks' rendezvous needs the spawn's usual one
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))
    mesh = build_mesh(MeshShape(world, 1, 1))
    levels = context(dist.group.WORLD).levels(dist.group.WORLD, 2)
    if rank != 0:
        time.sleep(SILENT_S)
        return None
    waited = {}
    for name, group in (("mesh.dp", mesh.dp_group), ("levels.intra", levels.intra),
                        ("levels.inter", levels.inter)):
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError:
            pass
        waited[name] = time.monotonic() - t0
    return waited


def compare_as_a_launched_rank(rank, world, out, policies):
    """`compare` in a process that a launcher started with no process group yet (as
    torchrun starts it: RANK, WORLD_SIZE, MASTER_* set)."""
    from commpress.launch import free_port
    from commpress.train.compare import compare
    from commpress.train.config import TrainConfig

    # the spawn made a group; torchrun does not. A fresh port: a rank that re-joined on the
    # spawn's port could reach rank 0's old store before rank 0 tore it down
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    cfg = TrainConfig(model="gpt-tiny", steps=2, batch_size=4, seq_len=32, eval_every=0,
                      eval_batches=1, progress=False, max_data_bytes=200_000, timeout_s=30)
    return sorted(compare(policies, cfg, out_dir=out))
