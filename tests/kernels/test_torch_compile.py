"""torch.compile over fa4dist.attention (kernels/torch_ops.py): one graph, no breaks, fullgraph=True works, and the
compiled outputs and gradients are the eager ones' bytes; the entry points that are not ops run eagerly behind a
graph break and give the eager bytes too. CPU with the reference backend ("aot_eager" traces exactly what
inductor receives, without its code generation; one test runs inductor itself); the cute kernels on the GPU."""

import pytest
import torch
import torch.nn.functional as F

import fa4dist
from fa4dist.kernels import attention_forward
from fa4dist.modules import FA4ContextParallelAttention


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model_step(attn_kwargs, heads=4, heads_kv=2, d=16):
    """A projection into q/k/v views (non-contiguous, as a model makes them), attention, a loss."""
    def step(x, w, sinks=None):
        qkv = (x @ w).unflatten(-1, (heads + 2 * heads_kv, d))
        q, k, v = qkv[..., :heads, :], qkv[..., heads:heads + heads_kv, :], qkv[..., heads + heads_kv:, :]
        kw = dict(attn_kwargs)
        if sinks is not None:
            kw["sinks"] = sinks
        return fa4dist.attention(q, k, v, **kw).square().mean()
    return step


def _inputs(shape_prefix, heads=4, heads_kv=2, d=16, sinks=False):
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    x = torch.randn(*shape_prefix, heads * d, generator=g, dtype=torch.float64)
    w = (torch.randn(heads * d, (heads + 2 * heads_kv) * d, generator=g, dtype=torch.float64) / 8).requires_grad_()
    s = torch.randn(heads, generator=g, dtype=torch.float64).requires_grad_() if sinks else None
    return x, w, s


def _eager_and_compiled(step, args, backend="aot_eager", fullgraph=True):
    wanted = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    eager = step(*args)
    g_eager = torch.autograd.grad(eager, wanted)
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)(*args)
    g_compiled = torch.autograd.grad(compiled, wanted)
    return (eager, *g_eager), (compiled, *g_compiled)


