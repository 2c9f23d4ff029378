"""The kernels' configuration: resolved once per configuration and cached, overridden for
a block and restored after it, the environment read once, bad values refused by name."""

import dataclasses
import os
import subprocess
import sys
import threading

import pytest
import torch

from commpress import kernels
from commpress.kernels import config
from commpress.kernels.config import (
    KernelConfig,
    KernelEnvironment,
    override_kernels,
    resolve,
)


def test_resolution_is_cached_per_configuration_and_device_type():
    a = resolve("quantize", 4, 128, 128, "cpu")
    assert resolve("quantize", 4, 128, 128, torch.device("cpu")) is a
    assert resolve("quantize", 4, 128, 0, "cpu") is not a
    assert resolve("dequantize", 4, 128, 128, "cpu") is not a
    hits = config._resolve.cache_info().hits
    resolve("quantize", 4, 128, 128, "cpu")
    assert config._resolve.cache_info().hits == hits + 1


def test_the_configuration_is_frozen_and_checked():
    cfg = resolve("quantize", 8, 128, 0, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.row_kernels = False
    with pytest.raises(ValueError, match="fp32_dot='tf16'.*ieee, tf32x3"):
        KernelConfig(backend="triton", fp32_dot="tf16")
    with pytest.raises(ValueError, match="backend='cuda'.*reference, triton"):
        KernelConfig(backend="cuda")
    assert KernelConfig(**cfg.to_dict()) == cfg  # round-trips through a dict
    assert KernelConfig(backend="reference").to_dict()["tile"] == config.TILE_ELEMENTS


def test_override_changes_the_block_and_restores_the_choices_after_it():
    before = resolve("quantize", 4, 128, 128, "cpu")
    assert before.row_kernels and before.fp32_dot == "ieee" and before.backend == "reference"
    with override_kernels(row_kernels=False, tile=8192, kernels="triton"):
        inner = resolve("quantize", 4, 128, 128, "cpu")
        assert (inner.row_kernels, inner.tile, inner.backend) == (False, 8192, "triton")
        with override_kernels(fp32_dot="tf32x3", tile=2048):  # nested: merged, inner wins
            nested = resolve("quantize", 4, 128, 128, "cpu")
            assert (nested.row_kernels, nested.tile, nested.fp32_dot) == (False, 2048, "tf32x3")
        assert resolve("quantize", 4, 128, 128, "cpu") is inner
    assert resolve("quantize", 4, 128, 128, "cpu") is before
    with pytest.raises(RuntimeError), override_kernels(row_kernels=False):
        raise RuntimeError("a failure inside the block")
    assert resolve("quantize", 4, 128, 128, "cpu") is before


def test_override_reaches_other_threads():
    # the DDP hook encodes on its own thread: the override is process-wide
    seen = []
    with override_kernels(row_kernels=False):
        t = threading.Thread(target=lambda: seen.append(resolve("dequantize", 8, 64, 64)))
        t.start()
        t.join()
    assert seen[0].row_kernels is False


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("kernels", "fast", "auto, reference, triton"),
    ("fp32_dot", "tf16", "ieee, tf32x3"),
    ("row_kernels", "yes", "True, False"),
    ("tile", 1000, "a power of two"),
    ("warps", 0, "a power of two"),
    ("reference_piece", -1, "an integer >= 1"),
])
def test_override_refuses_a_bad_value_by_name(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field}={value!r} is not valid; allowed: {allowed}"):
        with override_kernels(**{field: value}):
            pass


def test_backend_choice():
    with override_kernels(kernels="triton"):
        assert resolve("quantize", 4, 128, 0, "cpu").backend == "triton"
        assert resolve("quantize", 4, 100, 0, "cpu").backend == "reference"  # unsupported
        assert resolve("trits_quantize", 2, 512, 0, "cpu").backend == "reference"
        assert kernels.backend_for(torch.device("cpu"), 4, 128, 0).__name__.endswith(
            "triton_quant")
    with override_kernels(kernels="auto"):
        assert resolve("quantize", 4, 128, 0, "cpu").backend == "reference"
        assert resolve("quantize", 4, 128, 0, "cuda").backend == "triton"
    with override_kernels(kernels="reference"):
        assert resolve("quantize", 4, 128, 0, "cuda").backend == "reference"
    with pytest.raises(ValueError, match="kernel='quantise' is not valid"):
        resolve("quantise", 4, 128, 0)


def test_tiles_hold_the_group_and_the_block():
    assert resolve("quantize", 4, 128, 128).tile == config.TILE_ELEMENTS
    with override_kernels(tile=64):
        assert resolve("quantize", 4, 128, 256).tile == 256
        assert resolve("trits_quantize", 2, 128, 0).tile == 16 * 128  # tl.dot: 16 groups


