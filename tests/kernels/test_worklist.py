"""The work-list entry points against the fp64 oracle: a whole attention cut into random blocks (any order of
query and key cuts, packed documents, GQA) equals the single call; list order decides the bits; bad items are
named."""

from __future__ import annotations

import random

import pytest
import torch

from fa4dist.kernels import WorkItem, attention_backward_items, attention_forward_items
from oracle import naive_attention

F64 = torch.float64


def _cuts(rng, n, parts):
    return [0] + sorted(rng.sample(range(1, n), min(parts, n) - 1)) + [n] if n > 1 else [0, n]


def _grid_items(rng, segments, causal):
    """Items covering every (query block, key block) pair of each segment (start, length, position), shuffled."""
    items = []
    for start, length, _ in segments:
        qc, kc = _cuts(rng, length, rng.randint(1, 4)), _cuts(rng, length, rng.randint(1, 4))
        for qa, qb in zip(qc, qc[1:]):
            for ka, kb in zip(kc, kc[1:]):
                items.append(WorkItem(start + qa, qb - qa, start + ka, kb - ka, qa, ka, causal))
    rng.shuffle(items)
    return items


@pytest.mark.parametrize("seed", range(6))
def test_random_grid_equals_one_call(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    causal, packed = rng.random() < 0.7, seed % 2 == 1
    heads_kv = rng.choice([1, 2])
    heads = heads_kv * rng.choice([1, 2])
    if packed:
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        segments = [(a, b - a, 0) for a, b in zip(cu, cu[1:])]
        lead = (cu[-1],)
    else:
        n = rng.randint(5, 60)
        segments, lead = [(0, n, 0)], (2, n)
    q = torch.randn(*lead, heads, 8, dtype=F64, generator=gen, requires_grad=True)
    k, v = (torch.randn(*lead, heads_kv, 8, dtype=F64, generator=gen, requires_grad=True) for _ in range(2))
    dout = torch.randn(*lead, heads, 8, dtype=F64, generator=gen)
    cut = torch.tensor([s for s, _, _ in segments] + [lead[0]], dtype=torch.int32) if packed else None
    ref, ref_lse = naive_attention(q, k, v, causal=causal, cu_seqlens_q=cut, cu_seqlens_k=cut)
    ref.backward(dout)
    items = _grid_items(rng, segments, causal)
    out = torch.full(ref.shape, float("nan"), dtype=F64)  # poisoned: fresh=True must write every row
    lse = torch.full(ref_lse.shape, float("nan"), dtype=F64)
    attention_forward_items(q.detach(), k.detach(), v.detach(), items, out, lse, fresh=True, backend="reference")
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=1e-12, atol=1e-12)
    grads = [torch.zeros(t.shape, dtype=F64) for t in (q, k, v)]
    attention_backward_items(dout, q.detach(), k.detach(), v.detach(), out, lse, items, *grads, backend="reference")
    for got, leaf in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-10)


def test_partly_written_rows_and_order_determinism():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 20, 2, 8, generator=gen) for _ in range(3))
    items = [WorkItem(0, 10, 0, 20, 0, 0, True), WorkItem(0, 20, 0, 10, 0, 0, True),
             WorkItem(10, 10, 10, 10, 10, 10, True)]
    out, lse = torch.empty(1, 20, 2, 8), torch.empty(1, 2, 20)
    attention_forward_items(q, k, v, items, out, lse, fresh=True, backend="reference")
    ref, ref_lse = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    again = torch.empty_like(out), torch.empty_like(lse)
    attention_forward_items(q, k, v, items, *again, fresh=True, backend="reference")
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.parametrize("item, error, match", [
    (WorkItem(0, 5, 0, 30, 0, 0), ValueError, r"items\[0\] key rows \[0, 30\) are outside the 20 key tokens"),
    (WorkItem(-1, 5, 0, 3), ValueError, r"query rows \[-1, 4\)"),
    (WorkItem(0, 5, 0, 3, causal=1), TypeError, r"items\[0\].causal must be a bool"),
    (WorkItem(0, 5.0, 0, 3), TypeError, r"items\[0\].q_len must be an int"),
    ("block", TypeError, r"items\[0\] must be a WorkItem"),
])
def test_bad_items_are_named(item, error, match):
    q = torch.randn(20, 2, 8)
    out, lse = torch.zeros(20, 2, 8), torch.full((2, 20), float("-inf"))
    with pytest.raises(error, match=match):
        attention_forward_items(q, q, q, [item], out, lse, backend="reference")


def test_shared_queries_is_none_without_a_backend_that_shares_and_refuses_cp_invariant():
    """share_queries gives None on the reference (every call keeps its own query side: the lists then equal the
    plain ones); a handle made for one deterministic setting, or passed with cp_invariant, is refused by name."""
    from fa4dist.kernels.worklist import SharedQueries, share_queries

    q, k, v, dout = (torch.randn(1, 64, 2, 16, dtype=torch.float64) for _ in range(4))
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 64, dtype=torch.float64)
    assert share_queries(dout, q, out, lse, backend="reference") is None
    assert share_queries(dout[0], q[0], out[0], lse[0], backend="reference") is None  # packed rows
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    items = [WorkItem(0, 64, 0, 64, causal=True)]
    handle = SharedQueries(impl=None, state=None, seq_dim=1, deterministic=False)
    for kw in (dict(cp_invariant=True, deterministic=False), dict(deterministic=True)):
        with pytest.raises(ValueError, match="shared= needs cp_invariant=False and the deterministic setting"):
            attention_backward_items(dout, q, k, v, out, lse, items, *grads, backend="reference", shared=handle, **kw)