def _assert_same_bytes(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


CASES = {
    "causal GQA": (dict(causal=True, backend="reference"), (2, 48), False),
    "window, softcap, sinks": (dict(causal=True, window=(7, 0), softcap=5.0, backend="reference"), (1, 40), True),
    "offsets": (dict(causal=True, q_offset=16, k_offset=[0, 3], backend="reference"), (2, 24), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_is_one_graph_with_the_eager_bytes(name):
    attn_kwargs, prefix, sinks = CASES[name]
    x, w, s = _inputs(prefix, sinks=sinks)
    step = _model_step(attn_kwargs)
    args = (x, w, s) if sinks else (x, w)
    explain = torch._dynamo.explain(step)(*args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    eager, compiled = _eager_and_compiled(step, args)
    _assert_same_bytes(eager, compiled)


def test_packed_documents_compile():
    heads, heads_kv, d = 4, 2, 16
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    x = torch.randn(50, heads * d, generator=g, dtype=torch.float64)
    w = (torch.randn(heads * d, (heads + 2 * heads_kv) * d, generator=g, dtype=torch.float64) / 8).requires_grad_()
    cu = torch.tensor([0, 17, 17, 50], dtype=torch.int32)  # an empty document too
    step = _model_step(dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="reference"))
    eager, compiled = _eager_and_compiled(step, (x, w))
    _assert_same_bytes(eager, compiled)


def test_batch_and_document_count_stay_symbolic():
    """An int offset is every sequence's, so the trace reads neither the batch size nor the number of packed
    documents: mark_dynamic on the batch dim held (it raised "specialized it to be a constant"), and packed batches
    with other document counts reuse the graph (each count compiled again; fullgraph=True failed at the ninth)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(5)

    def f(q, k, v, cu=None):
        return fa4dist.attention(q, k, v, causal=True, q_offset=3, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 backend="reference")

    def grads(fn, q, k, v, cu=None):
        out = fn(q, k, v, cu)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    q, k, v = (torch.randn(30, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    for cu in ([0, 11, 30], [0, 4, 4, 30], [0, 1, 2, 9, 30]):
        cu = torch.tensor(cu, dtype=torch.int32)
        _assert_same_bytes(grads(compiled, q, k, v, cu), grads(f, q, k, v, cu))
    assert counter.frame_count == 1

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for batch in (2, 3):
        q, k, v = (torch.randn(batch, 12, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
                   for h in (2, 1, 1))
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 0)
        _assert_same_bytes(grads(compiled, q, k, v), grads(f, q, k, v))
    assert counter.frame_count == 1


def test_inductor_compiles_it():
    x, w, _ = _inputs((1, 32))
    step = _model_step(dict(causal=True, backend="reference"))
    eager, compiled = _eager_and_compiled(step, (x, w), backend="inductor")
    for a, b in zip(eager, compiled):  # inductor may order the loss's reduction and the projection's differently
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_return_lse_and_bad_input_under_compile():
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64) for _ in range(3))

    def f(q, k, v):
        return fa4dist.attention(q, k, v, causal=True, return_lse=True, backend="reference")

    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    ref_out, ref_lse = f(q, k, v)
    _assert_same_bytes((out, lse), (ref_out, ref_lse))

    # bad input: the eager call's errors, raised while tracing
    q2, k2, v2 = (torch.randn(2, 8, 2, 16, dtype=torch.float64) for _ in range(3))
    for args, kwargs, error, match in (
        ((q, k, v), dict(causal="yes"), TypeError, "causal must be a bool"),
        ((q2, k2, v2), dict(q_offset=[3]), ValueError, r"q_offset must have one entry per sequence/segment \(2\)"),
        ((q[0], k[0], v[0]), {}, ValueError, r"q must be 4-D \(batch, seqlen, heads, head_dim\)"),
        ((q, k[..., :8], v), {}, ValueError, "q and k must share the head dim"),
    ):
        torch._dynamo.reset()
        with pytest.raises(error, match=match):
            torch.compile(lambda *t: fa4dist.attention(*t, backend="reference", **kwargs), backend="aot_eager")(*args)


@pytest.fixture
def passes(monkeypatch):
    """The reference backend's backward passes, each recorded as whether it took a dlse."""
    from fa4dist.kernels import registry

    taken = []
    backend = type(registry.get_backend("reference"))
    original = backend.backward
    monkeypatch.setattr(backend, "backward", lambda *a, **kw: taken.append(kw.get("dlse") is not None) or
                        original(*a, **kw))
    return taken


def test_the_lse_is_differentiable_under_compile_as_in_eager(passes):
    """return_lse=True: a loss of out and lse has the eager call's gradients, compiled with fullgraph=True (the op's
    lse is differentiable when asked for, its gradient the backward op's dlse: one backward pass on the reference,
    as eager); the same bytes."""
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 8, dtype=torch.float64)

    def f(q, k, v):
        out, lse = fa4dist.attention(q, k, v, causal=True, return_lse=True, backend="reference")
        return out.square().sum() + (lse * w).sum()

    grads = [torch.autograd.grad(fn(q, k, v), (q, k, v))
             for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True))]
    _assert_same_bytes(grads[1], grads[0])
    assert passes == [True, True], passes  # one pass each, the lse's gradient in it
    lse_only = torch.autograd.grad((fa4dist.attention(q, k, v, causal=True, return_lse=True)[1] * w).sum(), q)[0]
    assert lse_only.abs().sum() > 0


@pytest.mark.parametrize("used", ["out", "lse"])
def test_an_unused_output_takes_no_gradient_under_compile_as_in_eager(passes, used):
    """return_lse=True where the compiled loss uses only one of out and lse: the op's autograd materialized the
    other's gradient as zeros, so a loss of out alone ran the backward with a zero dlse (on the sdpa backends, a
    second backward pass for nothing; eager passes None).  Now the unused gradient is None, as in eager: no dlse
    reaches the backend, and the gradients are the eager ones' bytes."""
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        out, lse = fa4dist.attention(q, k, v, causal=True, return_lse=True, backend="reference")
        return out.square().sum() if used == "out" else lse.square().sum()

    grads = [torch.autograd.grad(fn(q, k, v), (q, k, v))
             for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True))]
    _assert_same_bytes(grads[1], grads[0])
    assert passes == [used == "lse"] * 2, passes


