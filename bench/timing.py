"""Timing for the GPU benchmarks: the median of CUDA-event timed repetitions after one warm-up call."""

from __future__ import annotations

import os
import statistics
import sys

import torch


_SPIN_RATES: dict = {}


def require_cuda(script: str) -> None:
    """Exits naming ``script`` when this machine has no CUDA GPU (a GPU benchmark failed deep inside torch)."""
    if not torch.cuda.is_available():
        sys.exit(f"bench/{script} needs a CUDA GPU")


def require_torchrun(script: str) -> None:
    """Exits naming ``script`` unless torchrun started this process (a KeyError on RANK otherwise)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit(f"bench/{script} runs one process per GPU under torchrun: torchrun --nproc-per-node N "
                 f"bench/{script} ...")


def spin_cycles_per_second(device=None) -> float:
    """The rate of torch.cuda._sleep's cycle count on ``device`` (default the current one), timed once."""
    index = None if device is None else torch.device(device).index
    key = torch.cuda.current_device() if index is None else index
    if key not in _SPIN_RATES:
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SPIN_RATES[key] = cycles / (start.elapsed_time(end) / 1e3)
    return _SPIN_RATES[key]


def cuda_median_ms(fn, reps: int, device=None, queue_ahead_ms: float = 0.0) -> float:
    """Milliseconds: ``fn()`` once to warm up, then the median of ``reps`` calls, each timed between two CUDA events
    on the current stream (``device``: the device to synchronize, default the current one).

    From an idle device (``queue_ahead_ms`` 0) a call's time includes the host's time before its first launch, as
    for a call nothing precedes. With ``queue_ahead_ms`` > 0 each call is queued behind a device-side spin of that
    length, so the host issues it while the device is still busy: device time alone (as inside a training step
    whose host runs ahead), as long as the host issues faster than the spin lasts."""
    fn()
    torch.cuda.synchronize(device)
    spin = int(queue_ahead_ms * 1e-3 * spin_cycles_per_second(device)) if queue_ahead_ms > 0 else 0
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin:
            torch.cuda._sleep(spin)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
