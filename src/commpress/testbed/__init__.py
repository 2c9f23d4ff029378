"""An emulated cluster on one machine: network namespaces, shaped links, real ranks."""

from commpress.testbed.netns import Cluster, TestbedError
from commpress.testbed.run import run_on_testbed

__all__ = ["Cluster", "TestbedError", "run_on_testbed"]