@pytest.mark.parametrize("lse_grad", [False, True])
def test_the_ops_autograd_passes_gradcheck(lse_grad):
    """The op's autograd called eagerly (torch_ops.compiled_attention outside a trace) under gradcheck, which also
    runs the backward with every gradient undefined: with unused gradients None and dout=None meaning a loss of the
    lse alone, both None must give no gradients (not attention_backward's 'needs dout')."""
    from fa4dist.kernels import torch_ops

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 5, 4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 4, 2, 6, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    mask = dict(causal=True, window=(-1, -1), softcap=None, softmax_scale=None, q_offset=0, k_offset=0,
                cu_seqlens_q=None, cu_seqlens_k=None)
    fn = lambda q, k, v: torch_ops.compiled_attention(q, k, v, None, mask, "reference", None,  # noqa: E731
                                                      lse_grad=lse_grad)[0]
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def test_the_returned_lse_may_be_updated_in_place_under_compile():
    """return_lse=True and the lse's -inf rows zeroed in place inside the compiled function: the op's lse was also
    saved for its backward, and tracing failed with 'one of the variables needed for gradient computation has been
    modified by an inplace operation'.  Now the caller gets a copy (as eager): the eager call's bytes."""
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 8, dtype=torch.float64)

    def f(q, k, v):
        out, lse = fa4dist.attention(q, k, v, causal=True, k_offset=2, return_lse=True, backend="reference")
        lse.masked_fill_(torch.isneginf(lse), 0.0)
        return out.square().sum() + (lse * w).sum()

    grads = [torch.autograd.grad(fn(q, k, v), (q, k, v))
             for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True))]
    _assert_same_bytes(grads[1], grads[0])


def test_a_second_derivative_through_the_compiled_ops_is_refused_by_name():
    """Under backend="eager" the ops run eagerly with the op's autograd formula, whose backward (attention_bwd) had
    none: a second derivative through it failed with torch's 'no autograd formula was registered', naming neither
    fa4dist nor the way out. create_graph=True alone (no second derivative through the attention) still works."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda a, b, c: fa4dist.attention(a, b, c, causal=True, backend="reference"), backend="eager",
                      fullgraph=True)
    (dq,) = torch.autograd.grad(f(q, k, v).square().sum(), q, create_graph=True)
    (want,) = torch.autograd.grad(fa4dist.attention(q, k, v, causal=True, backend="reference").square().sum(), q)
    assert torch.equal(dq.detach(), want)
    with pytest.raises(RuntimeError, match="fa4dist.attention under torch.compile is differentiable once"):
        torch.autograd.grad(dq.square().sum(), k)


def test_changing_softcap_and_scale_values_under_fullgraph():
    """One compiled function called with other softcap / softmax_scale values: dynamo hands a float whose value
    changed over as a SymFloat, which the checks' math.isfinite could not trace (fullgraph=True failed). The bytes
    are the eager call's at every value; a numpy scalar (traced as an array of unknown value) is refused by name."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 24, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def f(q, k, v, cap, scale):
        return fa4dist.attention(q, k, v, causal=True, softcap=cap, softmax_scale=scale)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for cap, scale in ((2.0, 0.3), (3.0, 0.3), (3.0, 0.5), (5, 1), (None, 0.25)):
        assert torch.equal(compiled(q, k, v, cap, scale), f(q, k, v, cap, scale)), (cap, scale)
    with pytest.raises(Exception, match="softcap: under torch.compile pass a Python float"):
        compiled(q, k, v, np.float32(4.0), 0.3)
    lenient = torch.compile(f, backend="aot_eager")  # without fullgraph the call runs eagerly behind a break
    assert torch.equal(lenient(q, k, v, np.float32(4.0), 0.3), f(q, k, v, 4.0, 0.3))
    with pytest.raises(Exception, match="softcap must be finite and > 0"):
        compiled(q, k, v, -1.5, 0.3)


def test_numpy_integer_windows_and_offsets_under_compile():
    """Eager calls take NumPy integer window sides and offsets; traced, dynamo holds them as arrays of unknown value:
    fullgraph=True refuses them by name (not with a repr() of a traced tensor), without it the call runs eagerly."""
    import numpy as np

    q, k, v = (torch.randn(2, 8, 2, 16, dtype=torch.float64) for _ in range(3))

    def f(q, k, v, left, offset):
        return fa4dist.attention(q, k, v, causal=True, window=(left, 0), q_offset=offset, backend="reference")

    for name, left, offset in (("window", np.int64(3), 5), ("q_offset", 3, [5, np.int32(5)])):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"{name}: under torch.compile pass Python ints"):
            torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, left, offset)
    torch._dynamo.reset()
    lenient = torch.compile(f, backend="aot_eager")
    assert torch.equal(lenient(q, k, v, np.int64(3), np.int64(5)), f(q, k, v, 3, 5))