def test_the_gpu_measurements_apply_on_the_gpu_they_were_taken_on_only(monkeypatch):
    for hip, capability, tuned in ((None, (9, 0), True), (None, (8, 0), False),
                                   ("6.2", (9, 0), False)):  # A100, ROCm: the defaults
        with monkeypatch.context() as m:
            m.setattr(torch.version, "hip", hip)
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
            config.tuned_device.cache_clear()
            assert config.tuned_device("cuda", 0) is tuned
            assert config.tuned_device("cpu", None) is False
    config.tuned_device.cache_clear()
    assert config.tuned_device("cuda", 0) is False  # no GPU on this machine


def test_the_gpu_measurements_apply_where_tuned_and_overrides_win(monkeypatch):
    monkeypatch.setattr(config, "tuned_device", lambda device_type, index:
                        device_type == "cuda")
    on_gpu = resolve("quantize", 4, 128, 128, "cuda")
    assert (on_gpu.tile, on_gpu.warps, on_gpu.row_kernels) == (8192, 4, False)
    assert resolve("dequantize_sum", 4, 128, 128, "cuda").fp32_dot == "tf32x3"
    on_cpu = resolve("quantize", 4, 128, 128, "cpu")
    assert (on_cpu.tile, on_cpu.warps, on_cpu.row_kernels) == (config.TILE_ELEMENTS,
                                                                config.DEFAULT_WARPS, True)
    untuned = resolve("quantize", 4, 256, 0, "cuda")  # not measured: the defaults
    assert (untuned.tile, untuned.row_kernels) == (config.TILE_ELEMENTS, True)
    with override_kernels(tile=2048, row_kernels=True, fp32_dot="ieee"):
        assert resolve("quantize", 4, 128, 128, "cuda").tile == 2048
        assert resolve("quantize", 4, 128, 128, "cuda").row_kernels is True
        assert resolve("dequantize_sum", 4, 128, 128, "cuda").fp32_dot == "ieee"
    for key in config.TUNED:  # every entry is a valid configuration of a known kernel
        assert resolve(*key, "cuda").backend in config.BACKENDS


def _calls(fn) -> set[str]:
    """The names of the Python functions ``fn`` runs (the interpreter runs each Triton
    kernel's own function)."""
    names = set()
    sys.setprofile(lambda frame, event, arg: names.add(frame.f_code.co_name)
                   if event == "call" else None)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="a kernel runs as a Python call only in the Triton interpreter, "
                    "which the test setup turns on")
def test_the_one_switch_picks_the_kernel_family():
    pytest.importorskip("triton")
    x = torch.randn(4096)
    with override_kernels(kernels="triton"):
        rows = _calls(lambda: kernels.quantize(x, bits=4, group=128, hadamard=128))
        with override_kernels(row_kernels=False):
            flat = _calls(lambda: kernels.quantize(x, bits=4, group=128, hadamard=128))
    assert "_quantize_rows_kernel" in rows and "_quantize_kernel" not in rows
    assert "_quantize_kernel" in flat and "_quantize_rows_kernel" not in flat


def test_environment_parsing_names_the_variable_the_value_and_the_choices():
    assert KernelEnvironment.from_environ({}) == KernelEnvironment("auto", False)
    env = KernelEnvironment.from_environ({"COMMPRESS_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    assert env == KernelEnvironment("triton", True)
    with pytest.raises(ValueError, match="COMMPRESS_KERNELS='fast' is not valid; "
                                         "allowed: auto, reference, triton"):
        KernelEnvironment.from_environ({"COMMPRESS_KERNELS": "fast"})


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_the_environment_is_read_once_at_first_use():
    code = """
import os
from commpress.kernels.config import resolve
first = resolve("quantize", 4, 128, 0, "cpu").backend
os.environ["COMMPRESS_KERNELS"] = "reference"
later = resolve("quantize", 8, 128, 0, "cpu").backend  # another key: resolved afresh
print(first, later)
"""
    proc = _python(code, COMMPRESS_KERNELS="triton", TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["triton", "triton"]


def test_a_bad_environment_value_is_refused_at_first_use():
    code = """
import torch
import commpress  # importing reads nothing
from commpress import kernels
kernels.quantize(torch.randn(256), bits=8, group=128)
"""
    proc = _python(code, COMMPRESS_KERNELS="fast")
    assert proc.returncode != 0
    assert ("InputError: COMMPRESS_KERNELS='fast' is not valid; allowed: auto, reference, "
            "triton") in proc.stderr
