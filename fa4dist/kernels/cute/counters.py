"""Zeroed int32 counters for the kernels' launches: a persistent grid's tile counter (tile_scheduler.TileClaims) and
the split launches' arrival counters, which must read zero when their launch starts.

A ``torch.zeros`` per launch made one allocation and one fill launch each time: 10-40 us of host per call on the
H200 machine (bench/host_profile.py, fortieth session: 40 us per torch.zeros in a forward+backward of 1.1 ms of host
at 16 x 1k, host bound). Instead each launch takes never-used words of a zeroed block that belongs to the current
stream (:class:`CounterPool`): one ``torch.zeros`` per ``BLOCK_WORDS`` words. A block is only ever used by launches
on the stream that zeroed it, so when it is dropped (a new block replaces it) the caching allocator's stream-ordered
reuse is safe, however far the host has run ahead.

Under CUDA graph capture every launch still gets a fresh ``torch.zeros``: a replay must find its counters zero
again, and the captured fill is what zeroes them.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, Optional

import torch

BLOCK_WORDS = 4096  # 16 KiB per stream in use


class CounterPool:
    """Hands out runs of zeroed int32 words, each word to one launch only, from one block per key (a stream);
    ``zeros(n)`` makes a block (of at least ``BLOCK_WORDS`` words) when the key's block has fewer than n left."""

    def __init__(self, zeros: Callable[[int], torch.Tensor], block_words: int = BLOCK_WORDS):
        self._zeros = zeros
        self._block_words = block_words
        self._blocks: dict = {}  # key -> [block, first unused word]
        self._lock = threading.Lock()  # two threads on one stream must not take the same words

    def take(self, key: Hashable, n: int) -> torch.Tensor:
        if n < 1:
            raise ValueError(f"a launch takes at least one counter word, got {n}")
        with self._lock:
            found = self._blocks.get(key)
            if found is None or found[1] + n > found[0].numel():
                found = self._blocks[key] = [self._zeros(max(self._block_words, n)), 0]
            start = found[1]
            found[1] = start + n
            return found[0][start:start + n]

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()


def _cuda_zeros(device: torch.device) -> Callable[[int], torch.Tensor]:
    return lambda n: torch.zeros(n, dtype=torch.int32, device=device)


_POOLS: dict = {}  # device -> CounterPool
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (CUDA builds; ~0.3 us against ~2 for
#                                                                    torch.cuda.current_stream())


def _stream_key(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def zeroed(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 words on ``device`` that read zero when the next launch on the current stream starts, for that
    launch alone (see the module's docstring)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS.setdefault(device, CounterPool(_cuda_zeros(device)))
    return pool.take(_stream_key(device), n)


def tile_counter(needed: bool, device: torch.device) -> Optional[torch.Tensor]:
    """A zeroed (1,) int32 tile counter for a persistent launch that claims its tiles (tile_scheduler.TileClaims),
    never shared with another launch; None where the launch takes none."""
    return zeroed(1, device) if needed else None
