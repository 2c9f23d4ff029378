"""Wall-clock timing that is honest on CUDA (synchronize) and stable on CPU (median)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int = 2,
                   iters: int = 10, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` over ``iters`` runs after ``warmup`` runs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    start_all = time.perf_counter()
    while len(times) < iters or time.perf_counter() - start_all < min_time:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
