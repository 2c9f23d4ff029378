"""commpress's DDP hooks against torch's PowerSGD rank 4, head to head on the testbed.

    python benchmarks/ddp_vs_powersgd.py [--bandwidth 50mbit] [--seeds 0,1,2]
        [--steps 30] [--models gpt,torchnn] [--hooks powersgd-r4,lowrank-r16-int8,...]

The front (``ddp_front.py``) on one link: every hook trains ``--steps`` steps there,
seed by seed with the hooks interleaved, and the table gives step time (median of the
timed steps, then of the seeds) and validation loss (mean ± std over the seeds) of each.
Writes ``results/ddp_vs_powersgd.{json,md,png}``. Needs root and iproute2.
"""

from __future__ import annotations

import argparse

import ddp_front

PAIR = "powersgd-r4,lowrank-r4-int8,lowrank-r16-int8"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bandwidth", default="50mbit")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default="gpt,torchnn")
    ap.add_argument("--hooks", default=PAIR)
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    ddp_front.main(["--links", args.bandwidth, "--seeds", args.seeds, "--models", args.models,
                    "--hooks", args.hooks, "--loss-steps", str(args.steps),
                    "--name", "ddp_vs_powersgd", *(["--fresh"] if args.fresh else [])])


if __name__ == "__main__":
    main()
