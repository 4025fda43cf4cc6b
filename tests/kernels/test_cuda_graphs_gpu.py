"""fa4dist.attention captured in a CUDA graph (forward and backward under torch.cuda.graph, torch's whole-step
capture recipe) on the GPU: each replay, on new values copied into the static inputs, gives the bytes of an eager
call on those values (deterministic backward). Short sequences are host bound (bench/RESULTS.md, fortieth
session: ~1.1 ms of host per forward+backward at 16 x 1k): a graph replays the launches without it.

Dense calls read no tensor values on the host, so they capture as they are. A packed call reads its cu_seqlens'
values once per tensor (problem.py remembers them): a graph captured after one eager call on the same cu_seqlens
tensor replays that layout. Boundaries written into the tensor later would reach the replayed kernels with the grid
and tiles chosen on the host for the old ones (wrong results): capture again after changing them, as for any host
decision frozen in a graph."""

import bench_scripts
import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

import fa4dist  # noqa: E402

BF16 = torch.bfloat16


def _replays_equal_eager(step_of, leaves, fresh_values, rounds=2):
    """Captures ``step_of(*leaves)``; each round copies new values into the static leaves (and dout), replays, and
    compares the result and the leaves' gradients with an eager call on copies of the same values, byte for
    byte."""
    graph, static_out = bench_scripts.load("cuda_graphs").capture(lambda: step_of(*leaves), leaves)
    for r in range(rounds):
        with torch.no_grad():
            for t, new in zip(leaves, fresh_values(r)):
                t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        got = [static_out.clone()] + [t.grad.clone() for t in leaves]
        copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        want = [step_of(*copies).detach()] + [t.grad for t in copies]
        for name, a, b in zip(["out"] + [f"grad {i}" for i in range(len(leaves))], got, want):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == BF16 else a,
                                                      b.view(torch.uint8) if b.dtype == BF16 else b), \
                f"round {r}: the replay's {name} differs from the eager call's bytes"


def _rand(gen, *shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


@pytest.mark.parametrize("d, heads_kv, causal, sinks", [(128, 16, True, False), (64, 8, False, False),
                                                        (128, 4, True, True)])
def test_a_captured_dense_step_replays_the_eager_bytes(d, heads_kv, causal, sinks):
    gen = torch.Generator(device="cuda").manual_seed(d + heads_kv)
    shapes = [(2, 1024, 16, d), (2, 1024, heads_kv, d), (2, 1024, heads_kv, d)]
    leaves = [_rand(gen, *s).requires_grad_() for s in shapes]
    if sinks:
        leaves.append(_rand(gen, 16, dtype=torch.float32).requires_grad_())
    dout = _rand(gen, *shapes[0])

    def step(q, k, v, s=None):
        out = fa4dist.attention(q, k, v, causal=causal, sinks=s, deterministic=True)
        out.backward(dout)
        return out

    def fresh(r):
        with torch.no_grad():
            dout.copy_(_rand(gen, *shapes[0]))
        return [_rand(gen, *t.shape, dtype=t.dtype) for t in leaves]

    _replays_equal_eager(step, leaves, fresh)


def test_a_captured_packed_step_replays_its_layout():
    """A packed call on one cu_seqlens tensor (documents of 300, 1000 and 748 tokens), captured after eager calls
    on it: the replays give the eager bytes."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    cu = torch.tensor([0, 300, 1300, 2048], device="cuda", dtype=torch.int32)
    leaves = [_rand(gen, 2048, h, 128).requires_grad_() for h in (8, 2, 2)]
    dout = _rand(gen, 2048, 8, 128)

    def step(q, k, v):
        out = fa4dist.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, deterministic=True)
        out.backward(dout)
        return out

    def fresh(r):
        with torch.no_grad():
            dout.copy_(_rand(gen, 2048, 8, 128))
        return [_rand(gen, *t.shape) for t in leaves]

    _replays_equal_eager(step, leaves, fresh)


def test_torch_compile_reduce_overhead_replays_the_eager_bytes():
    """torch.compile(mode="reduce-overhead") records the traced attention (forward and backward, fa4dist's torch
    custom ops) in CUDA graphs and replays them on later calls: no graph is skipped, and every call's out and
    gradients are an eager call's bytes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator(device="cuda").manual_seed(11)
    compiled = torch.compile(lambda q, k, v: fa4dist.attention(q, k, v, causal=True, deterministic=True),
                             mode="reduce-overhead", fullgraph=True)
    for r in range(4):  # the cudagraph trees warm up, record, then replay
        q, k, v = (_rand(gen, 2, 1024, h, 128).requires_grad_() for h in (16, 4, 4))
        dout = _rand(gen, 2, 1024, 16, 128)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        got = [out.detach().clone()] + [g.clone() for g in grads]  # (a replay reuses the graph's outputs)
        copies = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        eager = fa4dist.attention(*copies, causal=True, deterministic=True)
        want = [eager.detach()] + list(torch.autograd.grad(eager, copies, dout))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                f"call {r}: the compiled call's {name} differs from the eager call's bytes"
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    assert skips == 0, f"torch.compile skipped CUDA graphs {skips} time(s) for fa4dist.attention"
