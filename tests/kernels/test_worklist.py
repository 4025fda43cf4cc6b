"""The work-list entry points against the fp64 oracle: a whole attention cut into random blocks (any order of
query and key cuts, packed documents, GQA) equals the single call; list order decides the bits; bad items are
named."""

from __future__ import annotations

import math
import random
import re
from dataclasses import replace

import pytest
import torch

from fa4dist.kernels import WorkItem, attention_backward_items, attention_forward_items
from oracle import naive_attention, visible_item_pairs
from worklist_backends import Listing, Sharing, TwoPass

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
@pytest.mark.parametrize("lse_loss", [False, True])
def test_random_grid_equals_one_call(seed, lse_loss):
    """lse_loss: the loss has a term of the lse too, whose gradient the backward list takes (dlse=)."""
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
    dlse = torch.randn(ref_lse.shape, dtype=F64, generator=gen) if lse_loss else None
    ((ref * dout).sum() + ((ref_lse * dlse).sum() if lse_loss else 0)).backward()
    items = _grid_items(rng, segments, causal)
    out = torch.full(ref.shape, float("nan"), dtype=F64)  # poisoned: fresh=True must write every row
    lse = torch.full(ref_lse.shape, float("nan"), dtype=F64)
    attention_forward_items(q.detach(), k.detach(), v.detach(), items, out, lse, fresh=True, backend="reference")
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=1e-12, atol=1e-12)
    grads = [torch.zeros(t.shape, dtype=F64) for t in (q, k, v)]
    attention_backward_items(dout, q.detach(), k.detach(), v.detach(), out, lse, items, *grads, backend="reference",
                             dlse=dlse)
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


def test_a_window_given_as_a_list_is_kept_as_a_tuple():
    """The contract takes window=[left, right]; an item keeps it hashable (the cute backend caches launch plans by
    the items) and equal to the tuple form."""
    item = WorkItem(0, 5, 0, 3, window=[2, 0], causal=True)
    assert item.window == (2, 0) and item == WorkItem(0, 5, 0, 3, window=(2, 0), causal=True)
    assert hash(item) == hash(WorkItem(0, 5, 0, 3, window=(2, 0), causal=True))


def test_numpy_integers_in_an_item_are_taken_as_ints():
    """An item built from NumPy integers (np.int64 positions from a plan's arrays) is the item of Python ints, as
    the contract takes NumPy integers for its offsets and window (was refused: "must be an int")."""
    np = pytest.importorskip("numpy")
    item = WorkItem(np.int64(0), np.int32(5), np.int64(0), np.int64(3), q_offset=np.int64(7), causal=True)
    assert item == WorkItem(0, 5, 0, 3, q_offset=7, causal=True) and type(item.q_len) is int
    q = torch.randn(20, 2, 8, dtype=F64)
    got = [torch.zeros(20, 2, 8, dtype=F64), torch.full((2, 20), float("-inf"), dtype=F64)]
    want = [t.clone() for t in got]
    attention_forward_items(q, q, q, [item], *got, backend="reference")
    attention_forward_items(q, q, q, [WorkItem(0, 5, 0, 3, q_offset=7, causal=True)], *want, backend="reference")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture
def sharing(monkeypatch):
    from fa4dist.kernels import registry

    monkeypatch.setitem(registry._BACKENDS, Sharing.name, Sharing())
    return Sharing.name


def _shared_inputs(packed, n=16, head_dim=8, head_dim_v=12):
    """(dout, q, k, v, out, lse) in fp64, GQA, v's head dim apart from q's, packed or dense batch 1."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, n, h, d, generator=gen, dtype=F64)
                     for h, d in ((2, head_dim), (1, head_dim), (1, head_dim_v), (2, head_dim_v)))
    out, lse = (t.detach() for t in naive_attention(q, k, v, causal=True))
    if packed:
        return dout[0], q[0], k[0], v[0], out[0], lse[0]
    return dout, q, k, v, out, lse


def test_shared_queries_is_none_without_a_backend_that_shares_and_refuses_cp_invariant(sharing):
    """share_queries gives None on the reference (every call keeps its own query side: the lists then equal the
    plain ones); a handle made for one deterministic setting, or passed with cp_invariant, is refused by name."""
    from fa4dist.kernels.worklist import share_queries

    q, k, v, dout = (torch.randn(1, 64, 2, 16, dtype=torch.float64) for _ in range(4))
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 64, dtype=torch.float64)
    assert share_queries(dout, q, out, lse, backend="reference") is None
    assert share_queries(dout[0], q[0], out[0], lse[0], backend="reference") is None  # packed rows
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    items = [WorkItem(0, 64, 0, 64, causal=True)]
    handle = share_queries(dout, q, out, lse, deterministic=False, backend=sharing)
    for kw in (dict(cp_invariant=True, deterministic=False), dict(deterministic=True)):
        with pytest.raises(ValueError, match="shared= needs cp_invariant=False and the deterministic setting"):
            attention_backward_items(dout, q, k, v, out, lse, items, *grads, backend="reference", shared=handle, **kw)
    # dq=None (dQ not computed) with a shared side: its items would add their dQ into it, and its finish() into dq
    with pytest.raises(ValueError, match=r"shared= needs .*\(and dq, dk and dv to add into\)"):
        attention_backward_items(dout, q, k, v, out, lse, items, None, *grads[1:], backend="reference",
                                 shared=handle, deterministic=False)


@pytest.mark.parametrize("packed", [False, True])
def test_a_shared_query_side_gives_the_lists_gradients_with_v_of_another_head_dim(sharing, packed):
    """Lists through a shared query side (some items taken by it, some not) add the plain lists' gradients, with
    v's head dim (12) apart from q's (8): share_queries takes dout and out of v's head dim."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(packed)
    lists = [[WorkItem(0, 8, 0, 8, causal=True), WorkItem(2, 6, 0, 16, causal=True)],
             [WorkItem(8, 8, 0, 16, causal=True), WorkItem(4, 12, 8, 8, 4, 8, causal=True)]]
    want = [torch.zeros_like(t) for t in (q, k, v)]
    got = [torch.zeros_like(t) for t in (q, k, v)]
    handle = share_queries(dout, q, out, lse, deterministic=False, backend=sharing)
    for items in lists:
        attention_backward_items(dout, q, k, v, out, lse, items, *want, deterministic=False, backend="reference")
        attention_backward_items(dout, q, k, v, out, lse, items, *got, deterministic=False, backend=sharing,
                                 shared=handle)
    assert handle.state.scratch.abs().sum() > 0 and not torch.equal(got[0], want[0])  # dQ waits in the scratch
    handle.finish(got[0])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_a_shared_query_side_made_with_the_lse_gradient(sharing, packed):
    """share_queries(..., dlse=) gives lists that take the same dlse the plain lists' gradients of a loss of out and
    lse; a list without dlse on a side made with one (or the other way round), or with another dlse tensor, is
    refused by name before any item runs (the side's row sums took what it was made with)."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(packed)
    dlse = torch.randn(lse.shape, dtype=F64, generator=torch.Generator().manual_seed(9))
    lists = [[WorkItem(0, 8, 0, 8, causal=True), WorkItem(2, 6, 0, 16, causal=True)],
             [WorkItem(8, 8, 0, 16, causal=True), WorkItem(4, 12, 8, 8, 4, 8, causal=True)]]
    want, got = ([torch.zeros_like(t) for t in (q, k, v)] for _ in range(2))
    handle = share_queries(dout, q, out, lse, deterministic=False, backend=sharing, dlse=dlse)
    for items in lists:
        attention_backward_items(dout, q, k, v, out, lse, items, *want, deterministic=False, backend="reference",
                                 dlse=dlse)
        attention_backward_items(dout, q, k, v, out, lse, items, *got, deterministic=False, backend=sharing,
                                 shared=handle, dlse=dlse)
    handle.finish(got[0])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    plain = share_queries(dout, q, out, lse, deterministic=False, backend=sharing)
    items = lists[0]
    for made, given, match in ((handle, None, "made \\(share_queries\\) with dlse, but this call has none"),
                               (plain, dlse, "made \\(share_queries\\) without dlse, but this call has one"),
                               (handle, dlse.clone(), "for another dlse tensor")):
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        with pytest.raises(ValueError, match=match):
            attention_backward_items(dout, q, k, v, out, lse, items, *grads, deterministic=False, backend=sharing,
                                     shared=made, dlse=given)
        assert not any(g.any() for g in grads)


def test_the_lse_gradient_of_a_list_is_checked_by_name():
    """dlse= of a work list (and of share_queries) has the lse's shape, dtype and device, checked before any item
    runs; a loss of the lse alone (dout = 0) gives its gradient and a zero dv."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(True)
    items = [WorkItem(0, 16, 0, 16, causal=True)]
    for bad, err, match in ((lse[:, :4], ValueError, r"dlse must have shape \(2, 16\)"),
                            (lse.float(), TypeError, "dlse must have dtype torch.float64"),
                            (lse.to("meta"), ValueError, "dlse must be on cpu")):
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        with pytest.raises(err, match=match):
            attention_backward_items(dout, q, k, v, out, lse, items, *grads, backend="reference", dlse=bad)
        assert not any(g.any() for g in grads)
        with pytest.raises(err, match=match):
            share_queries(dout, q, out, lse, backend="reference", dlse=bad)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _, ref_lse = naive_attention(*(t.unsqueeze(0) for t in leaves), causal=True)
    dlse = torch.randn(lse.shape, dtype=F64)
    (ref_lse[0] * dlse).sum().backward()
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    attention_backward_items(torch.zeros_like(dout), q, k, v, out, lse, items, *grads, backend="reference",
                             dlse=dlse)
    for g, leaf in zip(grads[:2], leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-10, atol=1e-10)
    assert leaves[2].grad is None and not grads[2].any()  # (the lse does not depend on v)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["reference", "TwoPass", "Listing", "Sharing"])
