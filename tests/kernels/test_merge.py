"""fa4dist.kernels.merge: the arguments of merge_partials are refused by name when they cannot be merged; the
sinks' gradient at the edges of the range."""

import pytest
import torch

import fa4dist
from fa4dist.kernels import merge_partials
from oracle import naive_attention


def _partials(n=2):
    torch.manual_seed(0)
    return [torch.randn(2, 8, 4, 16) for _ in range(n)], [torch.randn(2, 4, 8) for _ in range(n)]


def test_merge_partials_refuses_an_expanded_out_by_name():
    """An expanded (stride 0) out= holds one memory cell for several results: before, torch's copy_ failed inside
    the merge ("more than one element of the written-to tensor refers to a single memory location")."""
    outs, lses = _partials()
    with pytest.raises(ValueError, match="merge_partials: out .*share memory"):
        merge_partials(outs, lses, out=torch.zeros(1, 8, 4, 16).expand(2, 8, 4, 16))


def test_merge_partials_takes_any_iterable_of_partials():
    """outs / lses as generators (before: TypeError "object of type 'generator' has no len()") or stacked along a
    first dim merge as the lists do; something that is not an iterable is refused by name."""
    outs, lses = _partials(3)
    want = merge_partials(outs, lses)
    for got in (merge_partials((o for o in outs), iter(lses)), merge_partials(torch.stack(outs), torch.stack(lses))):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match="merge_partials: outs must be an iterable of tensors, got int"):
        merge_partials(3, lses)
    with pytest.raises(TypeError, match="merge_partials: lses must be an iterable of tensors, got NoneType"):
        merge_partials(outs, None)


def test_merge_partials_precision_does_not_depend_on_the_order():
    """Partials of mixed precision merge in fp64 when any of them is fp64, whichever comes first (before: the first
    partial's, so [bf16, fp64] merged in fp32 and [fp64, bf16] in fp64); the upcasts are exact, so the result equals
    the merge of the partials upcast by hand."""
    outs, lses = _partials()
    low = (outs[0].bfloat16(), lses[0])
    high = (outs[1].double(), lses[1].double())
    for pair in ((low, high), (high, low)):
        got_out, got_lse = merge_partials([p[0] for p in pair], [p[1] for p in pair])
        want_out, want_lse = merge_partials([p[0].double() for p in pair], [p[1].double() for p in pair])
        assert got_out.dtype == got_lse.dtype == torch.float64
        assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("cp_invariant", [False, True], ids=["plain", "cp-invariant"])
def test_sink_gradient_of_outputs_near_the_top_of_the_range(cp_invariant):
    """dsink = -sum_rows exp(sink - lse) * rowsum(dout * out): with out ~ 1e37 (values of 1e37) and head_dim 64
    rowsum(dout * out) overflows float32 although each row's term, weighed by its sink's small share, and their
    sum are finite: dsinks came out -inf (NaN under cp_invariant) where the fp64 oracle is ~-7e37."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 8, 2, 64, generator=gen), torch.randn(1, 8, 1, 64, generator=gen)
    v = 1e37 * (1 + 0.01 * torch.randn(1, 8, 1, 64, generator=gen))
    dout = torch.rand(1, 8, 2, 64, generator=gen) + 0.5
    sinks = torch.tensor([-3.0, -4.0], requires_grad=True)
    fa4dist.attention(q, k, v, causal=True, sinks=sinks, cp_invariant=cp_invariant, backend="reference").backward(
        dout)
    sinks64 = sinks.detach().double().requires_grad_()
    want, = torch.autograd.grad(naive_attention(q, k, v, causal=True, sinks=sinks64)[0], sinks64, dout.double())
    assert torch.isfinite(want).all()
    torch.testing.assert_close(sinks.grad.double(), want, atol=0, rtol=1e-5)


def test_sink_gradient_of_a_loss_of_the_lse_alone_takes_dout_none():
    """sink_grad(None, out, lse, sinks, dlse): out unused (the ring passes no dout for a loss of the lse alone), the
    fp64 oracle's sinks' gradient of that loss; zero without dlse either."""
    from fa4dist.kernels import attention_forward, sink_grad

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 8, h, 16, generator=gen) for h in (2, 1, 1))
    sinks = torch.tensor([-1.0, 0.5])
    out, lse = attention_forward(q, k, v, causal=True, sinks=sinks, backend="reference")
    dlse = torch.randn(lse.shape, generator=gen)
    sinks64 = sinks.double().requires_grad_()
    want, = torch.autograd.grad(naive_attention(q, k, v, causal=True, sinks=sinks64)[1], sinks64, dlse.double())
    tol = 64 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(sink_grad(None, out, lse, sinks, dlse).double(), want, rtol=tol, atol=tol)
    assert torch.equal(sink_grad(None, out, lse, sinks), torch.zeros(2))


def test_in_place_merges_record_no_graph_from_inputs_that_require_grad():
    """merge_sink_ with learnable sinks (a Parameter) and merge_into_ with a block that requires grad recorded an
    autograd graph into the caller's running buffers, and the next in-place merge into them was refused ("out
    requires grad"). They are the non-differentiable forms (with_sink / merge_partials are the differentiable ones):
    the buffers stay plain, and the values are the fp64 oracle's."""
    from fa4dist.kernels import attention_forward, merge_into_, merge_sink_

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
    out = torch.zeros(1, 12, 2, 8, dtype=torch.float64)
    lse = torch.full((1, 2, 12), float("-inf"), dtype=torch.float64)
    attention_forward(q, k[:, :5], v[:, :5], out=out, lse=lse, accumulate=True, backend="reference")
    merge_sink_(out, lse, sinks)
    assert not out.requires_grad and not lse.requires_grad
    block_out, block_lse = attention_forward(q, k[:, 5:9], v[:, 5:9], k_offset=5, backend="reference")
    merge_into_(out, lse, block_out.requires_grad_(), block_lse.requires_grad_())
    assert not out.requires_grad and not lse.requires_grad
    attention_forward(q, k[:, 9:], v[:, 9:], k_offset=9, out=out, lse=lse, accumulate=True, backend="reference")
    want_out, want_lse = naive_attention(q, k, v, sinks=sinks.detach())
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
