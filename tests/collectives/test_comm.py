"""The wait at interpreter exit that keeps Gloo's late workers from aborting a finished
script: armed by any process group the process had, also one made and destroyed by torch
alone (a torch ZeroRedundancyOptimizer or DDP loop beside commpress)."""

import subprocess
import sys

import pytest

SCRIPT = """
import os, tempfile
import torch.distributed as dist
import commpress
from commpress.collectives import comm
if {make_group}:
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method="file://" + tempfile.mktemp())
    dist.destroy_process_group()
print(comm._had_a_process_group())
"""


@pytest.mark.parametrize("make_group", [False, True])
def test_the_exit_wait_is_armed_by_a_group_torch_made_and_destroyed(make_group):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(make_group=make_group)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(make_group)
