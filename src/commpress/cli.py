"""The ``commpress`` command: train | compare | bench | plan | demo."""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cmd_demo(args: argparse.Namespace) -> int:
    """Round-trip every codec on a small tensor and print bits and errors."""
    from commpress.bench.codecs import bench_codecs, print_codec_table

    rows = bench_codecs(device="cpu", numel=1 << 18, dtype=torch.float32,
                        with_reference=False, iters=3)
    print_codec_table(rows)
    return 0


def _cmd_bench_codecs(args: argparse.Namespace) -> int:
    from rich.console import Console

    from commpress.bench.codecs import bench_codecs, print_codec_table, write_json

    console = Console(stderr=True)
    specs = args.codecs.split(";") if args.codecs else None
    with console.status("benchmarking codecs") as status:
        rows = bench_codecs(specs, device=args.device, numel=args.numel, dtype=DTYPES[args.dtype],
                            with_reference=not args.no_reference, iters=args.iters,
                            progress=lambda msg: status.update(f"benchmarking {msg}"))
    print_codec_table(rows)
    if args.json:
        write_json(rows, args.json)
    return 0


def _cmd_bench_collectives(args: argparse.Namespace) -> int:
    from commpress.bench.collectives import run_collectives_bench

    run_collectives_bench(nproc=args.nproc, ranks_per_node=args.ranks_per_node,
                          numel=args.numel, codecs=args.codecs.split(";") if args.codecs else None,
                          json_path=args.json, iters=args.iters)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commpress", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="round-trip every codec on a small tensor")
    demo.set_defaults(fn=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="what", required=True)
    bc = bsub.add_parser("codecs", help="codec throughput (GB/s) and error")
    bc.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    bc.add_argument("--numel", type=int, default=1 << 22, help="elements per tensor")
    bc.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    bc.add_argument("--codecs", default=None, help="';'-separated codec specs (default: all)")
    bc.add_argument("--iters", type=int, default=10)
    bc.add_argument("--no-reference", action="store_true",
                    help="skip the torch.compile reference quantizer")
    bc.add_argument("--json", default=None, help="write the rows as JSON to this path")
    bc.set_defaults(fn=_cmd_bench_codecs)

    bcol = bsub.add_parser("collectives", help="compressed vs torch collectives")
    bcol.add_argument("--nproc", type=int, default=4)
    bcol.add_argument("--ranks-per-node", type=int, default=None)
    bcol.add_argument("--numel", type=int, default=1 << 20)
    bcol.add_argument("--codecs", default=None, help="';'-separated codec specs")
    bcol.add_argument("--iters", type=int, default=5)
    bcol.add_argument("--json", default=None)
    bcol.set_defaults(fn=_cmd_bench_collectives)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