def test_the_entry_points_that_are_not_ops_run_eagerly():
    """cp_invariant, the in-place contract and the module: one graph break each, the eager bytes."""
    x, w, _ = _inputs((1, 32))
    for kwargs in (dict(causal=True, cp_invariant=True, backend="reference"),):
        step = _model_step(kwargs)
        explain = torch._dynamo.explain(step)(x, w)
        assert explain.graph_break_count >= 1
        torch._dynamo.reset()
        eager, compiled = _eager_and_compiled(step, (x, w), fullgraph=False)
        _assert_same_bytes(eager, compiled)

    q, k, v = (torch.randn(1, 16, 2, 16, dtype=torch.float64) for _ in range(3))

    def contract(q, k, v):
        out = torch.zeros(1, 16, 2, 16, dtype=torch.float64)
        lse = torch.full((1, 2, 16), float("-inf"), dtype=torch.float64)
        attention_forward(q, k, v, causal=True, out=out, lse=lse, accumulate=True, backend="reference")
        return out * 2

    _assert_same_bytes((torch.compile(contract, backend="aot_eager")(q, k, v),), (contract(q, k, v),))

    attn = FA4ContextParallelAttention(causal=True, backend="reference")  # no group: one rank
    proj = torch.nn.Linear(32, 32, dtype=torch.float64)

    def module_step(x):
        h = F.silu(proj(x)).unflatten(-1, (2, 16))
        return attn(h, h, h).sum()

    xs = torch.randn(1, 16, 32, dtype=torch.float64)
    _assert_same_bytes((torch.compile(module_step, backend="aot_eager")(xs),), (module_step(xs),))
    # under fullgraph=True each stops the trace, saying why (dynamo printed "reason: None")
    torch._dynamo.reset()
    for fn, args in ((contract, (q, k, v)), (module_step, (xs,))):
        with pytest.raises(Exception, match="fa4dist runs this call eagerly, outside the compiled graph"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)


def test_compiling_it_warns_about_nothing_of_ours():
    """Tracing fa4dist's code raises no warning that names it (a functools cache in the selective-checkpointing
    guard made dynamo warn of 'potential silent incorrectness' in every compiled model)."""
    import warnings

    import numpy as np

    x, w, s = _inputs((1, 32), sinks=True)
    attn = FA4ContextParallelAttention(causal=True, backend="reference")  # no group: one rank
    q = torch.randn(1, 16, 2, 16, dtype=torch.float64)

    def contract(q):
        out = torch.zeros(1, 16, 2, 16, dtype=torch.float64)
        lse = torch.full((1, 2, 16), float("-inf"), dtype=torch.float64)
        attention_forward(q, q, q, causal=True, out=out, lse=lse, accumulate=True, backend="reference")
        return out * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kwargs in (dict(causal=True, backend="reference"), dict(causal=True, cp_invariant=True,
                                                                      backend="reference")):
            torch.compile(_model_step(kwargs), backend="aot_eager")(x, w, s).backward()
        torch.compile(contract, backend="aot_eager")(q)
        torch.compile(lambda q: attn(q, q, q).sum(), backend="aot_eager")(q)
        # a NumPy window side: the call runs eagerly behind a graph break, and dynamo traces the frames after it
        torch.compile(lambda q, left: fa4dist.attention(q, q, q, causal=True, window=(left, 0), backend="reference"),
                      backend="aot_eager")(q, np.int64(3))
    ours = [str(c.message) for c in caught if "fa4dist" in str(c.filename) or "fa4dist" in str(c.message)
            or "lru_cache" in str(c.message)]
    assert not ours, ours


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True])
def test_cute_kernels_under_torch_compile(deterministic):
    from cute_gpu import skip_module_without_cute

    skip_module_without_cute()
    heads, heads_kv, d = 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % (2**31))
    x = torch.randn(2, 1000, heads * d, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(heads * d, (heads + 2 * heads_kv) * d, device="cuda", dtype=torch.bfloat16, generator=g)
         / 32).requires_grad_()
    step = _model_step(dict(causal=True, backend="cute", deterministic=deterministic), heads, heads_kv, d)
    explain = torch._dynamo.explain(step)(x, w)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    eager, compiled = _eager_and_compiled(step, (x, w), backend="aot_eager")
    _assert_same_bytes(eager, compiled)
    torch._dynamo.reset()
    eager, compiled = _eager_and_compiled(step, (x, w), backend="inductor")  # its own projection and loss code
    for a, b in zip(eager, compiled):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-4)
