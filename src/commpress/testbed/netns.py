"""Network namespaces joined by a bridge through shaped veth pairs.

One namespace per node holds that node's ranks; they talk to each other over the
namespace's own stack (local delivery, full speed). Each node reaches the others
through a veth pair into a bridge namespace, shaped in **both** directions with
``tc … tbf`` (and ``netem`` delay when a latency is asked for): a node's NIC.

Addresses are private (``10.213.<id>.0/24``) and exist only inside the namespaces
created here; everything is removed on exit, on error and on Ctrl-C. Needs root and
iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

from commpress.validate import InputError, check_int

RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
DELAY_RE = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")


class TestbedError(RuntimeError):
    """The testbed cannot run here (no root, no iproute2) or a command failed."""

    __test__ = False  # not a pytest test class, despite the name


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise TestbedError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _netem_missing(tc_error: str) -> bool:
    """Whether tc failed because the kernel has no netem (not a bad argument)."""
    return any(words in tc_error for words in ("Unknown qdisc", "qdisc kind is unknown",
                                               "No such file or directory", "not supported"))


def check_requirements() -> None:
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces and tc); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the testbed needs '{tool}' from iproute2: "
                               "apt-get install iproute2")


def rate_bits(rate: str) -> float:
    """'50mbit' → 5e7 bits per second."""
    m = RATE_RE.match(rate)
    bits = 0.0
    if m:
        scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
        bits = float(rate[: -len(m.group(2))]) * scale
    if not bits > 0:  # 0mbit: a link that never sends
        raise InputError(f"bandwidth {rate!r} is not allowed; allowed: a positive number with "
                         "bit, kbit, mbit or gbit, e.g. 50mbit")
    return bits


@dataclass
class Cluster:
    """``nodes`` namespaces with shaped links; use as a context manager."""

    nodes: int
    bandwidth: str = "50mbit"
    latency: str | None = None
    net_id: int = field(default_factory=lambda: 16 + os.getpid() % 200)
    _made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, ge=1, le=64)
        rate_bits(self.bandwidth)
        if self.latency is not None and not DELAY_RE.match(self.latency):
            raise InputError(f"latency {self.latency!r} is not allowed; allowed: e.g. 1ms, 500us")
        self.tag = f"cp{self.net_id}"

    def ns(self, node: int) -> str:
        return f"{self.tag}n{node}"

    def ip(self, node: int) -> str:
        return f"10.213.{self.net_id}.{node + 1}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}br"

    def _shape(self, ns: str, dev: str) -> None:
        burst = max(32 * 1024, int(rate_bits(self.bandwidth) / 8 / 250))  # ≥ 4 ms of traffic
        tbf = ["tbf", "rate", self.bandwidth, "burst", str(burst), "latency", "200ms"]
        if self.latency:
            try:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                     "handle", "1:", "netem", "delay", self.latency)
            except TestbedError as e:
                if not _netem_missing(str(e)):
                    raise
                raise TestbedError(
                    f"latency {self.latency!r} needs the kernel's netem queueing discipline "
                    "(sch_netem), which this kernel does not have (tc: "
                    f"{str(e).rsplit('failed: ', 1)[-1]}); allowed here: no latency (the "
                    "links are still shaped to the bandwidth), with `commpress plan "
                    "--latency` to model it, or a kernel with sch_netem (modprobe "
                    "sch_netem)") from None
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:",
                 "handle", "2:", *tbf)
        else:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def up(self) -> Cluster:
        check_requirements()
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        self._made.append(br)
        _run("ip", "netns", "exec", br, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", br, "ip", "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, node_dev, br_dev = self.ns(i), f"{self.tag}a{i}", f"{self.tag}b{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "link", "add", node_dev, "type", "veth", "peer", "name", br_dev)
            _run("ip", "link", "set", node_dev, "netns", ns)
            _run("ip", "link", "set", br_dev, "netns", br)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", node_dev, "name", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev",
                 "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", br, "ip", "link", "set", br_dev, "master", "br0")
            _run("ip", "netns", "exec", br, "ip", "link", "set", br_dev, "up")
            self._shape(ns, "eth0")  # node → network
            self._shape(br, br_dev)  # network → node
        return self

    def link_bytes(self, node: int) -> tuple[int, int]:
        """Bytes node ``node`` has sent and received on its link so far."""
        def read(counter: str) -> int:
            out = subprocess.run(["ip", "netns", "exec", self.ns(node), "cat",
                                  f"/sys/class/net/eth0/statistics/{counter}"],
                                 capture_output=True, text=True, check=True)
            return int(out.stdout)
        return read("tx_bytes"), read("rx_bytes")

    def down(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __enter__(self) -> Cluster:
        self._old_int = signal.getsignal(signal.SIGINT)
        self._old_term = signal.getsignal(signal.SIGTERM)

        def _interrupt(signum, frame):
            self.down()
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _interrupt)
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
        signal.signal(signal.SIGINT, self._old_int)
        signal.signal(signal.SIGTERM, self._old_term)