def test_a_loss_of_the_lse_alone_takes_dout_none(monkeypatch, packed, backend):
    """attention_backward_items(dout=None, dlse=g): the fp64 oracle's gradients of a loss of the lse alone (dv zero),
    on the reference, on a backend without lse_gradient (one pass per item, the lse's: a zero dout cost two), on
    one with its own backward_items (given one dout of zeros for the list) and through a shared query side made
    with dout=None too (its zeros serve the lists' calls it takes)."""
    from fa4dist.kernels import registry
    from fa4dist.kernels.worklist import share_queries

    impl = {"TwoPass": TwoPass, "Listing": Listing, "Sharing": Sharing}.get(backend, lambda: None)()
    if impl is not None:
        monkeypatch.setitem(registry._BACKENDS, impl.name, impl)
    name = backend if impl is None else impl.name
    _, q, k, v, out, lse = _shared_inputs(packed)
    dlse = torch.randn(lse.shape, dtype=F64, generator=torch.Generator().manual_seed(11))
    leaves = [(t if not packed else t.unsqueeze(0)).clone().requires_grad_() for t in (q, k, v)]
    _, ref_lse = naive_attention(*leaves, causal=True)
    (ref_lse * (dlse if not packed else dlse.unsqueeze(0))).sum().backward()
    # two lists (as two ring steps), rows starting on multiples of 4 (taken by Sharing's side) and not
    cuts = [0, 4, 10, 16]
    lists = [[WorkItem(a, b - a, 0, 8, a, 0, True) for a, b in zip(cuts, cuts[1:])],
             [WorkItem(a, b - a, 8, 8, a, 8, True) for a, b in zip(cuts, cuts[1:])]]
    shared = share_queries(None, q, out, lse, deterministic=False, backend=name, dlse=dlse)
    assert (shared is not None) == (backend == "Sharing")
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for items in lists:
        attention_backward_items(None, q, k, v, out, lse, items, *got, deterministic=False, backend=name,
                                 shared=shared, dlse=dlse)
    if shared is not None:
        assert shared.state.taken == 4  # (rows 0-4 and 4-10 of each list)
        shared.finish(got[0])
    for g, leaf in zip(got[:2], leaves):
        torch.testing.assert_close(g, leaf.grad[0] if packed else leaf.grad, rtol=1e-10, atol=1e-10)
    assert leaves[2].grad is None and not got[2].any()  # (the lse does not depend on v)
    if backend == "TwoPass":
        assert impl.calls == 6  # one pass per item
        attention_backward_items(torch.zeros(out.shape, dtype=F64), q, k, v, out, lse, lists[0], *got,
                                 backend=name, dlse=dlse)
        assert impl.calls == 6 + 2 * 3  # (a dout of zeros: its pass and the lse's)
    if backend == "Listing":
        assert len(impl.douts) == 2 and all(d.shape == out.shape and d.dtype == q.dtype and not d.any()
                                            for d in impl.douts)


