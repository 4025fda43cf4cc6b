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
