"""What Gloo does when ranks post one collective with different sizes: why commpress agrees
on every call's sizes before its payload moves, and cannot carry that agreement inside
the payload exchange of a call whose sizes are not agreed already.

Two ranks post the same collective (``all_reduce``, or ``all_gather`` into a tensor),
rank 0 with 4 elements and rank 1 with 8 (``--swap``: the other way round). Each rank
prints whether its call finished, raised, or the process died (the parent prints the
exit signal).

    python benchmarks/gloo_size_mismatch.py all_reduce
    python benchmarks/gloo_size_mismatch.py all_gather [--swap]
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
    n = (4 if rank == 0 else 8) if not args.swap else (8 if rank == 0 else 4)
    t0 = time.perf_counter()
    try:
        if args.collective == "all_reduce":
            dist.all_reduce(torch.ones(n))
        else:
            dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(n))
        print(f"rank {rank}: finished after {time.perf_counter() - t0:.2f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - what Gloo raises is what this shows
        print(f"rank {rank}: {type(e).__name__} after {time.perf_counter() - t0:.2f} s: "
              f"{str(e)[:200]}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("collective", choices=["all_reduce", "all_gather"])
    ap.add_argument("--swap", action="store_true")
    ap.add_argument("--port", type=int, default=29613)
    args = ap.parse_args()
    ctx = mp.start_processes(rank_main, (args,), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(60)
    for rank, p in enumerate(ctx.processes):
        code = p.exitcode
        how = "exit 0" if code == 0 else (f"killed by signal {-code}" if code and code < 0
                                          else f"exit {code}")
        print(f"rank {rank} process: {how}")


if __name__ == "__main__":
    main()