def test_dout_none_needs_dlse_and_a_shared_side_made_with_dout_none(sharing):
    """dout=None without dlse (no loss at all) is refused by name before any buffer is written, by the work list and
    by share_queries; a list with dout=None on a side made with a dout, or the other way round, likewise (the
    side's row sums took what it was made with)."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(True)
    dlse = torch.randn(lse.shape, dtype=F64)
    items = [WorkItem(0, 16, 0, 16, causal=True)]
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    need = r"needs dout \(out's gradient\), or dlse= with dout=None for a loss of the lse alone"
    with pytest.raises(ValueError, match="attention_backward_items .*" + need):
        attention_backward_items(None, q, k, v, out, lse, items, *grads, backend="reference", fresh_dkv=True)
    assert all((g == 7).all() for g in grads)
    with pytest.raises(ValueError, match="share_queries .*" + need):
        share_queries(None, q, out, lse, backend=sharing)
    with_dout = share_queries(dout, q, out, lse, deterministic=False, backend=sharing, dlse=dlse)
    without = share_queries(None, q, out, lse, deterministic=False, backend=sharing, dlse=dlse)
    assert with_dout.zero_dout is None and not without.zero_dout.any()
    for made, given, match in ((with_dout, None, "made \\(share_queries\\) with dout, but this call has none"),
                               (without, dout, "made \\(share_queries\\) without dout, but this call has one")):
        with pytest.raises(ValueError, match=match):
            attention_backward_items(given, q, k, v, out, lse, items, *grads, deterministic=False, backend=sharing,
                                     shared=made, dlse=dlse)
        assert all((g == 7).all() for g in grads)


def test_a_shared_query_side_refuses_other_tensors_by_name(sharing):
    """A handle serves the dout, q, out and lse it was made for (its preprocess read them): a list with v (and dout,
    out) of another head dim, another q, or other tensors of the same shape is refused by name before any item
    runs (the list took them and got gradients from the handle's rows, silently)."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(False)
    handle = share_queries(dout, q, out, lse, deterministic=False, backend=sharing)
    items = [WorkItem(0, 8, 0, 8, causal=True)]
    d8, q8, k8, v8, o8, l8 = _shared_inputs(False, head_dim_v=8)
    d12, q12, k12, v12, o12, l12 = _shared_inputs(False, n=12)
    half = [t.bfloat16() for t in (dout, q, k, v, out)] + [lse.float()]  # out may come in q's dtype or fp32
    half_handle = share_queries(half[0], half[1], half[4], half[5], deterministic=False, backend=sharing)
    for args, made, match in (
            ((d8, q, k, v8, o8, lse), handle, "for dout and out of head dim 12, but this call's v has head dim 8"),
            ((d12, q12, k12, v12, o12, l12), handle,
             r"for q of shape \(1, 16, 2, 8\), torch.float64 on cpu, but this call's q is \(1, 12, 2, 8\)"),
            ((*half[:4], half[4].float(), half[5]), half_handle,
             r"for out of shape \(1, 16, 2, 12\), torch.bfloat16 on cpu, but this call's out is .* torch.float32"),
            ((dout, q.clone(), k, v, out, lse), handle, "for another q tensor"),
            ((dout.clone(), q, k, v, out, lse), handle, "for another dout tensor")):
        grads = [torch.zeros(t.shape, dtype=torch.float32 if t.dtype == torch.bfloat16 else t.dtype)
                 for t in args[1:4]]
        with pytest.raises(ValueError, match=match):
            attention_backward_items(*args, items, *grads, deterministic=False, backend=sharing, shared=made)
        assert not any(g.any() for g in grads) and not made.state.scratch.any()


def test_a_shared_query_side_refuses_another_softmax_scale(sharing):
    """The preprocess of a shared query side scales rowsum(dout * out) by share_queries' softmax_scale: a list with
    another one is refused by name (it took the handle's, silently); the same scale, given or the default, runs."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(False)
    items = [WorkItem(0, 16, 0, 16, causal=True)]
    for made, call in ((None, 0.5), (0.5, None), (0.5, 0.25)):
        handle = share_queries(dout, q, out, lse, softmax_scale=made, deterministic=False, backend=sharing)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        shown = [re.escape(str(x if x is not None else 1 / math.sqrt(8))) for x in (made, call)]  # q's head dim
        with pytest.raises(ValueError, match=f"with softmax_scale {shown[0]}, but this call's is {shown[1]}:"):
            attention_backward_items(dout, q, k, v, out, lse, items, *grads, softmax_scale=call,
                                     deterministic=False, backend=sharing, shared=handle)
        assert not any(g.any() for g in grads)
    for scale in (None, 0.5):
        handle = share_queries(dout, q, out, lse, softmax_scale=scale, deterministic=False, backend=sharing)
        got, want = ([torch.zeros_like(t) for t in (q, k, v)] for _ in range(2))
        attention_backward_items(dout, q, k, v, out, lse, items, *got, softmax_scale=scale, deterministic=False,
                                 backend=sharing, shared=handle)
        handle.finish(got[0])
        attention_backward_items(dout, q, k, v, out, lse, items, *want, softmax_scale=scale, deterministic=False,
                                 backend="reference")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_shared_finish_checks_dq_and_can_be_called_again_after_a_refusal(sharing, packed):
    """SharedQueries.finish checks dq (the lists' fp32 dq: q's shape, device, fp32 / fp64 for fp64 inputs) before it
    marks itself finished: None was an AttributeError deep inside, and a refused call left a handle that could not
    be finished any more ("already called")."""
    from fa4dist.kernels.worklist import share_queries

    dout, q, k, v, out, lse = _shared_inputs(packed)
    handle = share_queries(dout, q, out, lse, deterministic=False, backend=sharing)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    attention_backward_items(dout, q, k, v, out, lse, [WorkItem(0, 16, 0, 16, causal=True)], dq, dk, dv,
                             deterministic=False, backend=sharing, shared=handle)
    for bad, err, match in ((None, ValueError, "SharedQueries.finish needs dq"),
                            (dq[..., :4], ValueError, r"dq must have shape \(" + ", ".join(map(str, q.shape))),
                            (dq.float(), TypeError, "dq must have dtype torch.float64, got torch.float32"),
                            (dq.to("meta"), ValueError, "dq must be on cpu")):
        with pytest.raises(err, match=match):
            handle.finish(bad)
    assert not dq.any()
    handle.finish(dq)
    want = [torch.zeros_like(t) for t in (q, k, v)]
    attention_backward_items(dout, q, k, v, out, lse, [WorkItem(0, 16, 0, 16, causal=True)], *want,
                             deterministic=False, backend="reference")
    torch.testing.assert_close(dq, want[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="already called"):
        handle.finish(dq)


def test_share_queries_checks_what_it_shares():
    """share_queries checks dout, out and lse as the work lists do (they went unchecked to the backend's shared query
    side, and on a backend without one any of them, None included, gave None) without assuming v's head dim, which
    it does not see: dout and out share q's leading dims and one last dim of their own; its deterministic flag is
    checked too, and a q that is not a tensor is named (it was an AttributeError)."""
    from fa4dist.kernels.worklist import share_queries

    q = torch.randn(1, 12, 2, 8)
    dout, out, lse = torch.randn(1, 12, 2, 12), torch.randn(1, 12, 2, 12), torch.randn(1, 2, 12)
    for args, err, match in (((None, q, out, lse), ValueError, "share_queries .* needs dout"),
                             ((dout, q, "out", lse), TypeError, "out must be a torch.Tensor, got str"),
                             ((dout, q, out, None), ValueError, "share_queries .* needs lse"),
                             ((dout, q, out[:, :5], lse), ValueError, r"out must have shape \(1, 12, 2, 12\)"),
                             ((dout[..., :8], q, out, lse), ValueError, r"dout must have shape \(1, 12, 2, 12\)"),
                             ((dout, q, out[0], lse), ValueError, r"out must have shape \(1, 12, 2, 12\)"),
                             ((dout, q, out, lse.double()), TypeError, "lse must have dtype torch.float32"),
                             ((dout.half(), q, out, lse), TypeError, "dout must have dtype torch.float32"),
                             ((dout, q, out.to("meta"), lse), ValueError, "out must be on cpu"),
                             ((dout[0], q[0], out[0], lse[0].T), ValueError, r"lse must have shape \(2, 12\)"),
                             ((dout, "q", out, lse), ValueError, "q must be packed .* or dense")):
        with pytest.raises(err, match=match):
            share_queries(*args, backend="reference")
    with pytest.raises(TypeError, match="deterministic must be a bool or None, got str"):
        share_queries(dout, q, out, lse, deterministic="yes", backend="reference")
    # v's head dim (12) differs from q's (8), packed or dense; q in bf16 with dout / out in bf16 or fp32
    assert share_queries(dout, q, out, lse, backend="reference") is None
    assert share_queries(dout[0], q[0], out[0], lse[0], backend="reference") is None
    assert share_queries(dout.bfloat16(), q.bfloat16(), out, lse, deterministic=True, backend="reference") is None


def test_backward_items_checks_deterministic_before_any_buffer_is_written():
    """attention_backward_items' deterministic flag is checked before any item runs: with fresh_dkv the loop zeroed
    dk and dv before the first item's call refused it, and an empty list took it."""
    q = torch.randn(1, 12, 2, 8)
    out, lse = torch.randn_like(q), torch.randn(1, 2, 12)
    for items in ([], [WorkItem(0, 12, 0, 12)]):
        grads = [torch.ones_like(q) for _ in range(3)]
        with pytest.raises(TypeError, match="deterministic must be a bool or None, got int"):
            attention_backward_items(q, q, q, q, out, lse, items, *grads, deterministic=1, fresh_dkv=True,
                                     backend="reference")
        assert all(bool((g == 1).all()) for g in grads)


def _random_list(rng, n_rows, n_keys, count):
    """Items over random (often overlapping) query rows, some without keys, causal or windowed or full."""
    items = []
    for _ in range(count):
        qa = rng.randrange(n_rows)
        ql = rng.randint(1, n_rows - qa)
        ka = rng.randrange(n_keys)
        kl = rng.choice([0, rng.randint(1, n_keys - ka)])
        mask = rng.choice([dict(causal=True), dict(), dict(causal=True, window=(rng.randint(0, 9), -1))])
        items.append(WorkItem(qa, ql, ka, kl, rng.randint(0, 30), rng.randint(0, 30), **mask))
    return items


@pytest.mark.parametrize("seed", range(8))
def test_forward_launches_compute_the_loop(seed):
    """The launch plan (clears, then launches of items with disjoint query rows and one variant each) run item by
    item gives the loop's bytes: every row merges its items in list order."""
    from fa4dist.kernels import attention_forward
    from fa4dist.kernels.worklist import forward_launches

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_rows, n_keys, fresh = rng.randint(3, 40), rng.randint(3, 40), seed % 2 == 0
    q = torch.randn(n_rows, 2, 8, generator=gen)
    k, v = (torch.randn(n_keys, 1, 8, generator=gen) for _ in range(2))
    items = _random_list(rng, n_rows, n_keys, rng.randint(1, 9))
    start_out, start_lse = torch.randn(n_rows, 2, 8, generator=gen), torch.randn(2, n_rows, generator=gen)
    want = start_out.clone(), start_lse.clone()
    attention_forward_items(q, k, v, items, *want, fresh=fresh, backend="reference")

    variant = lambda it: (it.causal, it.window)  # noqa: E731
    clears, launches = forward_launches(items, fresh, variant)
    got_out, got_lse = start_out.clone(), start_lse.clone()
    for a, b in clears:
        got_out[a:b] = 0
        got_lse[:, a:b] = float("-inf")
    for launch in launches:
        rows = sorted((it.q_start, it.q_start + it.q_len) for it in launch.items)
        assert all(e <= s for (_, e), (s, _) in zip(rows, rows[1:])), "a launch's items share query rows"
        assert {variant(it) for it in launch.items} == {launch.variant}
        for it in launch.items:
            assert it.k_len > 0
            attention_forward(q[it.q_start:it.q_start + it.q_len][None], k[it.k_start:it.k_start + it.k_len][None],
                              v[it.k_start:it.k_start + it.k_len][None], out=got_out[it.q_start:][:it.q_len][None],
                              lse=got_lse[:, it.q_start:it.q_start + it.q_len][None], accumulate=not launch.write,
                              backend="reference", **it.mask_kwargs())
    assert torch.equal(got_out, want[0]) and torch.equal(got_lse, want[1])
    # disjoint rows and one variant: a single launch
    disjoint = [WorkItem(10 * i, 10, 0, 5, 10 * i, 0, True) for i in range(4)]
    assert len(forward_launches(disjoint, True, variant)[1]) == 1


@pytest.mark.parametrize("seed", range(6))
def test_fresh_equals_merging_into_the_empty_result(seed):
    """fresh=True over poisoned buffers gives the bytes of fresh=False over (0, -inf) on every row an item covers,
    whatever the overlaps (an item partly over written rows keeps the rows its neighbours wrote)."""
    rng = random.Random(100 + seed)
    gen = torch.Generator().manual_seed(seed)
    n_rows, n_keys = rng.randint(3, 40), rng.randint(3, 40)
    q = torch.randn(n_rows, 2, 8, generator=gen)
    k, v = (torch.randn(n_keys, 2, 8, generator=gen) for _ in range(2))
    items = _random_list(rng, n_rows, n_keys, rng.randint(2, 9))
    items = [WorkItem(16, 2, 0, 3), WorkItem(17, 16, 3, 5), WorkItem(16, 22, 1, 7)] + items if n_rows >= 40 else items
    fresh = torch.full((n_rows, 2, 8), float("nan")), torch.full((2, n_rows), float("nan"))
    attention_forward_items(q, k, v, items, *fresh, fresh=True, backend="reference")
    merged = torch.zeros(n_rows, 2, 8), torch.full((2, n_rows), float("-inf"))
    attention_forward_items(q, k, v, items, *merged, fresh=False, backend="reference")
    covered = torch.zeros(n_rows, dtype=torch.bool)
    for it in items:
        covered[it.q_start:it.q_start + it.q_len] = True
    assert torch.equal(fresh[0][covered], merged[0][covered])
    assert torch.equal(fresh[1][:, covered], merged[1][:, covered])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("queries_shared", [False, True])
def test_backward_launches_compute_the_list(seed, queries_shared):
    """The non-deterministic backward's launches (disjoint key rows, and query rows unless shared; unmasked
    neighbours on the same keys joined) run item by item give the list's gradients (fp64, up to the order of the
    sums)."""
    from fa4dist.kernels.worklist import backward_launches

    rng = random.Random(50 + seed)
    gen = torch.Generator().manual_seed(seed)
    n_rows, n_keys = rng.randint(3, 40), rng.randint(3, 40)
    q = torch.randn(n_rows, 2, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(n_keys, 1, 8, generator=gen, dtype=F64) for _ in range(2))
    dout = torch.randn(n_rows, 2, 8, generator=gen, dtype=F64)
    items = _random_list(rng, n_rows, n_keys, rng.randint(1, 9))
    items += [WorkItem(0, 2, 1, 2), WorkItem(2, 3, 1, 2)]  # unmasked neighbours on the same keys: joined
    out, lse = torch.zeros(n_rows, 2, 8, dtype=F64), torch.full((2, n_rows), float("-inf"), dtype=F64)
    attention_forward_items(q, k, v, items, out, lse, backend="reference")
    want = [torch.zeros_like(t) for t in (q, k, v)]
    attention_backward_items(dout, q, k, v, out, lse, items, *want, backend="reference")
    launches = backward_launches(items, lambda it: (it.causal, it.window), queries_shared=queries_shared)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    joined = 0
    for launch in launches:
        for i, a in enumerate(launch.items):
            joined += a not in items
            for b in launch.items[i + 1:]:
                assert a.k_start + a.k_len <= b.k_start or b.k_start + b.k_len <= a.k_start, "shared key rows"
                if not queries_shared:
                    assert a.q_start + a.q_len <= b.q_start or b.q_start + b.q_len <= a.q_start, "shared query rows"
        attention_backward_items(dout, q, k, v, out, lse, list(launch.items), *got, backend="reference")
    assert joined >= 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("queries_shared", [False, True])
def test_fresh_key_launches_give_the_bytes_of_zero_filled_grads(seed, queries_shared):
    """Backward launches into dk / dv that hold nothing (fresh_key_launches: the parts whose key rows no earlier
    launch touched write, the others add, after their untouched rows and the rows no item has are zeroed), run
    over NaN-poisoned buffers, give the bytes of the same launches into zeros (fp32: each written row is 0 + x), and
    so does attention_backward_items(fresh_dkv=True)."""
    from fa4dist.kernels.worklist import backward_launches, fresh_key_launches

    rng = random.Random(70 + seed)
    gen = torch.Generator().manual_seed(seed)
    n_rows, n_keys = rng.randint(3, 40), rng.randint(3, 40)
    q = torch.randn(n_rows, 2, 8, generator=gen)
    k, v = (torch.randn(n_keys, 1, 8, generator=gen) for _ in range(2))
    dout = torch.randn(n_rows, 2, 8, generator=gen)
    items = _random_list(rng, n_rows, n_keys, rng.randint(1, 9))
    items += [WorkItem(0, 2, 1, 2), WorkItem(0, 3, 1, 4, 0, 0, True)]  # two launches on keys 1-2: write, then add
    out, lse = torch.zeros(n_rows, 2, 8), torch.full((2, n_rows), float("-inf"))
    attention_forward_items(q, k, v, items, out, lse, backend="reference")
    launches = backward_launches(items, lambda it: (it.causal, it.window), queries_shared=queries_shared)
    want = [torch.zeros_like(t) for t in (q, k, v)]
    for launch in launches:
        attention_backward_items(dout, q, k, v, out, lse, list(launch.items), *want, backend="reference")
    clears, parts = fresh_key_launches(launches, n_keys)
    assert [index for index, _ in parts] == sorted(index for index, _ in parts)
    got = [torch.zeros_like(q), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))]
    for a, b in clears:
        got[1][a:b] = 0
        got[2][a:b] = 0
    wrote = 0
    for _, part in parts:
        if part.write:  # the kernel's written form: its own sums, stored as 0 + x over whatever the rows held
            mine = [torch.zeros_like(t) for t in (k, v)]
            attention_backward_items(dout, q, k, v, out, lse, list(part.items), got[0], *mine, backend="reference")
            for it in part.items:
                rows = slice(it.k_start, it.k_start + it.k_len)
                got[1][rows], got[2][rows] = mine[0][rows] + 0.0, mine[1][rows] + 0.0
                wrote += 1
        else:
            attention_backward_items(dout, q, k, v, out, lse, list(part.items), *got, backend="reference")
    assert wrote >= 1 and any(not part.write for _, part in parts)
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g, w)
    if not queries_shared:  # a launch's items then have disjoint query rows too: dq's order is kept
        assert torch.equal(got[0], want[0])
    # the entry point, over poisoned buffers (the reference backend loops: it zeroes them and adds)
    fresh = [torch.zeros_like(q), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))]
    attention_backward_items(dout, q, k, v, out, lse, items, *fresh, backend="reference", fresh_dkv=True)
    looped = [torch.zeros_like(t) for t in (q, k, v)]
    attention_backward_items(dout, q, k, v, out, lse, items, *looped, backend="reference")
    for g, w in zip(fresh, looped):
        assert torch.equal(g, w)


