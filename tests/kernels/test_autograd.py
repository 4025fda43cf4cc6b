"""fa4dist.attention (fa4dist.kernels.autograd) at the edges of its input range."""

import pytest
import torch

import fa4dist
from fa4dist.kernels import reference, registry


@pytest.mark.parametrize("sinks", [False, True])
def test_create_graph_gradients_of_an_empty_batch_are_empty(sinks):
    """batch = 0 with create_graph=True (the differentiable backward recomputes the reference forward): empty
    gradients shaped like the inputs (a zero sink gradient), as the first-order backward gives."""
    q, k, v = (torch.randn(0, 4, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    s = torch.zeros(2, dtype=torch.float64, requires_grad=True) if sinks else None
    out = fa4dist.attention(q, k, v, causal=True, sinks=s)
    wrt = [q, k, v] + ([s] if sinks else [])
    grads = torch.autograd.grad(out.sum(), wrt, create_graph=True, allow_unused=True)
    for g, t in zip(grads, wrt):
        assert g is None or (g.shape == t.shape and not g.any())


@pytest.mark.parametrize("backend", ["reference", "sdpa_math"])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_selective_checkpointing_policy_does_not_reach_inside_the_attention(backend, sinks):
    """fa4dist.attention under checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy)) with a policy
    that saves the matmuls: the reference kernel updates its matmul outputs in place, which raised torch's 'cached
    tensor has been mutated'. The call is one op to the policy (as a fused kernel is): the same gradients as
    without the checkpoint (fp64)."""
    import functools

    from fa4dist.kernels import available_backends
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    if backend not in available_backends(torch.device("cpu")):
        pytest.skip(f"{backend} not available on CPU")

    def policy(ctx, op, *args, **kwargs):
        saved = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 48, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    s = torch.randn(4, dtype=torch.float64, requires_grad=True) if sinks else None
    leaves = [q, k, v] + ([s] if sinks else [])

    def f(q, k, v):
        return fa4dist.attention(q, k, v, causal=True, sinks=s, backend=backend)

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    (checkpoint(f, q, k, v, use_reentrant=False, context_fn=context) * 2).sum().backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    (f(q, k, v) * 2).sum().backward()
    for a, t in zip(got, leaves):
        torch.testing.assert_close(a, t.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cp_invariant", [False, True])
def test_a_policy_that_saves_every_op_does_not_reach_inside_the_attention(cp_invariant):
    """As above with a policy that saves every op, and a loss of out and of the (differentiable) lse: the
    cp_invariant call's forward ran its kernels under the policy, whose recompute raised torch's 'cached tensor has
    been mutated' (the reference's in-place updates). Now it is one op to the policy too: the gradients without
    the checkpoint (fp64)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    s = torch.randn(2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, 12, dtype=torch.float64)

    def f(q, k, v, s):
        out, lse = fa4dist.attention(q, k, v, causal=True, sinks=s, return_lse=True, cp_invariant=cp_invariant,
                                     backend="reference")
        return out.square().sum() + (lse * w).sum()

    context = functools.partial(create_selective_checkpoint_contexts, lambda *a, **kw: CheckpointPolicy.MUST_SAVE)
    got = torch.autograd.grad(checkpoint(f, q, k, v, s, use_reentrant=False, context_fn=context), (q, k, v, s))
    want = torch.autograd.grad(f(q, k, v, s), (q, k, v, s))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cp_invariant", [False, True])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "vmap", "jvp", "forward_ad"])
def test_torch_func_transforms_are_refused_by_name(transform, cp_invariant):
    """torch.func's transforms and forward-mode AD have no rule for the attention's kernels (no batching rule, no
    forward derivative, a backward that reads its saved tensors outside the transform's levels): refused naming
    fa4dist.attention and the way out. They failed with torch's 'it must override the setup_context staticmethod'
    (or 'You must implement the jvp function'), which names neither the call nor what to do instead."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, 2, 4, dtype=torch.float64) for _ in range(3))

    def f(a):
        return fa4dist.attention(a, k, v, causal=True, cp_invariant=cp_invariant)

    def call():
        if transform == "grad":
            torch.func.grad(lambda a: f(a).sum())(q)
        elif transform == "vjp":
            out, fn = torch.func.vjp(f, q)
            fn(torch.ones_like(out))
        elif transform == "jacrev":
            torch.func.jacrev(f)(q)
        elif transform == "vmap":
            torch.func.vmap(f)(q[None].repeat(2, 1, 1, 1, 1))
        elif transform == "jvp":
            torch.func.jvp(f, (q,), (torch.ones_like(q),))
        else:
            with fwad.dual_level():
                f(fwad.make_dual(q, torch.ones_like(q)))

    with pytest.raises(RuntimeError, match=r"fa4dist.attention does not support (torch.func|forward-mode)"):
        call()


class _TwoPassReference:
    """The reference's numerics behind a backend without ``lse_gradient``: the contract then gives the lse's
    gradient one more backward (api.lse_backward_operands), the route of the sdpa backends, which also take dout
    and out in q's dtype (sdpa._FusedBackend.backward casts them). Counts its backwards."""

    name, priority, fused_epilogue = "reference-two-pass", 0, False

    def __init__(self):
        self.backwards = 0

    def available(self, device):
        return True

    def supports(self, problem, direction):
        return None

    def forward(self, problem, q, k, v):
        return reference.forward(problem, q, k, v)

    def backward(self, problem, dout, q, k, v, out, lse, deterministic):
        self.backwards += 1
        return reference.backward(problem, dout.to(q.dtype), q, k, v, out.to(q.dtype), lse)


@pytest.fixture
def two_pass(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    backend = _TwoPassReference()
    registry.register_backend(backend)
    return backend


def test_the_lse_gradient_joins_the_backward_pass(two_pass, monkeypatch):
    """A loss of out and lse: one backward pass where the backend takes dlse (the reference; cute), two where it
    does not (the lse's share through api.lse_backward_operands), and the same gradients (fp64)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 20, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64)
    w_out, w_lse = torch.randn(2, 20, 2, 8, generator=gen, dtype=torch.float64), torch.randn(2, 2, 20, generator=gen,
                                                                                            dtype=torch.float64)
    calls = []
    monkeypatch.setattr(type(registry.get_backend("reference")), "backward", lambda self, *a, **kw: calls.append(
        kw.get("dlse")) or reference.backward(*a[:7], kw.get("dq_scale"), kw.get("dlse")))
    grads = {}
    for backend in ("reference", two_pass.name):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out, lse = fa4dist.attention(*leaves[:3], sinks=leaves[3], causal=True, return_lse=True, backend=backend)
        ((out * w_out).sum() + (lse * w_lse).sum()).backward()
        grads[backend] = [t.grad for t in leaves]
    assert len(calls) == 1 and calls[0] is not None and two_pass.backwards == 2
    for name, a, b in zip("qkvs", grads["reference"], grads[two_pass.name]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = fa4dist.attention(*leaves[:3], sinks=leaves[3], causal=True, return_lse=True, backend="reference")
    (out * w_out).sum().backward()  # the lse unused: no dlse reaches the backend
    assert len(calls) == 2 and calls[1] is None


def test_attention_backward_takes_the_lse_gradient_per_block(two_pass):
    """attention_backward(dlse=) with the global out, lse and dlse on every block of the keys (as a ring calls it):
    the blocks' sums are the whole call's gradients, on both routes, and the fp64 oracle's."""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 24, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 24, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout, dlse = torch.randn(q.shape, generator=gen, dtype=torch.float64), torch.randn(1, 4, 24, generator=gen,
                                                                                       dtype=torch.float64)
    out, lse = fa4dist.kernels.attention_forward(q, k, v, causal=True, backend="reference")
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive_attention(*ref, causal=True)
    want = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), ref)
    for backend in ("reference", two_pass.name):
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        for ks in (0, 10):
            kl = 10 if ks == 0 else 14
            fa4dist.kernels.attention_backward(
                dout, q, k[:, ks:ks + kl], v[:, ks:ks + kl], out, lse, causal=True, k_offset=ks, dq=dq,
                dk=dk[:, ks:ks + kl], dv=dv[:, ks:ks + kl], accumulate=True, backend=backend, dlse=dlse)
        for name, g, r in zip("qkv", (dq, dk, dv), want):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=f"{backend} d{name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_two_pass_route_keeps_the_lse_gradient_with_an_fp32_out(two_pass, dtype):
    """attention_backward(dlse=) given the global out in fp32 (as the contract allows for 16-bit q, a ring's merged
    result): the two-pass route built its operands in out's dtype, fp32, and a backend that takes dout and out in
    q's dtype (the sdpa ones) rounded them: the lse's share of dq and dk was lost for |dlse| ~ 1e-7 in float16 (its
    fp32 power of two became 0) and off by 1e-3 elsewhere (one fp32 column rounded to 16 bits).  Now they are
    built in q's dtype: the one-pass route's gradients, to fp32's rounding."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=gen).to(dtype) for _ in range(3))
    out, lse = fa4dist.kernels.attention_forward(q, k, v, causal=True, out=torch.empty(q.shape), backend="reference")
    for magnitude in (1e-7, 1e-3, 1.0, 1e5):
        dlse = torch.randn(1, 2, 16, generator=gen) * magnitude
        grads = [fa4dist.kernels.attention_backward(torch.zeros_like(out), q, k, v, out, lse, causal=True, dlse=dlse,
                                                    dq=torch.empty(q.shape), dk=torch.empty(k.shape),
                                                    dv=torch.empty(v.shape), backend=backend)
                 for backend in ("reference", two_pass.name)]
        for name, one, two in zip(("dq", "dk"), *grads):
            assert ((two - one).norm() / one.norm()).item() < 1e-5, (magnitude, name)


@pytest.mark.parametrize("mode", ["eager", "cp_invariant", "compiled"])
def test_a_loss_of_the_lse_alone_takes_one_pass_on_the_two_pass_route(two_pass, mode):
    """A loss of the lse alone (out unused) on a backend without lse_gradient: the contract ran a backward of a zero
    dout and then the lse's pass, two where the lse's own suffices (eager and cp_invariant took one before dlse=).
    Now attention_backward takes dout=None with dlse= (a loss of the lse alone): one pass, dv zero, the fp64
    oracle's gradients.  (cp_invariant: one pass of the invariant engine, whose fixed-point backward this backend
    does not have: the reference's, by the registry's fallback.)"""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(15)
    q = torch.randn(1, 12, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 12, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks, w = torch.randn(4, generator=gen, dtype=torch.float64), torch.randn(1, 4, 12, generator=gen,
                                                                             dtype=torch.float64)

    def loss(q, k, v, sinks):
        kw = dict(cp_invariant=True) if mode == "cp_invariant" else {}
        return (fa4dist.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend=two_pass.name,
                                  **kw)[1] * w).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    got = torch.autograd.grad((torch.compile(loss, backend="aot_eager", fullgraph=True) if mode == "compiled"
                               else loss)(*leaves), leaves, allow_unused=True)
    assert two_pass.backwards == (0 if mode == "cp_invariant" else 1)
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = torch.autograd.grad((naive_attention(*ref[:3], causal=True, sinks=ref[3])[1] * w).sum(), ref,
                               allow_unused=True)
    for name, g, r in zip("qkvs", got, want):
        if r is None:  # dv: none, or zero
            assert g is None or not g.any(), name
        else:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)


def test_dout_may_be_none_with_dlse_only():
    """attention_backward(None, ..., dlse=): the gradients of a loss of the lse alone, as with a zero dout; without
    dlse, dout is still required by name."""
    gen = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=gen) for _ in range(3))
    out, lse = fa4dist.kernels.attention_forward(q, k, v)
    dlse = torch.randn(lse.shape, generator=gen)
    got = fa4dist.kernels.attention_backward(None, q, k, v, out, lse, dlse=dlse)
    want = fa4dist.kernels.attention_backward(torch.zeros_like(out), q, k, v, out, lse, dlse=dlse)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="needs dout"):
        fa4dist.kernels.attention_backward(None, q, k, v, out, lse)


@pytest.mark.parametrize("cp_invariant", [False, True])
def test_the_returned_lse_may_be_updated_in_place(cp_invariant):
    """return_lse=True, the caller zeroing the lse's -inf rows in place (masked_fill_): the lse, now an output of
    the one autograd function that also saved it, raised 'Output 1 of _AttentionFunction is a view and is being
    modified inplace' (before dlse=, a separate function returned a copy, which the caller could update).  Now the
    caller gets its own copy again: the fp64 oracle's gradients of the updated lse."""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.randn(1, 2, 8, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4dist.attention(*leaves, causal=True, k_offset=2, return_lse=True, backend="reference",
                                 cp_invariant=cp_invariant)  # rows 0 and 1 see no key: lse -inf
    lse.masked_fill_(torch.isneginf(lse), 0.0)
    got = torch.autograd.grad(out.square().sum() + (lse * w).sum(), leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive_attention(*ref, causal=True, k_offset=2)
    ref_lse = torch.where(torch.isneginf(ref_lse), 0.0, ref_lse)
    want = torch.autograd.grad(ref_out.square().sum() + (ref_lse * w).sum(), ref)
    for name, g, r in zip("qkv", got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)


def test_dlse_is_checked_by_name():
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=gen) for _ in range(3))
    out, lse = fa4dist.kernels.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="dlse"):
        fa4dist.kernels.attention_backward(out, q, k, v, out, lse, dlse=torch.zeros(1, 2, 9))
    with pytest.raises((TypeError, ValueError), match="dlse"):
        fa4dist.kernels.attention_backward(out, q, k, v, out, lse, dlse=torch.zeros(1, 2, 8, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", ["dense-causal-gqa", "packed-window-softcap-sinks", "cp_invariant"])
def test_the_lse_is_differentiable(case, dtype):
    """return_lse=True gives an lse whose gradient reaches q, k and the sinks (it was marked non-differentiable:
    a loss of out and lse lost the lse's part silently): against the fp64 oracle's autograd, with a loss of both
    outputs and of the lse alone; a second derivative through it in fp64."""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(7)
    kw, sinks = dict(causal=True), None
    if case.startswith("packed"):
        q, k, v = (torch.randn(40, 4, 16, generator=gen, dtype=torch.float64) for _ in range(3))
        cu = torch.tensor([0, 9, 40], dtype=torch.int32)
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, window=(5, 0), softcap=2.0)
        sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    else:
        q = torch.randn(2, 24, 4, 16, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(2, 24, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + (
        [sinks.requires_grad_()] if sinks is not None else [])
    extra = dict(cp_invariant=True) if case == "cp_invariant" else {}
    out, lse = fa4dist.attention(*leaves[:3], sinks=sinks, return_lse=True, **kw, **extra)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, ref_lse = naive_attention(*ref_leaves[:3], sinks=ref_leaves[3] if sinks is not None else None, **kw)
    w_out = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64)
    tol = 1e-10 if dtype == torch.float64 else 3e-2  # bf16: the inputs' and gradients' rounding
    for use_out in (True, False):
        loss = (lse.double() * w_lse).sum() + ((out.double() * w_out).sum() if use_out else 0)
        ref_loss = (ref_lse * w_lse).sum() + ((ref_out * w_out).sum() if use_out else 0)
        got = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(ref_loss, ref_leaves, retain_graph=True, allow_unused=True)
        for name, g, r, leaf in zip("qkvs", got, want, ref_leaves):
            r = torch.zeros_like(leaf) if r is None else r  # (v: the lse does not depend on it)
            g = torch.zeros_like(r) if g is None else g.double()
            scale = max(float(r.abs().max()), 1e-30)
            assert float((g - r).abs().max()) <= tol * scale, (name, use_out)
    if dtype == torch.float64 and case != "cp_invariant":  # a second derivative through the lse
        g_q = torch.autograd.grad((lse * w_lse).sum(), leaves[0], create_graph=True)[0]
        ref_g_q = torch.autograd.grad((ref_lse * w_lse).sum(), ref_leaves[0], create_graph=True)[0]
        got2 = torch.autograd.grad(g_q.square().sum(), leaves[1])[0]
        want2 = torch.autograd.grad(ref_g_q.square().sum(), ref_leaves[1])[0]
        torch.testing.assert_close(got2, want2, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("route", ["one pass", "two passes"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["dlse past float16's range", "dlse in float16's subnormals", "dlse of one"])
def test_the_lse_gradient_keeps_its_precision_over_float32s_range(case, dtype, route, two_pass):
    """The lse is float32, so its gradient dlse can take any float32 value, while the backward carries it in out's
    dtype. It was rounded to float16 as it came: |dlse| = 1e5 (past 65504) gave NaN gradients and 1e-6 (a float16
    subnormal) lost 2% of dq and of dsinks, where the gradients themselves are normal float16 numbers. Now within a
    few of the dtype's roundings of the fp64 oracle's gradients (q, k rounded to the dtype, sinks fp64)."""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(3)
    magnitude, q_scale, k_scale, softmax_scale = {"dlse past float16's range": (1e5, 1.0, 1.0, 0.01),
                                                  "dlse in float16's subnormals": (1e-6, 0.01, 100.0, 1.0),
                                                  "dlse of one": (1.0, 1.0, 1.0, None)}[case]
    q = (torch.randn(2, 16, 4, 16, generator=gen, dtype=torch.float64) * q_scale).to(dtype)
    k = (torch.randn(2, 16, 2, 16, generator=gen, dtype=torch.float64) * k_scale).to(dtype)
    v = torch.randn(2, 16, 2, 16, generator=gen, dtype=torch.float64).to(dtype)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    w = magnitude * (0.5 + torch.rand(2, 4, 16, generator=gen, dtype=torch.float64))
    w = w * torch.randn(w.shape, generator=gen).sign()
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    _, lse = fa4dist.attention(*leaves[:3], sinks=leaves[3], causal=True, softmax_scale=softmax_scale,
                               return_lse=True, backend="reference" if route == "one pass" else two_pass.name)
    got = torch.autograd.grad((lse.double() * w).sum(), (leaves[0], leaves[1], leaves[3]))
    ref = [t.detach().double().requires_grad_() for t in leaves]
    _, ref_lse = naive_attention(*ref[:3], sinks=ref[3], causal=True, softmax_scale=softmax_scale)
    want = torch.autograd.grad((ref_lse * w).sum(), (ref[0], ref[1], ref[3]))
    tol = 4 * torch.finfo(dtype).eps
    for name, g, r in zip(("dq", "dk", "dsinks"), got, want):
        # (an absolute step too: a dk below float16's smallest step rounds to 0 or that step)
        assert float((g.double() - r).abs().max()) <= tol * float(r.abs().max()) + torch.finfo(g.dtype).tiny * \
            torch.finfo(g.dtype).eps, name


def test_an_infinite_dlse_gives_the_oracles_infinities():
    """A row whose dlse is +inf: its three-column split made the row NaN (inf - inf), so dk and dsinks were NaN
    where the fp64 oracle's are +-inf; now the same non-finite values, and the same finite ones elsewhere."""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(1, 2, 6, generator=gen, dtype=torch.float64)
    w[0, 1, 3] = float("inf")
    _, lse = fa4dist.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    got = torch.autograd.grad((lse * w).sum(), (q, k, sinks))
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    _, ref_lse = naive_attention(*ref[:3], sinks=ref[3], causal=True)
    want = torch.autograd.grad((ref_lse * w).sum(), (ref[0], ref[1], ref[3]))
    for name, g, r in zip(("dq", "dk", "dsinks"), got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(r)) and torch.equal(torch.isinf(g), torch.isinf(r)), name
        assert torch.equal(g[torch.isinf(r)], r[torch.isinf(r)]), name
        finite = torch.isfinite(r)
        assert float((g[finite] - r[finite]).abs().max()) <= 1e-10 * float(r[finite].abs().max()), name


def test_a_minus_inf_sink_on_a_row_that_sees_no_key_has_a_zero_second_order_sink_gradient():
    """A -inf sink is no sink. A row that sees no key with it has lse -inf, and the sink merge took log(0) there:
    its value was right, but under create_graph the derivative of log(0) (inf) times the row's zero weight gave a
    NaN sink gradient. Now the gradients with create_graph equal the first-order ones (and the oracle's)."""
    from oracle import naive_attention

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 3, 2, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 4, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    kw = dict(causal=True, q_offset=0, k_offset=1)  # query 0 sees no key (keys 1..4)
    grads = {}
    for create_graph in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sinks = torch.tensor([float("-inf"), 0.3], dtype=torch.float64, requires_grad=True)
        out, lse = fa4dist.attention(*leaves, sinks=sinks, return_lse=True, **kw)
        loss = out.square().sum() + torch.where(lse.isinf(), torch.zeros_like(lse), lse).sum()
        grads[create_graph] = torch.autograd.grad(loss, leaves + [sinks], create_graph=create_graph)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = torch.tensor([float("-inf"), 0.3], dtype=torch.float64, requires_grad=True)
    ref_out, ref_lse = naive_attention(*ref_leaves, sinks=ref_sinks, **kw)
    ref_loss = ref_out.square().sum() + torch.where(ref_lse.isinf(), torch.zeros_like(ref_lse), ref_lse).sum()
    want = torch.autograd.grad(ref_loss, ref_leaves + [ref_sinks])
    for name, first, second, r in zip("qkvs", grads[False], grads[True], want):
        assert torch.isfinite(second).all(), name
        torch.testing.assert_close(second.detach(), first, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(second.detach(), torch.nan_to_num(r), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("use_out", [True, False])
def test_create_graph_with_only_v_requiring_grad_and_a_loss_of_the_lse(use_out):
    """return_lse=True, only v requiring grad (q, k, sinks frozen), a loss of the lse (and of out), create_graph=True:
    the differentiable backward seeded the recomputed lse, which depends on no input that requires grad, and
    autograd.grad raised 'element 1 of tensors does not require grad' from inside fa4dist.  The lse's share of dv
    is zero: dv is out's part alone, the gradient of an fp64 oracle written here (none without out), and a second
    derivative through it (dv does not depend on v: none either)."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    w_out = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(1, 4, 6, generator=gen, dtype=torch.float64)
    out, lse = fa4dist.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend="reference")
    loss = (lse * w_lse).sum() + ((out * w_out).sum() if use_out else 0)
    (dv,) = torch.autograd.grad(loss, v, create_graph=True)

    # the oracle: softmax(q k^T * scale + causal mask, with the sink column) v, in fp64, K/V heads repeated (GQA)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 8 ** -0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    scores = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(1, 4, 6, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :-1]  # (the sink's column multiplies a zero value)
    want = torch.einsum("bhqk,bqhd->bkhd", probs, w_out).unflatten(2, (2, 2)).sum(3) if use_out else 0 * v
    torch.testing.assert_close(dv, want, rtol=1e-12, atol=1e-12)
    assert not dv.requires_grad  # dv = P^T dout: no function of v
