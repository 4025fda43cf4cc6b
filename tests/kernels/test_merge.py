"""fa4dist.kernels.merge: the arguments of merge_partials are refused by name when they cannot be merged."""

import pytest
import torch

from fa4dist.kernels import merge_partials


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
