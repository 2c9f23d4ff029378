"""The ``commpress`` command: train | compare | bench | plan | demo."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing

import torch

from commpress.files import write_json
from commpress.launch import LaunchError
from commpress.testbed.netns import TestbedError
from commpress.train.config import DTYPES, TrainConfig, field_help
from commpress.train.errors import RunFailedError
from commpress.validate import InputError


def _cmd_demo(args: argparse.Namespace) -> int:
    """Round-trip every codec on a small tensor and print its bits and errors."""
    from commpress.bench.codecs import bench_codecs, print_codec_table

    rows = bench_codecs(device="cpu", numel=1 << 18, dtype=torch.float32,
                        with_reference=False, iters=1)
    print_codec_table(rows, speed=False)
    return 0


def _cmd_bench_codecs(args: argparse.Namespace) -> int:
    from rich.console import Console

    from commpress.bench.codecs import bench_codecs, print_codec_table, write_json

    console = Console(stderr=True)
    specs = _listed("--codecs", args.codecs, ";") if args.codecs is not None else None
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
    from commpress.codecs import codec

    sizes = _element_counts("--sizes", args.sizes)
    codecs = _listed("--codecs", args.codecs, ";") if args.codecs is not None else None
    for spec in codecs or ():
        codec(spec)  # a bad spec is an error before any rank starts
    run_collectives_bench(nproc=args.nproc, ranks_per_node=args.ranks_per_node, sizes=sizes,
                          codecs=codecs, json_path=args.json, iters=args.iters, device=args.device,
                          backend=args.backend,
                          dtype=str(DTYPES[args.dtype]).removeprefix("torch."))
    return 0


LIST_EXAMPLES = {",": "none,hybrid", ";": "int8;int4"}


def _listed(flag: str, values: str | list[str], sep: str = ",") -> list[str]:
    """The names of ``'none,hybrid'`` (or of several such, from a repeated flag). An empty
    name — a blank value, ``a,,b``, a trailing separator — is refused by name: dropping it
    would run another list than the one asked for, and a blank list all the defaults."""
    names: list[str] = []
    for value in [values] if isinstance(values, str) else values:
        items = [item.strip() for item in value.split(sep)]
        if not all(items):
            raise InputError(f"{flag} {value!r} is not allowed: it holds an empty name; "
                             f"allowed: names separated by {sep!r}, such as "
                             f"{LIST_EXAMPLES[sep]}")
        names += items
    return names


def _element_counts(flag: str, text: str) -> list[int]:
    """``'65536,1e6'`` → ``[65536, 1000000]``: positive whole numbers, written either way."""
    counts = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 1 and value == int(value)):
            raise InputError(f"{flag} {text!r} is not allowed: {item.strip()!r} is not a "
                             "positive whole number; allowed: element counts such as "
                             "65536,1048576")
        counts.append(int(value))
    return counts


def _optional(base: type):
    """An argparse type that also takes ``none`` for an optional value (its default: what
    the field's help says none means)."""

    def parse(text: str):
        if text.lower() == "none":
            return None
        return base(text)

    parse.__name__ = base.__name__  # argparse names the type in its error message
    return parse


def _path(text: str) -> str:
    """An argparse type for a file to write: a blank one is refused, not ignored."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a non-empty path")
    return text


def _add_train_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                       helps: dict[str, str] | None = None) -> None:
    """One flag per TrainConfig field; the field's help text (or ``helps``' for this
    command), then its default once."""
    helps = {**field_help(), **(helps or {})}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((t for t in args if t is not type(None)), hint)
        text = helps[f.name]
        if base is bool:  # a flag that turns the default around
            if f.default:
                p.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name,
                               action="store_false", help=f"do not {text}")
            else:
                p.add_argument(flag, dest=f.name, action="store_true", help=text)
            continue
        if f.default is not None and "default:" not in text:
            text = f"{text} (default: {f.default})"
        p.add_argument(flag, dest=f.name, type=_optional(base) if type(None) in args else base,
                       default=f.default, help=text)


def _train_config(args: argparse.Namespace, **override) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if hasattr(args, f.name)}
    values.update(override)
    return TrainConfig(**values)


def _cmd_train(args: argparse.Namespace) -> int:
    from commpress.train.loop import train

    summary = train(_train_config(args))
    if summary is not None:  # None: a rank other than 0 under torchrun
        _report(summary, args.json)
    return 0


def _report(summary: dict, json_path: str | None) -> None:
    """A run's summary table and directory (and the summary as JSON if asked)."""
    from commpress.console import console
    from commpress.train.report import summary_table

    console().print(summary_table(summary))
    console().print(f"run directory: {summary['out']} (metrics.jsonl, summary.json, loss.png)")
    if json_path:
        write_json(json_path, summary)


