"""How the kernels run: one frozen :class:`KernelConfig` per (kernel, bits, group,
Hadamard block, device type), resolved once and cached.

The environment is read once, at the first resolution, and nowhere else:

``COMMPRESS_KERNELS``
    ``auto`` (default): the Triton kernels on CUDA where they support the
    configuration, the torch reference elsewhere. ``reference``: the reference
    everywhere (debugging, comparison). ``triton``: Triton on every device for every
    configuration it supports (on CPU that needs ``TRITON_INTERPRET=1``).
``TRITON_INTERPRET``
    Triton's own switch (``1``: its interpreter, on CPU). The interpreter's ``tl.dot``
    on bf16 operands is wrong, so there every product runs as an ieee fp32 one.

Tests and scripts change the choices for a block with :func:`override_kernels`; the
block restores the previous choices on exit (nested blocks too). The override is
process-wide, not a context variable: the DDP hook encodes on its own thread, which a
context variable set on the caller's thread would not reach. The rejected alternative,
module globals that scripts assign (a tile table, a row/flat switch, a product
precision) and an environment re-read on every call, let a test that forgot to restore
a value change every later test, and a value change in the middle of a run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from types import MappingProxyType

import torch

from commpress.validate import InputError

KERNELS_ENV = "COMMPRESS_KERNELS"
KERNEL_CHOICES = ("auto", "reference", "triton")
BACKENDS = ("reference", "triton")
# How fp32 operands multiply in tl.dot on the GPU: "ieee" (CUDA cores) or "tf32x3" (three
# tf32 tensor-core products, about fp32's accuracy). On the H200 ieee encoded fp32
# gradients faster (472 against 244 GB/s), tf32x3 decoded-and-summed 22x faster (545
# against 25 GB/s), both with the reference's codes and sums (TUNED).
FP32_DOTS = ("ieee", "tf32x3")
KERNELS = ("quantize", "dequantize", "dequantize_sum", "dequant_reduce_requant",
           "fp8_quantize", "fp8_dequantize", "trits_quantize", "trits_dequantize", "topk")
# The tile must give tl.dot at least 16 rows; 4096 elements per program keeps the
# interpreter quick on CPU and is the untuned start on the GPU.
TILE_ELEMENTS = 4096
DEFAULT_WARPS = 4
# The widest Hadamard block of the Triton kernels: an fp32 product with a 256-wide block
# holds its 256 KB matrix in shared memory, more than a Hopper GPU has (227 KB); wider
# blocks run in the reference.
MAX_HADAMARD = 128
# top-k: tiles of a histogram pass per program (fewer programs → fewer atomic adds)
HISTOGRAM_TILES = 4
# The reference runs long tensors in pieces of about this many elements: its several
# passes then stay in the CPU's caches (16 Mi elements at once ran 2-4x slower). The
# pieces are whole groups and blocks and keep their element indices for stochastic
# rounding: without Hadamard the codes are the same bytes; with it, the rotation's
# matrix product may round differently for another number of rows (as it may on another
# BLAS), so a code at a rounding tie may differ. Real and played runs call with the
# same sizes, so they still agree bit for bit.
REFERENCE_PIECE = 1 << 20
# (kernel, bits, group, hadamard) → the KernelConfig choices that beat the defaults on
# the H200 (``benchmarks/gpu_kernels.py --tune``: 64 Mi bf16 elements, tiles 2048–16384
# × 4 or 8 warps, median of 10; BENCHMARKS.md). Where the best was within 2 % of the
# default (4096 elements, 4 warps) the default stays. Only on the GPU they were measured
# on (compute capability TUNED_ON, CUDA not ROCm); other GPUs and the interpreter keep
# the defaults. With Hadamard blocks the flat-tile kernels beat the row kernels by
# 3–8 % at their best tiles; dequantize-reduce-requantize keeps the row kernels (2.1x
# the flat ones), dequantize-sum too (545 GB/s with tf32x3; flat measured only with
# ieee products, 110).
TUNED: Mapping[tuple[str, int, int, int], Mapping[str, object]] = MappingProxyType({
    ("quantize", 4, 128, 128): {"tile": 8192, "warps": 4, "row_kernels": False},  # 843 GB/s
    ("dequantize", 4, 128, 128): {"tile": 8192, "warps": 4, "row_kernels": False},  # 1141
    ("quantize", 8, 128, 128): {"tile": 16384, "warps": 8, "row_kernels": False},  # 1123
    ("dequantize", 8, 128, 128): {"tile": 16384, "warps": 8, "row_kernels": False},  # 1413
    ("fp8_quantize", 8, 128, 128): {"tile": 8192, "warps": 4},  # 830 (default 554)
    ("fp8_dequantize", 8, 128, 128): {"tile": 8192, "warps": 4},  # 1232 (default 465)
    ("quantize", 2, 128, 0): {"tile": 8192, "warps": 8},  # 1316 (default 1066)
    ("dequantize", 2, 128, 0): {"tile": 16384, "warps": 4},  # 1870 (default 1470)
    ("trits_quantize", 2, 128, 0): {"tile": 8192, "warps": 4},  # 957 (default 871)
    ("trits_dequantize", 2, 128, 0): {"tile": 8192, "warps": 4},  # 887 (default 820)
    ("dequantize_sum", 4, 128, 128): {"fp32_dot": "tf32x3"},  # 545 (ieee 25)
})
TUNED_ON = (9, 0)  # the H200's compute capability


@dataclass(frozen=True)
class KernelConfig:
    """How one kernel runs for one configuration and device type."""

    backend: str
    """``reference`` (torch) or ``triton``."""
    tile: int = TILE_ELEMENTS
    """Elements per program of the flat-tile kernels (a row kernel runs ``tile / width``
    rows, at least 16); at least the group and the Hadamard block."""
    warps: int = DEFAULT_WARPS
    """Warps per program."""
    row_kernels: bool = True
    """The family: True runs the row kernels (a group or block per row, no reshapes; the
    form of the 2500 GB/s prototype) where they apply, False the flat-tile kernels. Both
    give the same bytes; the GPU measurements choose."""
    fp32_dot: str = "ieee"
    """How a product of fp32 operands runs on the GPU (one of :data:`FP32_DOTS`)."""
    histogram_tiles: int = HISTOGRAM_TILES
    """Top-k: tiles per program of a histogram pass."""
    reference_piece: int = REFERENCE_PIECE
    """The reference runs tensors longer than twice this in pieces of about this many
    elements (see :data:`REFERENCE_PIECE`)."""

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        if not isinstance(self.row_kernels, bool):
            raise InputError(f"row_kernels={self.row_kernels!r} is not valid; "
                             "allowed: True, False")
        _check_choice("fp32_dot", self.fp32_dot, FP32_DOTS)
        for name in ("tile", "warps", "histogram_tiles"):
            _check_power_of_two(name, getattr(self, name))
        _check_positive("reference_piece", self.reference_piece)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(f"{name}={value!r} is not valid; allowed: {', '.join(allowed)}")


def _check_power_of_two(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
        raise InputError(f"{name}={value!r} is not valid; allowed: a power of two >= 1")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name}={value!r} is not valid; allowed: an integer >= 1")


@dataclass(frozen=True)
class KernelEnvironment:
    """The environment variables the kernels read (once)."""

    kernels: str = "auto"
    interpret: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> KernelEnvironment:
        choice = environ.get(KERNELS_ENV, "auto")
        _check_choice(KERNELS_ENV, choice, KERNEL_CHOICES)
        return cls(kernels=choice, interpret=environ.get("TRITON_INTERPRET", "0") == "1")


@functools.cache
def environment() -> KernelEnvironment:
    """The environment as read at the first call (a bad value raises on every call)."""
    return KernelEnvironment.from_environ(os.environ)


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``)."""
    return environment().interpret


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports(bits: int, group: int, hadamard: int, trits: bool = False) -> bool:
    """Whether the Triton kernels handle a configuration (else the caller uses the
    reference); ``trits``: int2 codes five per byte (groups of 16 … 256)."""
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if bits not in (2, 4, 8) or not pow2(group) or group < 8 // bits:
        return False
    if trits and not (bits == 2 and 16 <= group <= 256):
        return False
    if hadamard and (not pow2(hadamard) or not 16 <= hadamard <= MAX_HADAMARD):
        return False
    return max(group, hadamard) <= TILE_ELEMENTS


