"""The emulated cluster: namespaces come up shaped, a run crosses them, nothing is left."""

import json
import os
import shutil
import subprocess

import pytest

from commpress.testbed.netns import Cluster, TestbedError, rate_bits
from commpress.testbed.run import run_on_testbed

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the testbed needs root and iproute2 (network namespaces, tc)")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_rate_parsing_and_bad_values():
    assert rate_bits("50mbit") == 5e7 and rate_bits("1gbit") == 1e9
    with pytest.raises(ValueError, match="bandwidth '50MB' is not allowed"):
        Cluster(2, "50MB")
    with pytest.raises(ValueError, match="latency 'soon' is not allowed"):
        Cluster(2, "50mbit", "soon")


@needs_root
def test_links_are_shaped_both_ways_and_removed():
    before = _namespaces()
    with Cluster(2, "20mbit") as c:
        assert {c.ns(0), c.ns(1), c.bridge_ns} <= _namespaces()
        for ns, dev in ((c.ns(0), "eth0"), (c.bridge_ns, f"{c.tag}b0")):
            qd = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                capture_output=True, text=True).stdout
            assert "tbf" in qd and "20Mbit" in qd, qd
        ping = subprocess.run(["ip", "netns", "exec", c.ns(0), "ping", "-c", "1", "-W", "2",
                               c.ip(1)], capture_output=True)
        assert ping.returncode == 0 or shutil.which("ping") is None
    assert _namespaces() == before


@needs_root
def test_training_runs_across_namespaces(tmp_path):
    before = _namespaces()
    code = run_on_testbed(2, 1, ["train", "--model", "gpt-tiny", "--seq-len", "32", "--steps",
                                 "3", "--eval-every", "0", "--eval-batches", "1", "--batch-size",
                                 "4", "--policy", "sdp4bit", "--out", str(tmp_path),
                                 "--no-progress"], bandwidth="100mbit", port=29533,
                          link_stats=str(tmp_path / "links.json"))
    assert code == 0
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["dp"] == 2 and "dp.grad.inter" in summary["wire_bytes"]
    # one rank per node: every collective byte crossed a link, plus TCP/IP framing,
    # the start-up rendezvous and the evaluation
    sent = sum(n["sent_bytes"] for n in json.load(open(tmp_path / "links.json"))["nodes"])
    payload = sum(summary["wire_bytes"].values())
    assert payload <= sent <= 2 * payload + 2e6
    assert _namespaces() == before


def test_refuses_other_commands():
    with pytest.raises(ValueError, match="allowed: train …, compare …"):
        run_on_testbed(2, 1, ["bench", "codecs"])


def test_needs_root_message(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root"):
        Cluster(2).up()


@needs_root
def test_a_latency_on_a_kernel_without_netem_is_said_with_what_to_do():
    before = _namespaces()
    try:
        with Cluster(2, "20mbit", "5ms") as c:
            qd = subprocess.run(["ip", "netns", "exec", c.ns(0), "tc", "qdisc", "show", "dev",
                                 "eth0"], capture_output=True, text=True).stdout
            assert "netem" in qd and "tbf" in qd, qd  # a kernel with netem: both in place
    except TestbedError as e:
        assert "needs the kernel's netem queueing discipline (sch_netem)" in str(e)
        assert "commpress plan --latency" in str(e)
    assert _namespaces() == before