def _cmd_compare(args: argparse.Namespace, runner=None, **override) -> int:
    """``--policies`` side by side, each run by ``runner`` (default: ``train``)."""
    from commpress.train.compare import compare
    from commpress.train.loop import train

    policies = _listed("--policies", args.policies)
    compare(policies, _train_config(args, policy=policies[0] if policies else "none", **override),
            out_dir=args.out, json_path=args.json, runner=runner or train)
    return 0


SIMULATE_SKIPS = ("nproc", "dp", "ddp_hook", "backend", "timeout_s")
SIMULATE_HELPS = {"ranks_per_node": "ranks (data-parallel ranks × stages × tensor-parallel "
                                    "slices) per node; default: all in one node",
                  "tp": "tensor-parallel slices, each run by a process of its own that plays "
                        "its data-parallel ranks and stages"}


def _cmd_simulate(args: argparse.Namespace) -> int:
    from commpress.train.simulate import refuse_launcher, simulate

    refuse_launcher()  # before a comparison would make the launcher's process group
    if args.ranks < 1:
        raise InputError(f"--ranks {args.ranks} is not allowed; allowed: an integer >= 1")
    world = args.ranks * args.pp * args.tp
    if args.policies is not None:
        return _cmd_compare(args, simulate, nproc=world)
    _report(simulate(_train_config(args, nproc=world)), args.json)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from commpress.console import console
    from commpress.frontends.diloco import DiLoCoConfig, outer_policy
    from commpress.plan.cost import ClusterSpec, JobSpec, load_codec_throughput, plan, plan_outer
    from commpress.plan.hardware import GPUS, INTER_LATENCY_US, INTRA_LATENCY_US
    from commpress.plan.models import model_from_arg
    from commpress.plan.report import break_even_table, outer_table, plan_table
    from commpress.validate import check_int

    gpu = GPUS[args.gpu]
    tp, pp = args.tp, args.pp
    outers = _listed("--outer", args.outer)
    check_int("--outer-delay", args.outer_delay, ge=0)
    DiLoCoConfig(args.sync_every, args.fragments, args.outer_delay)  # checked by name
    outer_policies = {name: outer_policy(name) for name in outers}  # bad names fail first
    # tp or pp < 1 is JobSpec's to refuse; dp defaults to at least 1, so a layout larger
    # than --gpus is refused by name (dp × tp × pp must equal --gpus)
    dp = args.dp if args.dp is not None else max(1, args.gpus // max(1, tp * pp))
    cluster = ClusterSpec(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node,
        intra_GBps=gpu["nvlink_GBps"] if args.intra_bw is None else args.intra_bw,
        inter_GBps=args.inter_bw,
        tflops=gpu["tflops"] if args.tflops is None else args.tflops, mfu=args.mfu,
        intra_latency_us=INTRA_LATENCY_US,
        inter_latency_us=args.latency if args.latency is not None else INTER_LATENCY_US,
        device=args.device, backend=args.backend, link_efficiency=args.link_efficiency,
        codec_GBps=load_codec_throughput(args.codec_throughput, args.device)
        if args.codec_throughput else {})
    job = JobSpec(model=model_from_arg(args.model), dp=dp, tp=tp, pp=pp,
                  zero_stage=args.zero_stage, micro_batch=args.micro_batch, seq=args.seq,
                  global_batch=args.global_batch, recompute=args.recompute, overlap=args.overlap,
                  ep=args.ep)
    policies = _listed("--policy", args.policy)
    result = plan(cluster, job, policies)
    title = (f"{args.model} ({job.model.params / 1e9:.2f} B params) on {args.gpus} × {args.gpu}"
             f" ({args.gpus_per_node}/node), dp{dp}×tp{tp}×pp{pp}"
             + (f"×ep{args.ep}" if args.ep > 1 else "") + f", inter {args.inter_bw} GB/s "
             f"per node")
    console().print(plan_table(result, title))
    console().print(break_even_table(result))
    if outer_policies:
        result["outer"] = {name: plan_outer(cluster, job, policy, args.sync_every,
                                            args.fragments, args.outer_delay)
                           for name, policy in outer_policies.items()}
        ddp = plan(cluster, dataclasses.replace(job, zero_stage=0), [])["policies"]["none"]
        console().print(outer_table(result["outer"], ddp, args.sync_every, cluster.nodes))
    if args.json:
        write_json(args.json, result, default=str)
    return 0


def _cmd_testbed(args: argparse.Namespace) -> int:
    from commpress.testbed import run_on_testbed

    command = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if command[:1] in (["train"], ["compare"]):
        # the ranks' options are checked here, once, before any namespace is made
        _train_config(build_parser().parse_args(
            [*command, "--ranks-per-node", str(args.ranks_per_node)]))
    return run_on_testbed(args.nodes, args.ranks_per_node, command, args.bandwidth, args.latency,
                          link_stats=args.link_stats)


class _Parser(argparse.ArgumentParser):
    """A parser that takes a flag only as written (its sub-commands' parsers too):
    argparse's prefix match read ``bench collectives --ranks 1`` as ``--ranks-per-node 1``
    and ran."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from commpress.plan.hardware import GPUS

    p = _Parser(prog="commpress", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train the reference GPT with dp × tp × pp and a policy")
    _add_train_options(tr)
    tr.add_argument("--json", type=_path, default=None,
                    help="also write the summary to this JSON file")
    tr.set_defaults(fn=_cmd_train)

    cmp = sub.add_parser("compare", help="the same run under several policies, side by side")
    cmp.add_argument("--policies", default="none,naive,hybrid,sdp4bit,zeropp",
                     help="comma-separated policies (default: none,naive,hybrid,sdp4bit,zeropp)")
    _add_train_options(cmp, skip=("policy",))
    cmp.add_argument("--json", type=_path, default=None,
                     help="write every summary to this JSON file")
    cmp.set_defaults(fn=_cmd_compare)

    sim = sub.add_parser("simulate", help="one process plays an N-rank data-parallel run: the "
                         "loss a policy gives, before renting the cluster")
    sim.add_argument("--ranks", type=int, default=8,
                     help="data-parallel ranks to play, each of --pp stages (default: 8)")
    sim.add_argument("--policies", default=None,
                     help="comma-separated policies to compare (a table and plots); "
                          "default: --policy alone")
    _add_train_options(sim, skip=SIMULATE_SKIPS, helps=SIMULATE_HELPS)
    sim.add_argument("--json", type=_path, default=None,
                     help="also write the summary to this JSON file")
    sim.set_defaults(fn=_cmd_simulate)

    pl = sub.add_parser("plan", help="predict step time and speedup of policies on a cluster")
    pl.add_argument("--model", default="gpt-6.7b",
                    help="preset (gpt-125m … gpt-neox-20b, llama-7b/13b/70b) or a parameter "
                         "count such as 6.7e9")
    pl.add_argument("--gpus", type=int, default=64, help="GPUs in the job (default: 64)")
    pl.add_argument("--gpus-per-node", type=int, default=4,
                    help="GPUs per node, joined by the fast intra-node links (default: 4)")
    pl.add_argument("--dp", type=int, default=None, help="default: gpus / (tp · pp)")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    pl.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default: 1)")
    pl.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree of a mixture of experts, borrowed from dp "
                         "(default: 1)")
    pl.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3],
                    help="0: plain data parallel (DDP, commpress.ddp_hook); 1-3: ZeRO")
    pl.add_argument("--micro-batch", type=int, default=1,
                    help="sequences per micro-batch and rank (default: 1)")
    pl.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: 2048)")
    pl.add_argument("--global-batch", type=int, default=256,
                    help="sequences per optimizer step, all ranks together (default: 256)")
    pl.add_argument("--recompute", action="store_true", help="activation recomputation")
    pl.add_argument("--gpu", default="a100", choices=sorted(GPUS),
                    help="GPU kind: peak TFLOPS, NVLink bandwidth, measured codec speeds")
    pl.add_argument("--tflops", type=float, default=None, help="peak TFLOPS per GPU (overrides "
                    "--gpu)")
    pl.add_argument("--mfu", type=float, default=0.4, help="fraction of peak achieved")
    pl.add_argument("--device", default="gpu", choices=["gpu", "cpu"],
                    help="which codec-throughput defaults apply")
    pl.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                    help="collective library (gloo's reduce-scatter costs an all-reduce)")
    pl.add_argument("--intra-bw", type=float, default=None,
                    help="one GPU's bandwidth to its node peers, GB/s per direction "
                         "(default: the GPU's NVLink)")
    pl.add_argument("--inter-bw", type=float, default=25.0,
                    help="a node's total injection bandwidth, GB/s per direction")
    pl.add_argument("--latency", type=float, default=None, help="network latency, µs")
    pl.add_argument("--overlap", default="none", choices=["none", "dp"],
                    help="dp: gradient reduction hidden behind backward (default: none)")
    pl.add_argument("--link-efficiency", type=float, default=1.0,
                    help="payload share of the inter-node link rate (TCP/Ethernet ≈ 0.94)")
    pl.add_argument("--policy", action="append", default=[],
                    help="policies to compare (repeat or comma-separate); none is always "
                         "computed")
    pl.add_argument("--outer", action="append", default=[],
                    help="DiLoCo presets across the nodes (repeat or comma-separate): each "
                         "node a site, DDP inside it; compute utilization per preset")
    pl.add_argument("--sync-every", type=int, default=32,
                    help="with --outer: inner steps between syncs, H (default: 32)")
    pl.add_argument("--fragments", type=int, default=1,
                    help="with --outer: Streaming DiLoCo's fragments (default: 1)")
    pl.add_argument("--outer-delay", type=int, default=0,
                    help="with --outer: inner steps a fragment's all-reduce overlaps")
    pl.add_argument("--codec-throughput", type=_path, default=None,
                    help="JSON from 'commpress bench codecs --json'")
    pl.add_argument("--json", type=_path, default=None,
                    help="also write the plan to this JSON file")
    pl.set_defaults(fn=_cmd_plan)

    tb = sub.add_parser("testbed", help="run train/compare on an emulated multi-node cluster "
                        "(network namespaces, shaped links; needs root and iproute2)")
    tb.add_argument("--nodes", type=int, default=2,
                    help="emulated nodes, one network namespace each (default: 2)")
    tb.add_argument("--ranks-per-node", type=int, default=2,
                    help="ranks started in each node (default: 2)")
    tb.add_argument("--bandwidth", default="50mbit", help="per node and direction, e.g. 50mbit")
    tb.add_argument("--latency", default=None, help="added one-way delay, e.g. 1ms")
    tb.add_argument("--link-stats", default=None, metavar="PATH",
                    help="write the bytes each node sent and received to this JSON file")
    tb.add_argument("command_args", nargs=argparse.REMAINDER,
                    help="-- train … or -- compare … (the ranks come from the testbed)")
    tb.set_defaults(fn=_cmd_testbed)

    demo = sub.add_parser("demo", help="round-trip every codec on a small tensor")
    demo.set_defaults(fn=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="what", required=True)
    bc = bsub.add_parser("codecs", help="codec throughput (GB/s) and error")
    bc.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"],
                    help="where the codecs run; default: cuda when a GPU is visible")
    bc.add_argument("--numel", type=int, default=1 << 22,
                    help="elements per tensor (default: 4194304)")
    bc.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                    help="dtype of the tensor encoded (default: bf16)")
    bc.add_argument("--codecs", default=None, help="';'-separated codec specs (default: all)")
    bc.add_argument("--iters", type=int, default=10,
                    help="timed calls per codec and direction (default: 10)")
    bc.add_argument("--no-reference", action="store_true",
                    help="skip the torch.compile reference quantizer")
    bc.add_argument("--json", type=_path, default=None, help="write the rows as JSON to this path")
    bc.set_defaults(fn=_cmd_bench_codecs)

    bcol = bsub.add_parser("collectives", help="compressed collectives beside torch's own "
                           "(nccl-tests style: time, algbw, busbw, codec and wire time)")
    bcol.add_argument("--nproc", type=int, default=4,
                      help="ranks to spawn (ignored under torchrun) (default: 4)")
    bcol.add_argument("--ranks-per-node", type=int, default=None,
                      help="ranks that share a node; default: all")
    bcol.add_argument("--sizes", default="1024,65536,1048576",
                      help="comma-separated elements per rank (default: 1024,65536,1048576)")
    bcol.add_argument("--codecs", default=None,
                      help="';'-separated codec specs; default: none, bf16, int8, int4, "
                           "int4:hadamard=128, int2")
    bcol.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                      choices=["cpu", "cuda"], help="where the tensors live; default: cuda when "
                      "a GPU is visible")
    bcol.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                      help="default: nccl on cuda, gloo on cpu")
    bcol.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                      help="element dtype (default: fp32)")
    bcol.add_argument("--iters", type=int, default=5, help="timed calls per row (default: 5)")
    bcol.add_argument("--json", type=_path, default=None, help="write the rows to this JSON file")
    bcol.set_defaults(fn=_cmd_bench_collectives)
    return p


def _print_error(message: str) -> None:
    from rich.markup import escape

    from commpress.console import console

    console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    import logging

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (TestbedError, InputError) as e:  # bad input: a message, no traceback
        _print_error(str(e))
        return 2
    except RunFailedError as e:  # the run ended but trained nothing: one line, no traceback
        _print_error(str(e))
        return 1
    except LaunchError as e:  # a rank failed: its message first, its traceback after
        head, _, tail = str(e).partition("\n")
        if e.bad_input:  # a rank refused its input (a file, a checkpoint): no traceback
            _print_error(head)
            return 2
        from commpress.console import console

        console(stderr=True).print(tail, markup=False, highlight=False)
        _print_error(head)
        return 1


if __name__ == "__main__":
    sys.exit(main())