def test_fresh_dkv_is_checked():
    q = torch.randn(4, 1, 8)
    out, lse = torch.zeros(4, 1, 8), torch.zeros(1, 4)
    with pytest.raises(ValueError, match="fresh_dkv"):
        attention_backward_items(q, q, q, q, out, lse, [WorkItem(0, 4, 0, 4)], q.clone(), None, None,
                                 backend="reference", fresh_dkv=True)
    with pytest.raises(TypeError, match="fresh_dkv"):
        attention_backward_items(q, q, q, q, out, lse, [WorkItem(0, 4, 0, 4)], q.clone(), q.clone(), q.clone(),
                                 backend="reference", fresh_dkv=1)



def test_fresh_dkv_with_one_of_dk_dv_is_refused_by_name_untouched():
    """fresh_dkv=True given dk without dv (or dv without dk): refused by name before any buffer is written (was an
    AttributeError on None after dk had been zeroed)."""
    q = torch.randn(4, 1, 8)
    out, lse = torch.zeros(4, 1, 8), torch.zeros(1, 4)
    for which in (1, 2):
        grads = [torch.zeros(4, 1, 8), torch.full((4, 1, 8), 7.0), torch.full((4, 1, 8), 7.0)]
        grads[3 - which] = None
        with pytest.raises(ValueError, match="fresh_dkv=True needs dk and dv"):
            attention_backward_items(q, q, q, q, out, lse, [WorkItem(0, 4, 0, 4)], *grads, backend="reference",
                                     fresh_dkv=True)
        assert bool((grads[which] == 7.0).all())

