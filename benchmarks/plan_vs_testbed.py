"""Check ``commpress plan`` against the emulated-cluster measurements.

    python benchmarks/plan_vs_testbed.py [--codec-throughput results/codecs_cpu.json]

Reads results/testbed_peers.json (from testbed_peers.py) and predicts the shaped step
time of every ZeRO and 3D configuration with the cost model: 2 nodes × 2 ranks, the
link's bandwidth as the node's injection bandwidth, fp32 training, compute calibrated
once per family from the uncompressed run without shaping (``sharded none`` for ZeRO,
``3D dp2×tp2 none`` for 3D), codec time from the measured CPU codec throughputs,
Gloo's reduce-scatter modeled as its all-reduce (``backend="gloo"``).
Writes results/plan_vs_testbed.md.
"""

from __future__ import annotations

import argparse
import json
import os

from _common import RESULTS

from commpress.plan.cost import ClusterSpec, JobSpec, load_codec_throughput, plan_policy
from commpress.plan.models import ModelShape
from commpress.policy import Policy

MODEL = ModelShape(layers=6, hidden=192, heads=6, vocab=256, params_override=2_743_296)
CASES = {"sharded none": ("none", 1), "sharded zeropp": ("zeropp", 1),
         "sharded sdp4bit": ("sdp4bit", 1), "3D dp2×tp2 none": ("none", 2),
         "3D dp2×tp2 naive": ("naive", 2), "3D dp2×tp2 hybrid": ("hybrid", 2)}
LOOPBACK_GBps = 1.0  # Gloo over loopback TCP between processes, measured order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec-throughput", default=os.path.join(RESULTS, "codecs_cpu.json"))
    args = ap.parse_args()
    res = json.load(open(os.path.join(RESULTS, "testbed_peers.json")))
    codec_tp = (load_codec_throughput(args.codec_throughput)
                if os.path.exists(args.codec_throughput) else {})
    lines = ["| configuration | bandwidth | measured s | predicted s | error |",
             "|---|---|---|---|---|"]
    errors = []
    for name, (policy, tp) in CASES.items():
        if name not in res:
            continue
        base = res["sharded none" if tp == 1 else "3D dp2×tp2 none"]
        tokens = 8 * 128
        compute_s = base["unshaped_step_s"]
        tflops = 6 * MODEL.params * tokens / 4 / compute_s / 1e12
        for bw, measured in res[name].get("step_s", {}).items():
            inter = float(bw.removesuffix("mbit")) * 1e6 / 8 / 1e9
            c = ClusterSpec(gpus=4, gpus_per_node=2, intra_GBps=LOOPBACK_GBps, inter_GBps=inter,
                            tflops=tflops, mfu=1.0, intra_latency_us=50, inter_latency_us=200,
                            device="cpu", backend="gloo", codec_GBps=codec_tp)
            j = JobSpec(model=MODEL, dp=4 // tp, tp=tp, pp=1, micro_batch=8 // (4 // tp),
                        seq=128, global_batch=8, param_bytes=4, act_bytes=4)
            pred = plan_policy(c, j, Policy.preset(policy))["step_time_s"]
            err = pred / measured - 1
            errors.append(abs(err))
            lines.append(f"| {name} | {bw} | {measured:.3f} | {pred:.3f} | {err:+.0%} |")
    within = sum(e <= 0.25 for e in errors)
    lines.append("")
    lines.append(f"{within} of {len(errors)} predictions within ±25%.")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "plan_vs_testbed.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
