"""Many short runs in one process group, and the same runs played in one process: what
`test_simulate_equals_train` compares (module level: picklable)."""

import gc
import hashlib
import os

import torch
import torch.distributed as dist

from commpress.launch import rank_threads
from commpress.train.config import TrainConfig
from commpress.train.run import Run


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _result(run: Run, losses: list[float], masters: list[list[str]]) -> dict:
    return {"losses": losses, "weights": {n: _digest(t) for n, t in run.stage.state_dict().items()},
            "masters": masters}


def _train(run: Run) -> list[float]:
    return [run.train_step(step) for step in range(run.cfg.steps)]


def real_runs(rank: int, world: int, cases: list[dict]) -> list[dict] | None:
    """Each case as a rank of `commpress train` runs it, one after another in this process
    group; rank 0 returns data-parallel rank 0's final weights, the losses and every rank's
    fp32 master shards (digests)."""
    out = []
    for case in cases:
        cfg = TrainConfig(**case).resolved(world)
        run = Run(cfg, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        losses = _train(run)
        mine = ([_digest(m) for m in run.opts[0].state_dict()["master"]]
                if cfg.engine == "sharded" else [])
        masters = [None] * world
        dist.all_gather_object(masters, mine)
        out.append(_result(run, losses, masters))
        run.release()  # hundreds of cases: their groups must not pile up
        del run
        gc.collect()  # a destroyed group's threads end once the run's cycles are freed
    return out if rank == 0 else None


def played_runs(cases: list[dict]) -> list[dict]:
    """Each case as `commpress simulate` plays it in the calling process (on one thread,
    as it runs)."""
    out = []
    with rank_threads():
        for case in cases:
            cfg = TrainConfig(**case).resolved()
            run = Run(cfg, played=True)
            losses = _train(run)
            every = run.opts[0].state_dict()["master"] if cfg.engine == "sharded" else []
            # one fp32 master per bucket holds every rank's shard
            masters = [[_digest(m.chunk(cfg.dp)[r]) for m in every] for r in range(cfg.dp)]
            out.append(_result(run, losses, masters))
    return out
