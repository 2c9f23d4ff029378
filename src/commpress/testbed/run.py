"""Run a ``commpress`` command (train or compare) with its ranks spread over the nodes
of an emulated :class:`~commpress.testbed.netns.Cluster`.

Each rank is a process started inside its node's namespace with the environment a
``torchrun`` launcher would give it; Gloo binds to the namespace's ``eth0``. Rank 0's
output passes through; if any rank fails, the others are stopped and the error
returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from commpress.files import write_json
from commpress.launch import set_parent_death_signal
from commpress.testbed.netns import Cluster
from commpress.validate import InputError, check_float, check_int


def run_on_testbed(nodes: int, ranks_per_node: int, command: list[str], bandwidth: str = "50mbit",
                   latency: str | None = None, port: int = 29531, timeout: float = 7200.0,
                   link_stats: str | None = None) -> int:
    """Run ``commpress <command>`` on ``nodes × ranks_per_node`` ranks; returns rank 0's code.

    At the end it prints the bytes each node sent and received on its link (all of the
    run: set-up, steps, evaluation), and writes them to ``link_stats`` as JSON if given.
    """
    if not command or command[0] not in ("train", "compare"):
        raise InputError(f"testbed command {command[:1]!r} is not allowed; allowed: train …, "
                         "compare …")
    check_int("ranks_per_node", ranks_per_node, ge=1)
    check_int("port", port, ge=1, le=65535)
    check_float("timeout", timeout, gt=0)
    world = nodes * ranks_per_node
    with Cluster(nodes, bandwidth, latency) as cluster:
        procs = []
        try:
            for rank in range(world):
                node = rank // ranks_per_node
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(rank % ranks_per_node),
                           LOCAL_WORLD_SIZE=str(ranks_per_node), MASTER_ADDR=cluster.ip(0),
                           MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                           OMP_NUM_THREADS="1")
                argv = ["ip", "netns", "exec", cluster.ns(node), sys.executable, "-m",
                        "commpress.cli", *command, "--ranks-per-node", str(ranks_per_node)]
                out = None if rank == 0 else subprocess.DEVNULL
                # a rank dies with the testbed: kill -9 of it leaves no orphan training on
                procs.append(subprocess.Popen(argv, env=env, stdout=out,
                                              stderr=None if rank == 0 else subprocess.PIPE,
                                              preexec_fn=set_parent_death_signal))
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            _report_links(cluster, nodes, link_stats)
            if failed and failed[0] != 0:
                err = procs[failed[0]].stderr.read().decode(errors="replace")[-4000:]
                print(f"testbed: rank {failed[0]} failed:\n{err}", file=sys.stderr)
            return 0 if not failed and all(c == 0 for c in codes) else 1
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()


def _report_links(cluster: Cluster, nodes: int, path: str | None) -> None:
    links = [dict(zip(("sent_bytes", "received_bytes"), cluster.link_bytes(i)))
             for i in range(nodes)]
    text = "; ".join(f"node {i} sent {x['sent_bytes'] / 1e6:.1f} MB, received "
                     f"{x['received_bytes'] / 1e6:.1f} MB" for i, x in enumerate(links))
    print(f"testbed: {text}", file=sys.stderr)
    if path:
        write_json(path, {"nodes": links})
