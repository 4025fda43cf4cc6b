"""fa4dist.attention (fa4dist.kernels.autograd) at the edges of its input range."""

import pytest
import torch

import fa4dist


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
