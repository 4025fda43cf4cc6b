"""Timing for the GPU benchmarks: the median of CUDA-event timed repetitions after one warm-up call."""

from __future__ import annotations

import statistics

import torch


def cuda_median_ms(fn, reps: int, device=None) -> float:
    """Milliseconds: ``fn()`` once to warm up, then the median of ``reps`` calls, each timed between two CUDA events
    on the current stream (``device``: the device to synchronize, default the current one)."""
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