class _Overrides:
    """The active overrides, innermost last, each merged with those around it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack: list[tuple[tuple[str, object], ...]] = [()]

    def current(self) -> tuple[tuple[str, object], ...]:
        return self._stack[-1]

    @contextmanager
    def push(self, changes: dict[str, object]) -> Iterator[None]:
        with self._lock:
            entry = tuple(sorted({**dict(self._stack[-1]), **changes}.items()))
            self._stack.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._stack.remove(entry)


_OVERRIDES = _Overrides()


@contextmanager
def override_kernels(*, kernels: str | None = None, tile: int | None = None,
                     warps: int | None = None, row_kernels: bool | None = None,
                     fp32_dot: str | None = None, histogram_tiles: int | None = None,
                     reference_piece: int | None = None) -> Iterator[None]:
    """Change the kernel choices for the block (every kernel and configuration); the
    previous ones come back on exit.

    Args:
        kernels: as ``COMMPRESS_KERNELS`` (auto, reference, triton).
        tile, warps, histogram_tiles: launch sizes (powers of two) for every kernel.
        row_kernels: True for the row kernels, False for the flat-tile ones.
        fp32_dot: how fp32 operands multiply (ieee, tf32x3).
        reference_piece: the reference's piece length (elements, >= 1).

    Example::

        with override_kernels(row_kernels=False):
            codes, scales = commpress.kernels.quantize(x, bits=4, group=128, hadamard=128)
    """
    changes = {k: v for k, v in dict(kernels=kernels, tile=tile, warps=warps,
                                     row_kernels=row_kernels, fp32_dot=fp32_dot,
                                     histogram_tiles=histogram_tiles,
                                     reference_piece=reference_piece).items()
               if v is not None}
    if kernels is not None:
        _check_choice("kernels", kernels, KERNEL_CHOICES)
    # the other choices are checked by the config they become
    KernelConfig("reference", **{k: v for k, v in changes.items() if k != "kernels"})
    with _OVERRIDES.push(changes):
        yield


def resolve(kernel: str, bits: int = 0, group: int = 0, hadamard: int = 0,
            device: torch.device | str = "cpu") -> KernelConfig:
    """The :class:`KernelConfig` of ``kernel`` (one of :data:`KERNELS`) for a
    configuration on ``device`` (cached: the same object every call, until an
    override changes the choices)."""
    device = device if isinstance(device, torch.device) else torch.device(device)  # per call
    return _resolve(kernel, bits, group, hadamard, device.type,
                    tuned_device(device.type, device.index), _OVERRIDES.current())


@functools.lru_cache(maxsize=64)
def tuned_device(device_type: str, index: int | None) -> bool:
    """Whether :data:`TUNED` applies on this device: a CUDA GPU of the compute
    capability the measurements were taken on."""
    if device_type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(index) == TUNED_ON


@functools.lru_cache(maxsize=4096)
def _resolve(kernel: str, bits: int, group: int, hadamard: int, device_type: str,
             tuned_here: bool, overrides: tuple[tuple[str, object], ...]) -> KernelConfig:
    _check_choice("kernel", kernel, KERNELS)
    tuned = TUNED.get((kernel, bits, group, hadamard), {}) if tuned_here else {}
    chosen = {**tuned, **dict(overrides)}
    choice = chosen.pop("kernels", environment().kernels)
    tile = chosen.pop("tile", TILE_ELEMENTS)
    warps = chosen.pop("warps", DEFAULT_WARPS)
    if kernel.startswith("trits"):  # tl.dot needs 16 groups per tile
        tile = max(tile, 16 * group)
    backend = _backend(choice, kernel, bits, group, hadamard, device_type)
    return KernelConfig(backend=backend, tile=max(tile, group, hadamard), warps=warps,
                        **chosen)


def _backend(choice: str, kernel: str, bits: int, group: int, hadamard: int,
             device_type: str) -> str:
    """Triton when the choice and device ask for it and it supports the configuration
    (top-k's support depends on the tensor: its dispatcher checks it per call)."""
    if choice == "reference":
        return "reference"
    if not triton_available():
        if choice == "triton":
            raise ImportError(f"{KERNELS_ENV}=triton needs Triton: pip install triton")
        return "reference"
    if choice == "auto" and device_type != "cuda":
        return "reference"
    if kernel != "topk" and not supports(bits, group, hadamard,
                                         trits=kernel.startswith("trits")):
        return "reference"
    return "triton"


__all__ = ["FP32_DOTS", "KERNEL_CHOICES", "KERNELS", "KERNELS_ENV", "KernelConfig",
           "KernelEnvironment", "environment", "interpreting", "override_kernels", "resolve",
           "supports"]
