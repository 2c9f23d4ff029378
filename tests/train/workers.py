"""Rank functions for the trainer tests (module level: picklable)."""

import hashlib

import torch

from commpress.parallel.tensor import is_tp_sharded
from commpress.train.config import TrainConfig
from commpress.train.run import Run


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replicated_digests(rank, world, base, policies, replication_key=None):
    """Per policy and step: this rank's mesh coordinates and a digest of the parameters
    every tensor-parallel rank holds a replica of (norms, biases after the reduce,
    embeddings, head)."""
    out = {}
    for policy in policies:
        cfg = TrainConfig(**dict(base, policy=policy)).resolved(world)
        run = Run(cfg)
        if replication_key is not None:  # the old bucketing, to show the test can fail
            from commpress.frontends.sharded_optimizer import ShardedOptimizer

            kept = run.opts[0]
            for hook in kept._hooks:
                hook.remove()
            run.opts = [ShardedOptimizer(
                run.stage, torch.optim.AdamW, run.policy, group=run.held.mesh.dp_group,
                topology=kept.topology, bucket_numel=cfg.bucket_numel,
                norm_group=kept.norm_group, norm_weights=kept.norm_weights, lr=cfg.lr,
                decay_1d=False, replication_key=replication_key)]
        replicated = [p for p in run.stage.parameters() if not is_tp_sharded(p)]
        digests = []
        for step in range(cfg.steps):
            run.train_step(step)
            digests.append(_digest(replicated))
        out[policy] = {"coords": (run.held.mesh.dp_idx, run.held.mesh.pp_idx, run.held.mesh.tp_idx),
                       "digests": digests}
    return out


def played_weights(rank, world, cfg_dict):
    """Train with `simulate`'s played optimizer (in a process of its own, one thread, as
    every rank of `train` runs); digests of the final weights by name."""
    import torch.distributed as dist

    cfg = TrainConfig(**cfg_dict).resolved()
    # tensor parallelism: one process per slice (this one: slice `rank`)
    run = Run(cfg, played=True, tp_group=dist.group.WORLD if cfg.tp > 1 else None)
    losses = [run.train_step(step) for step in range(cfg.steps)]
    key = (lambda s, n: (s, rank, n)) if cfg.tp > 1 else (lambda s, n: (s, n))
    return {key(s, n): _digest([t]) for s, stage in enumerate(run.stages)
            for n, t in stage.state_dict().items()}, losses


def weights_of_checkpoint(path):
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return {n: _digest([t]) for n, t in state["model"].items()}


def groups_after_runs(rank, world, policies, out):
    """The process groups registered in this process, and its threads (after a garbage
    collection), after each of ``policies`` (a DDP run, then sharded ones) ran one after
    another in one group."""
    import gc
    import os

    import torch.distributed as dist

    from commpress.train.loop import run_rank

    counts = []
    for i, policy in enumerate(policies):
        cfg = TrainConfig(model="gpt-tiny", steps=2, batch_size=8, seq_len=16, eval_every=0,
                          eval_batches=1, progress=False, max_data_bytes=100_000,
                          policy=policy, ranks_per_node=2, nproc=world,
                          engine="ddp" if i == 0 else "sharded", out=f"{out}/{policy}")
        run_rank(rank, world, cfg.resolved(world).to_dict())
        gc.collect()
        # a destroyed group's Gloo threads live as long as something holds the group
        counts.append((len(dist.distributed_c10d._world.pg_map),
                       len(os.listdir("/proc/self/task"))))
    return counts
