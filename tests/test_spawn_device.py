"""``spawn``'s device is an argument, not an environment variable the ranks read."""

import os

import pytest

from commpress.launch import spawn


def _environment_and_device(rank, world, device_type):
    import torch

    return os.environ.get("COMMPRESS_DEVICE"), device_type, torch.empty(1).device.type


def test_the_ranks_get_the_device_as_an_argument_and_no_environment_variable():
    for r in spawn(_environment_and_device, 2, ("cpu",), device="cpu"):
        assert r == (None, "cpu", "cpu")


def test_a_bad_device_is_refused_by_name():
    with pytest.raises(ValueError, match="device='gpu' is not allowed; allowed: cpu, cuda"):
        spawn(_environment_and_device, 1, ("gpu",), device="gpu")
