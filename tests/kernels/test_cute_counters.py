"""fa4dist.kernels.cute.counters: each launch's counter words are zero and its own (CounterPool on CPU tensors; the
CUDA streams and graph capture in test_cute_counters_gpu.py)."""

import pytest
import torch

from fa4dist.kernels.cute.counters import CounterPool, tile_counter, zeroed


def _pool(block_words=8):
    made = []

    def zeros(n):
        made.append(torch.zeros(n, dtype=torch.int32))
        return made[-1]

    return CounterPool(zeros, block_words), made


def _writes(t):
    t.fill_(7)  # a launch's claims: the next take must not see them


def test_every_take_is_zero_and_disjoint_from_the_others():
    pool, made = _pool(block_words=8)
    taken = []
    for n in (1, 3, 1, 2, 1, 5, 1):
        words = pool.take("stream", n)
        assert words.dtype == torch.int32 and words.shape == (n,) and words.is_contiguous()
        assert torch.equal(words, torch.zeros(n, dtype=torch.int32)), "a launch's counter words must start at zero"
        _writes(words)
        taken.append(words)
    spans = sorted((w.data_ptr(), w.data_ptr() + 4 * w.numel()) for w in taken)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:])), "two launches shared a counter word"
    # 1 + 3 + 1 + 2 = 7 words fit the first block; the 1 after them fills it; 5 takes a second block
    assert len(made) == 2 and made[0].numel() == 8


def test_a_run_longer_than_a_block_gets_a_block_of_its_own():
    pool, made = _pool(block_words=4)
    words = pool.take("stream", 10)
    assert words.numel() == 10 and made[-1].numel() == 10 and not words.any()


def test_streams_take_from_their_own_blocks():
    pool, made = _pool(block_words=4)
    a, b = pool.take("s1", 1), pool.take("s2", 1)
    assert len(made) == 2 and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_a_take_of_no_words_is_refused():
    pool, _ = _pool()
    with pytest.raises(ValueError, match="at least one counter word"):
        pool.take("stream", 0)


def test_cpu_devices_get_fresh_zeros():
    first = zeroed(3, torch.device("cpu"))
    _writes(first)
    assert not zeroed(3, torch.device("cpu")).any()
    assert tile_counter(False, torch.device("cpu")) is None
    assert tile_counter(True, torch.device("cpu")).shape == (1,)
