"""The ring backward's fused sum of returned partials (fa4dist/kernels/cute/sum_into.py) on the GPU: the bytes of
the in-place adds in turn, for any source count (more than one launch's worth too), with NaN, inf and signed
zeros; refused (False, nothing written) for what it does not take; and the ring's add_returns through it equal to
the returns added one after another."""

import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

from fa4dist.context_parallel import ring  # noqa: E402
from fa4dist.kernels.cute.sum_into import MAX_SOURCES, sum_into  # noqa: E402


def _random(n, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(n, device="cuda", generator=g) * scale * torch.logspace(-20, 20, n, device="cuda")
    return t


@pytest.mark.parametrize("sources", [1, 2, 7, MAX_SOURCES + 3])
@pytest.mark.parametrize("n", [4, 1000, 3 * 2**20 + 12])
def test_fused_sum_gives_the_bytes_of_the_adds_in_turn(sources, n):
    dst = _random(n, 1)
    srcs = [_random(n, 10 + i, scale=3.0 ** i) for i in range(sources)]
    if n >= 8:
        dst[0], srcs[0][1], srcs[-1][2], dst[3], srcs[0][3] = float("nan"), float("inf"), -0.0, -0.0, -0.0
    want = dst.clone()
    for s in srcs:
        want.add_(s)
    assert sum_into(dst, srcs)
    assert torch.equal(dst.view(torch.int32), want.view(torch.int32))


def test_fused_sum_refuses_what_it_does_not_take():
    dst = torch.zeros(1000, device="cuda")
    for bad in ([torch.zeros(1000, device="cuda", dtype=torch.float16)], [torch.zeros(1004, device="cuda")],
                [torch.zeros(2000, device="cuda")[::2]], []):
        before = dst.clone()
        assert not sum_into(dst, bad)
        assert torch.equal(dst, before)
    assert not sum_into(torch.zeros(1002, device="cuda"), [torch.zeros(1002, device="cuda")])  # not 4 | n


@pytest.mark.parametrize("packed", [False, True])
def test_ring_add_returns_on_cuda_equal_the_returns_in_turn(packed):
    tok = 0 if packed else 1
    shape = (lambda n: (n, 4, 64)) if packed else (lambda n: (1, n, 4, 64))
    g = torch.Generator(device="cuda").manual_seed(7)
    dk, dv = (torch.randn(shape(300), device="cuda", generator=g) for _ in range(2))
    returns = []
    for ranges in (((0, 100), (150, 50)), ((50, 200),), ((120, 180),), ((0, 300),)):
        incoming = ring.KVBuffer.empty(dk, dv, sum(n for _, n in ranges), tok)
        incoming.flat.copy_(torch.randn(incoming.flat.shape, device="cuda", generator=g))
        returns.append(ring.ReturningGrads(None, incoming, ranges, tok))
    want_k, want_v = dk.clone(), dv.clone()
    for r in returns:
        at = 0
        for start, n in r.ranges:
            want_k.narrow(tok, start, n).add_(r.incoming.k.narrow(tok, at, n))
            want_v.narrow(tok, start, n).add_(r.incoming.v.narrow(tok, at, n))
            at += n
    ring.add_returns(returns, dk, dv, tok)
    assert torch.equal(dk, want_k) and torch.equal(dv, want_v)