def test_cute_backward_plan_with_fresh_dkv():
    """The cute backward's plan over fresh dK / dV (host side, no GPU): the first launch on a key row writes, a
    later one adds; rows no item has are cleared, and so are the untouched rows of an item that adds."""
    from fa4dist.kernels.cute.backend import CuteSm90Backend

    q = torch.zeros(1, 512, 2, 128, dtype=torch.bfloat16)
    items = [WorkItem(0, 128, 0, 128, 0, 0, True), WorkItem(128, 128, 0, 192, 128, 0, True),
             WorkItem(256, 128, 256, 64, 256, 256, True)]
    clears, plan = CuteSm90Backend()._backward_plan(q, items, None, True, 400)
    assert clears == ((128, 192), (192, 256), (320, 400))
    writes = {}
    for table, tiles, max_q, max_k, causal, window_left, on_shared, write in plan:
        for qs, ql, ks, kl, diag, base in table.view(-1, 6).tolist():
            writes[(qs, ks, kl)] = (write, len(writes))
    assert writes[(0, 0, 128)][0] and writes[(256, 256, 64)][0]
    assert not writes[(128, 0, 192)][0] and writes[(128, 0, 192)][1] > writes[(0, 0, 128)][1]
    assert CuteSm90Backend()._backward_plan(q, items, None, True)[0] == ()  # not fresh: nothing cleared


