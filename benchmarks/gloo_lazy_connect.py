"""How long a collective on a lazily connected Gloo group waits for a peer, against the
group's timeout: why commpress connects every pair of a sub-group when it makes it.

Two ranks; a group of both made with ``TORCH_GLOO_LAZY_INIT=1`` and ``--timeout`` seconds;
rank 1 reaches the all-reduce ``--late`` seconds after rank 0, or never (``--never``).
Prints rank 0's wait and its error. Run it several times: the wait varies from run to run.

    python benchmarks/gloo_lazy_connect.py --timeout 1 --late 12 --never
    python benchmarks/gloo_lazy_connect.py --timeout 3 --late 12
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    group = dist.new_group([0, 1], timeout=timedelta(seconds=args.timeout))
    del os.environ["TORCH_GLOO_LAZY_INIT"]
    if rank == 1:
        time.sleep(args.late)
        if args.never:
            return
    start, error = time.monotonic(), "-"
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as e:
        error = str(e).splitlines()[0][-80:]
    if rank == 0:
        peer = "never" if args.never else f"{args.late:g} s late"
        waited = time.monotonic() - start
        print(f"timeout {args.timeout:g} s, peer {peer}: rank 0 waited {waited:.1f} s ({error})",
              flush=True)
    time.sleep(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--late", type=float, default=12.0)
    parser.add_argument("--never", action="store_true")
    from commpress.launch import free_port

    mp.spawn(rank_main, args=(free_port(), parser.parse_args()), nprocs=2)
