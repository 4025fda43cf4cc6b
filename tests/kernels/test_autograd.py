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
