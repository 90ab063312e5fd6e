"""Median wall time of a callable on a device, synchronising after each call."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, device, repeat: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    device.sync()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        device.sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)
