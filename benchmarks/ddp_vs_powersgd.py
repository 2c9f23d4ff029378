"""commpress's DDP hook against torch's PowerSGD rank 4, head to head on the testbed.

    python benchmarks/ddp_vs_powersgd.py [--bandwidth 50mbit] [--repeats 3] [--steps 20]

The single timed run per cell in testbed_peers.py leaves a few percent of noise; here
the two hooks alternate, each run timing --steps steps on the 2 × 2 testbed, and the
table gives every run's median step time. Writes results/ddp_vs_powersgd.md.
Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import statistics

from _common import write_markdown
from testbed_peers import CONFIGS, shaped_step_time

PAIR = ("ddp PowerSGD rank 4", "ddp commpress int2ef")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", default="50mbit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in PAIR}
    for i in range(args.repeats):
        for name in PAIR:
            print(f"[{i}] {name} @ {args.bandwidth}", flush=True)
            times[name].append(shaped_step_time(name, CONFIGS[name], args.bandwidth, args.steps))
    lines = [f"| hook | step s @ {args.bandwidth}, each run | median | vs PowerSGD rank 4 |",
             "|---|---|---|---|"]
    ref = statistics.median(times[PAIR[0]])
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {', '.join(f'{t:.3f}' for t in ts)} | {med:.3f} | "
                     f"{med / ref - 1:+.1%} |")
    write_markdown("ddp_vs_powersgd.md", lines)


if __name__ == "__main__":
    main()
