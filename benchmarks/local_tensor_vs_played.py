"""torch's LocalTensorMode against commpress's played transport, as the way to run N ranks'
collectives in one process: the same all-reduce steps (``all_reduce_steps``) under each.

    python benchmarks/local_tensor_vs_played.py [--ranks 8] [--numel 4194304]
        [--codecs int8,int4:hadamard=128]

Per codec and route, in a fresh process each (so the peak RSS is the route's own): the
time, the peak memory above the start, whether every rank holds the same bits, and the
largest error against the exact mean (relative to its largest value). Rank r's input is
made just before it is handed over, as ``commpress simulate`` computes a rank's gradient;
the played route frees it once encoded, LocalTensorMode needs every rank's at once. Under
LocalTensorMode the steps run directly on a ``fake`` process group: commpress's
cross-rank agreement check needs a Gloo group, which that backend cannot make.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import subprocess
import sys
import time

import torch


def _grad(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def _local(spec: str, n: int, numel: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commpress.collectives.compressed_all_reduce as ar
    from commpress.collectives.byte_stats import Stats
    from commpress.collectives.call import resolve_codec
    from commpress.collectives.transport import run

    def run_into(target, steps_of):  # data_ptr() is not defined for a LocalTensor
        flat = target.view(-1)
        return run(steps_of(flat), lambda values: flat.view(values.shape).copy_(values))

    ar.run_into = run_into
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    with LocalTensorMode(n):
        x = LocalTensor({r: _grad(r, numel) for r in range(n)})
        ar.run_all_reduce(x, resolve_codec(spec), dist.group.WORLD, Stats(), "x", "avg").wait()
    return [x._local_tensors[r] for r in range(n)]


def _played(spec: str, n: int, numel: int) -> list[torch.Tensor]:
    import commpress.collectives.compressed_all_reduce as ar
    from commpress.collectives.byte_stats import Stats
    from commpress.collectives.call import resolve_codec
    from commpress.collectives.played import Played, played_peers
    codecs = {r: resolve_codec(spec) for r in range(n)}
    played = Played(n, lambda r, x: ar.all_reduce_steps(x, codecs[r], played_peers(r, n, n)[0],
                                                       Stats(), "x", "avg"))
    for r in range(n):
        played.add(r, _grad(r, numel))
    outs = played.finish()
    return [outs[r] for r in range(n)]


def one(route: str, spec: str, n: int, numel: int) -> str:
    """One route's row, as ``| ... |``."""
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    outs = (_local if route == "LocalTensorMode" else _played)(spec, n, numel)
    seconds = time.perf_counter() - t0
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    exact = sum(_grad(r, numel) for r in range(n)) / n
    error = float((outs[0] - exact).abs().max() / exact.abs().max())
    same = all(torch.equal(outs[0], o) for o in outs)
    digest = hashlib.sha256(outs[0].numpy().tobytes()).hexdigest()[:12]
    return (f"| {spec} | {route} | {seconds:.2f} | {peak_mb:.0f} | {'yes' if same else 'no'} | "
            f"{error:.2e} | {digest} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--codecs", default="int8,int4:hadamard=128")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # ROUTE SPEC, in a child
    args = ap.parse_args()
    if args.one:
        print(one(args.one[0], args.one[1], args.ranks, args.numel), flush=True)
        return
    print(f"all-reduce (avg) of {args.ranks} ranks × {args.numel} fp32 elements\n")
    print("| codec | route | s | peak MB | ranks same | max error / max | result sha256 |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.codecs.split(","):
        for route in ("played", "LocalTensorMode"):
            done = subprocess.run([sys.executable, __file__, "--ranks", str(args.ranks),
                                   "--numel", str(args.numel), "--one", route, spec],
                                  capture_output=True, text=True)
            print(done.stdout.strip() or f"| {spec} | {route} | failed: "
                  f"{done.stderr.strip().splitlines()[-1]} |", flush=True)


if __name__ == "__main__":
    main()