@pytest.mark.parametrize("deterministic", [False, True])
def test_cute_backward_plan_splits_shared_and_own_items(deterministic):
    """The cute backward's launch plan (host side, no GPU): items the shared query side takes (rows on its 64-row
    tiles) go to launches on its scratch (base = their first tile), the others to launches with their own scratch
    (bases one after another); no launch has two items on one key row, nor (own scratch, or deterministic) on one
    query row."""
    from fa4dist.kernels.cute.backend import CuteSm90Backend

    class Rows:  # what the plan asks of backward.SharedRows
        rows = 512

        @staticmethod
        def takes(start, length):
            end = start + length
            return length > 0 and end <= 512 and start % 64 == 0 and (end % 64 == 0 or end == 512)

    q = torch.zeros(1, 512, 2, 128, dtype=torch.bfloat16)
    items = [WorkItem(0, 128, 0, 256, 256, 0), WorkItem(128, 128, 0, 256, 384, 0),  # joined: same keys, unmasked
             WorkItem(0, 256, 256, 128, 0, 0, True), WorkItem(256, 100, 0, 300, 300, 0, True),
             WorkItem(300, 90, 300, 50, 300, 300, True), WorkItem(390, 122, 384, 128, 390, 384, True)]
    clears, plan = CuteSm90Backend()._backward_plan(q, items, Rows, deterministic)
    assert clears == ()
    seen = []
    for table, tiles, max_q, max_k, causal, window_left, on_shared, write in plan:
        assert not write  # dK / dV added (fresh_dkv not asked)
        rows = table.view(-1, 6).tolist()
        for i, (qs, ql, ks, kl, diag, base) in enumerate(rows):
            assert Rows.takes(qs, ql) == on_shared
            seen.append((qs, ql, ks, kl))
            if on_shared:
                assert base == qs // 64
            for qs2, ql2, ks2, kl2, _, base2 in rows[i + 1:]:
                assert ks + kl <= ks2 or ks2 + kl2 <= ks, "two items on one key row"
                if deterministic or not on_shared:
                    assert qs + ql <= qs2 or qs2 + ql2 <= qs, "two items on one query row"
                if not on_shared:
                    assert base + -(-ql // 64) <= base2 or base2 + -(-ql2 // 64) <= base, "scratch tiles overlap"
        if not on_shared:
            assert tiles == sum(-(-r[1] // 64) for r in rows)
    assert (0, 256, 0, 256) in seen  # the two unmasked neighbours became one item
    assert sorted(seen) == sorted([(0, 256, 0, 256)] + [(i.q_start, i.q_len, i.k_start, i.k_len) for i in items[2:]])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cute_forward_plan_tables(head_dim):
    """The cute forward's launch plan (host side, no GPU): every item with keys in one launch row of the table,
    with its diagonal (unmasked items: past their last key), launches of items on disjoint query rows; unmasked
    and causal items share launches (their variants differ only in the mask; at hdim 64 they also differed in
    the rescale threshold until the fourteenth session made the rescale unconditional there)."""
    from fa4dist.kernels.cute.backend import CuteSm90Backend

    q = torch.zeros(600, 2, head_dim, dtype=torch.bfloat16)
    items = [WorkItem(0, 200, 0, 200, 0, 0, True), WorkItem(200, 200, 0, 200, 200, 0),
             WorkItem(200, 200, 200, 200, 200, 200, True), WorkItem(400, 100, 100, 0, 400, 100, True),
             WorkItem(450, 150, 0, 300, 700, 150, True, (100, -1))]
    clears, launches = CuteSm90Backend()._forward_plan(q, items, True, None, None)
    # fresh rows of an item without keys, and the untouched rows of an item partly over written ones: (0, -inf)
    assert clears == ((400, 500), (500, 600))
    seen = {}
    for table, max_q, causal, window_left, write in launches:
        rows = table.view(-1, 6).tolist()
        assert max_q == max(r[1] for r in rows)
        for i, (qs, ql, ks, kl, diag, base) in enumerate(rows):
            seen[(qs, ql, ks, kl)] = (diag, causal, window_left, write)
            for qs2, ql2, *_ in rows[i + 1:]:
                assert qs + ql <= qs2 or qs2 + ql2 <= qs
    assert seen[(0, 200, 0, 200)][0] == 0 and seen[(200, 200, 200, 200)][0] == 0
    assert seen[(200, 200, 0, 200)][0] >= 200  # unmasked: a diagonal past the last key
    assert seen[(450, 150, 0, 300)] == (700 - 150, True, 100, False)  # merges into its cleared rows
    assert seen[(200, 200, 200, 200)][3] is False and seen[(0, 200, 0, 200)][3] is True  # merge after the first
    assert seen[(200, 200, 0, 200)][1] is True  # the unmasked item rides in a causal launch
    assert len(launches) == 3


@pytest.mark.parametrize("seed", range(8))
def test_coalesce_joins_blocks_that_see_all_keys_and_keeps_the_result(seed):
    """Blocks that see all their keys and share one side (the same keys and adjacent query rows, or the same query
    rows and adjacent keys) become one, and so do causal blocks with the full block whose keys precede theirs; the
    joined list holds the same visible pairs and computes the same attention."""
    from fa4dist.kernels.mask import Mask, visible_pairs
    from fa4dist.kernels.worklist import coalesce, sees_all_keys

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    n = 64
    # query blocks of 16 rows at positions past all keys or interleaved with them; key blocks of 16
    items = []
    for qa in range(0, n, 16):
        for ka in range(0, n, 16):
            q_pos = rng.choice([qa, n + qa])  # n + qa: every key is in the row's past
            items.append(WorkItem(qa, 16, ka, 16, q_pos, ka, causal=True))
    rng.shuffle(items)
    joined = coalesce(items)
    assert len(joined) < len(items)
    def pairs(lst):
        return sum(visible_pairs(i.q_len, i.k_len, i.q_offset, i.k_offset, Mask(i.causal, i.window)) for i in lst)

    assert pairs(joined) == pairs(items)
    assert len([i for i in joined if not sees_all_keys(i)]) <= len([i for i in items if not sees_all_keys(i)])
    q, k, v = (torch.randn(n, 2, 8, dtype=F64, generator=gen) for _ in range(3))
    results = []
    for lst in (items, list(joined)):
        out = torch.full((n, 2, 8), float("nan"), dtype=F64)
        lse = torch.full((2, n), float("nan"), dtype=F64)
        attention_forward_items(q, k, v, lst, out, lse, fresh=True, backend="reference")
        results.append((out, lse))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-12, atol=1e-12)
    dout = torch.randn(n, 2, 8, dtype=F64, generator=gen)
    grads = []
    for lst in (items, list(joined)):
        g = [torch.zeros(n, 2, 8, dtype=F64) for _ in range(3)]
        attention_backward_items(dout, q, k, v, *results[0], lst, *g, backend="reference")
        grads.append(g)
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_coalesce_joins_a_causal_block_with_the_full_keys_before_it():
    """A member's later chunk against its two own chunks (LPT / zigzag): the fully visible block and the diagonal
    one become one causal item whose earlier keys sit at virtual positions just below the diagonal's, with the
    same visible pairs and the same attention (fp64, reference); windows, rows that miss an earlier key, keys that
    are not adjacent and full keys after the causal ones stay apart."""
    from fa4dist.kernels.worklist import coalesce

    full = WorkItem(8, 8, 0, 8, 120, 0)
    band = WorkItem(8, 8, 8, 8, 120, 120, causal=True)
    (one,) = coalesce([WorkItem(0, 8, 0, 8, 0, 0, causal=True), full, band])[1:]
    assert one == WorkItem(8, 8, 0, 16, 120, 112, causal=True)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(16, 2, 8, dtype=F64, generator=gen) for _ in range(4))
    lists = ([full, band], [one])
    results = []
    for lst in lists:
        out = torch.full((16, 2, 8), float("nan"), dtype=F64)
        lse = torch.full((2, 16), float("nan"), dtype=F64)
        attention_forward_items(q, k, v, lst, out, lse, fresh=True, backend="reference")
        grads = [torch.zeros(16, 2, 8, dtype=F64) for _ in range(3)]
        attention_backward_items(dout, q, k, v, out.clone(), lse, lst, *grads, backend="reference")
        results.append([out[8:], lse[:, 8:], *grads])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    apart = [
        [full, replace(band, window=(100, 0))],  # a window measures distances
        [full, replace(band, q_offset=118)],  # the first rows would miss the earlier keys
        [replace(full, k_len=7), band],  # a gap between the keys
        [replace(full, k_start=16), replace(band, k_start=0)],  # the full keys after the causal ones
    ]
    for lst in apart:
        assert coalesce(lst) == tuple(lst), lst


def test_coalesce_joins_both_sides_and_leaves_gaps_apart():
    from fa4dist.kernels.worklist import coalesce

    same_keys = [WorkItem(0, 8, 0, 16, 100, 0), WorkItem(8, 8, 0, 16, 300, 0, causal=True)]
    assert coalesce(same_keys) == (WorkItem(0, 16, 0, 16, 0, 0),)
    same_rows = [WorkItem(0, 8, 16, 16, 50, 16, causal=True), WorkItem(0, 8, 0, 16, 40, 0, causal=True)]
    (one,) = coalesce(same_rows)
    assert (one.q_start, one.q_len, one.k_start, one.k_len, one.causal) == (0, 8, 0, 32, True)
    gap = [WorkItem(0, 8, 0, 16), WorkItem(9, 8, 0, 16)]  # rows 8 .. 9 are not adjacent
    assert coalesce(gap) == tuple(gap)
    masked = [WorkItem(0, 8, 0, 16, 0, 0, causal=True), WorkItem(8, 8, 0, 16, 8, 0, causal=True)]
    assert coalesce(masked) == tuple(masked)


@pytest.mark.parametrize("field", ["q_offset", "k_offset"])
def test_an_item_offset_out_of_range_is_refused_by_name_before_any_item_runs(field):
    """An item's offset past the contract's token positions (2**62): refused with the item's index before the list
    runs (it was the contract's unnamed error from inside the loop, after the earlier items had merged into out)."""
    q = torch.randn(8, 2, 4)
    out, lse = torch.zeros(8, 2, 4), torch.full((2, 8), float("-inf"))
    items = [WorkItem(0, 8, 0, 8), WorkItem(0, 8, 0, 8, **{field: 2**62})]
    with pytest.raises(ValueError, match=rf"items\[1\].{field} must be a token position in \[-2\*\*62, 2\*\*62\)"):
        attention_forward_items(q, q, q, items, out, lse, backend="reference")
    assert not out.any() and bool(torch.isneginf(lse).all())
    grads = [torch.zeros(8, 2, 4) for _ in range(3)]
    with pytest.raises(ValueError, match=rf"items\[1\].{field} must be a token position"):
        attention_backward_items(q, q, q, q, out, lse, items, *grads, backend="reference")
    assert not any(g.any() for g in grads)


def test_backward_gradient_buffers_are_checked_for_every_list():
    """dq, dk, dv all None (nothing to add into), or dk without dv: refused by name with the work list's own words
    whatever the list holds (an empty list passed, a non-empty one failed with the contract's accumulate=True
    message from inside the loop)."""
    q = torch.randn(4, 1, 8)
    out, lse = torch.zeros(4, 1, 8), torch.zeros(1, 4)
    for items in ([], [WorkItem(0, 4, 0, 4)]):
        with pytest.raises(ValueError, match="attention_backward_items needs dq, or dk and dv"):
            attention_backward_items(q, q, q, q, out, lse, items, None, None, None, backend="reference")
        with pytest.raises(ValueError, match="attention_backward_items adds dk and dv together"):
            attention_backward_items(q, q, q, q, out, lse, items, None, torch.zeros(4, 1, 8), None,
                                     backend="reference")


def test_shared_must_be_a_shared_queries_handle():
    q = torch.randn(4, 1, 8)
    out, lse = torch.zeros(4, 1, 8), torch.zeros(1, 4)
    grads = [torch.zeros(4, 1, 8) for _ in range(3)]
    with pytest.raises(TypeError, match="shared must be a SharedQueries"):
        attention_backward_items(q, q, q, q, out, lse, [WorkItem(0, 4, 0, 4)], *grads, backend="reference",
                                 shared=object())


def test_an_item_window_of_none_is_the_unbounded_window():
    """window=None is the contract's (-1, -1): an item's is read as that, so the launch planners (which build a
    Mask of it) get a pair."""
    from fa4dist.kernels.worklist import _check_items

    (item,) = _check_items([WorkItem(0, 4, 0, 4, window=None)], 4, 4)
    assert item.window == (-1, -1)


def test_an_item_made_with_window_none_is_the_unbounded_item_everywhere():
    """WorkItem(window=None) is the item of window (-1, -1) itself (equal, one hash), so coalesce and the launch
    planners, which take items without _check_items, get a pair: coalesce raised "'NoneType' object is not
    iterable" on a causal item beside a full one, backward_launches "cannot unpack non-iterable NoneType" on two
    neighbours."""
    from fa4dist.kernels.worklist import backward_launches, coalesce

    assert WorkItem(0, 4, 0, 4, window=None) == WorkItem(0, 4, 0, 4)
    assert hash(WorkItem(0, 4, 0, 4, window=None)) == hash(WorkItem(0, 4, 0, 4))
    full, band = WorkItem(0, 4, 0, 4, 10, 0), WorkItem(0, 4, 4, 4, 4, 4, causal=True, window=None)
    assert coalesce([full, band]) == coalesce([full, replace(band, window=(-1, -1))])
    pair = [WorkItem(0, 4, 0, 4, window=None), WorkItem(4, 4, 0, 4, window=None)]
    assert backward_launches(pair, lambda it: it.window)[0].items == (WorkItem(0, 8, 0, 4),)


@pytest.mark.parametrize("seed", range(4))
def test_coalesce_of_random_lists_keeps_every_visible_pair(seed):
    """Random small lists (causal or not, windows, q_len != k_len, negative offsets, empty items, items sharing
    rows or keys): the coalesced list holds exactly the (query row, key row) pairs visible in the list, with their
    multiplicity (the mask written out by hand)."""
    from fa4dist.kernels.worklist import coalesce

    rng = random.Random(seed)
    joined = 0
    for _ in range(1500):
        items = []
        for _ in range(rng.randint(2, 6)):
            window = rng.choice([(-1, -1)] * 4 + [(rng.randint(0, 5), -1), (rng.randint(0, 5), rng.randint(0, 5)),
                                                  (-1, 0)])
            items.append(WorkItem(rng.choice([0, 4, 8]), rng.choice([0, 1, 4, 8]), rng.choice([0, 3, 4, 6, 8, 10]),
                                  rng.choice([0, 1, 2, 3, 4, 6]), rng.randint(-10, 12), rng.randint(-10, 12),
                                  causal=rng.random() < 0.6, window=window))
        got = coalesce(items)
        assert visible_item_pairs(got) == visible_item_pairs(items), (items, got)
        joined += len(got) < len(items)
    assert joined


def test_a_zero_dim_k_or_v_is_refused_by_name():
    """A 0-d k (or v) beside a packed q: before, an IndexError ("tuple index out of range") while the work list
    read k's token count; now the contract's error naming k's rank."""
    q = torch.randn(6, 2, 8)
    out, lse = torch.zeros(6, 2, 8), torch.full((2, 6), float("-inf"))
    with pytest.raises(ValueError, match=r"k must be 3-D \(total_tokens, heads, head_dim\), got shape \(\)"):
        attention_forward_items(q, torch.tensor(1.0), q, [WorkItem(0, 3, 0, 3)], out, lse)
    with pytest.raises(ValueError, match=r"v must be 3-D \(total_tokens, heads, head_dim\), got shape \(\)"):
        attention_forward_items(q, q, torch.tensor(1.0), [WorkItem(0, 3, 0, 3)], out, lse)


def test_overlap_previous_is_checked_and_reaches_only_a_backend_that_takes_it(monkeypatch):
    """overlap_previous is a bool (named when not), changes no bit on a backend without it, and reaches
    forward_items only where the backend declares ``overlaps_previous`` (the registry's forward_items signature
    has no such argument)."""
    from fa4dist.kernels import registry
    from fa4dist.kernels.reference import ReferenceBackend

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 48, 2, 16, dtype=F64, generator=gen) for _ in range(3))
    items = [WorkItem(0, 48, 0, 24, 48, 0, True), WorkItem(0, 48, 24, 24, 48, 24, True)]

    def run(backend, **kw):
        out, lse = torch.full((1, 48, 2, 16), float("nan"), dtype=F64), torch.full((1, 2, 48), float("nan"), dtype=F64)
        return attention_forward_items(q, k, v, items, out, lse, fresh=True, backend=backend, **kw)

    with pytest.raises(TypeError, match="overlap_previous must be a bool"):
        run("reference", overlap_previous=1)
    plain = run("reference")
    assert all(torch.equal(a, b) for a, b in zip(plain, run("reference", overlap_previous=True)))

    class Lister(ReferenceBackend):
        name, seen = "test_lister", []

        def forward_items(self, q, k, v, items, out, lse, *, softmax_scale, softcap, fresh, **kw):
            self.seen.append(kw)
            return None  # (the contract then loops over the items)

    class Overlapping(Lister):
        name, seen, overlaps_previous = "test_overlapping", [], True

    for backend in (Lister(), Overlapping()):
        monkeypatch.setitem(registry._BACKENDS, backend.name, backend)
        for overlap in (False, True):
            assert all(torch.equal(a, b) for a, b in zip(plain, run(backend.name, overlap_previous=overlap)))
    assert Lister.seen == [{}, {}]
    assert Overlapping.seen == [{}, {"overlap_previous": True}]
