"""The kernels' counter words from fa4dist.kernels.cute.counters on the GPU: persistent launches through many pool
blocks, and on two streams at once, give the bytes of the first call (deterministic backward)."""

import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

import fa4dist  # noqa: E402
from fa4dist.kernels.cute import counters  # noqa: E402

BF16 = torch.bfloat16


def _inputs(seed, b=2, s=1024, h=16, d=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=BF16, generator=gen) for _ in range(4)]


def _step(q, k, v, dout, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa4dist.attention(*leaves, causal=causal, deterministic=True)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _same_bytes(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("causal", [True, False])
def test_calls_through_many_small_blocks_give_the_same_bytes(monkeypatch, causal):
    q, k, v, dout = _inputs(3)
    first = _step(q, k, v, dout, causal)
    small = counters.CounterPool(lambda n: torch.zeros(n, dtype=torch.int32, device="cuda"), block_words=3)
    monkeypatch.setitem(counters._POOLS, q.device, small)
    for i in range(7):  # each forward+backward takes 2+ words: a new block every call or two
        assert _same_bytes(_step(q, k, v, dout, causal), first), f"call {i} through a fresh block differs"
    torch.cuda.synchronize()
    assert small._blocks, "the persistent launches took no words from the pool"


def test_two_streams_at_once_give_the_bytes_of_one():
    q, k, v, dout = _inputs(5)
    want = _step(q, k, v, dout, True)
    streams = [torch.cuda.Stream() for _ in range(2)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for _ in range(3):  # enqueued alternately, so both streams' launches overlap on the GPU
        for s in streams:
            with torch.cuda.stream(s):
                results.append(_step(q, k, v, dout, True))
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for i, got in enumerate(results):
        assert _same_bytes(got, want), f"call {i} (stream {i % 2}) differs from the single-stream bytes"
