"""Non-finite values: a masked pair contributes nothing, whatever the masked key, value, query or gradient holds.

Garbage (NaN, +-inf) planted at positions a row cannot see must leave that row's out/lse/dq (and a key's dk/dv when
only rows that cannot see it are bad) exactly as on clean input, for one call and for the same keys split into blocks
merged in fp32 (the split must not change which rows are NaN).  A row that sees garbage reports a non-finite result;
lse = -inf stays reserved for rows that see no key.  The reference runs here; GPU backends in the marked tests."""

from __future__ import annotations

import math
import random

import pytest
import torch

import fa4dist
from fa4dist.kernels import attention_backward, attention_forward, available_backends
from fa4dist.kernels.guard import guarded_causal_backward, guarded_causal_forward
from oracle import REL_TOL, naive_attention

GARBAGE = (float("nan"), float("inf"), float("-inf"))


def _inputs(gen, dtype, device, batch=2, seqlen=70, heads=4, heads_kv=2, d=16):
    shape = (batch, seqlen)
    q = torch.randn(*shape, heads, d, generator=gen).to(device, dtype)
    k = torch.randn(*shape, heads_kv, d, generator=gen).to(device, dtype)
    v = torch.randn(*shape, heads_kv, d, generator=gen).to(device, dtype)
    dout = torch.randn(*shape, heads, d, generator=gen).to(device, dtype)
    return q, k, v, dout


def _forward_split(q, k, v, splits, backend):
    """Causal attention of the whole sequence as key blocks merged into a running fp32 result."""
    out = torch.zeros(q.shape, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=out.dtype, device=q.device)
    bounds = [0, *splits, k.shape[1]]
    for a, b in zip(bounds, bounds[1:]):
        attention_forward(q, k[:, a:b], v[:, a:b], causal=True, k_offset=a, out=out, lse=lse, accumulate=True,
                          backend=backend)
    return out, lse


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("where", ["k", "v"])
def test_masked_keys_contribute_nothing_forward(garbage, where):
    gen = torch.Generator().manual_seed(1)
    q, k, v, _ = _inputs(gen, torch.float64, "cpu")
    p = 41  # rows < p cannot see key p
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    (k if where == "k" else v)[:, p, 1] = garbage
    rng = random.Random(2)
    for splits in ([], [p], sorted(rng.sample(range(1, 70), 3)), [10, 20, 30, 40, 50, 60]):
        out, lse = _forward_split(q, k, v, splits, "reference") if splits else attention_forward(
            q, k, v, causal=True, backend="reference")
        torch.testing.assert_close(out[:, :p], ref_out[:, :p], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[..., :p], ref_lse[..., :p], rtol=1e-12, atol=1e-12)
        # query heads 2, 3 read kv head 1: their rows from p on see the garbage
        assert not torch.isfinite(out[:, p:, 2:]).any(), splits
        torch.testing.assert_close(out[:, p:, :2], ref_out[:, p:, :2], rtol=1e-12, atol=1e-12)
        if where == "k":
            assert torch.isnan(lse[:, 2:, p:]).all(), "a row whose scores are not finite reports lse = NaN"
        assert not torch.isneginf(lse).any()


def test_masked_rows_contribute_nothing_backward():
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = _inputs(gen, torch.float64, "cpu")
    r = 17  # keys > r are not seen by row r
    out, lse = attention_forward(q, k, v, causal=True, backend="reference")
    clean = attention_backward(dout, q, k, v, out, lse, causal=True, backend="reference")
    for tensor in ("q", "dout"):
        t = {"q": q, "dout": dout}[tensor].clone()
        t[:, r, 3] = float("nan")
        qq, dd = (t, dout) if tensor == "q" else (q, t)
        o, lse2 = attention_forward(qq, k, v, causal=True, backend="reference")
        dq, dk, dv = attention_backward(dd, qq, k, v, o, lse2, causal=True, backend="reference")
        torch.testing.assert_close(dk[:, r + 1:], clean[1][:, r + 1:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dv[:, r + 1:], clean[2][:, r + 1:], rtol=1e-12, atol=1e-12)
        rows = torch.ones(q.shape[1], dtype=torch.bool)
        rows[r] = False
        torch.testing.assert_close(dq[:, rows], clean[0][:, rows], rtol=1e-12, atol=1e-12)
        assert not torch.isfinite(dq[:, r, 3]).all()
        assert not torch.isfinite(dk[:, : r + 1, 1]).all()  # kv head 1 serves query head 3


def test_masked_keys_packed_documents():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 20, 45, 70], dtype=torch.int32)
    q, k, v, _ = (t[0] for t in _inputs(gen, torch.float64, "cpu", batch=1))
    ref_out, ref_lse = naive_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    v[30] = float("nan")  # document 1, position 10
    k[0, 0] = float("inf")  # document 0, position 0: every row of document 0 sees it
    out, lse = attention_forward(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="reference")
    ok = torch.zeros(70, dtype=torch.bool)
    ok[20:30] = True
    ok[45:] = True
    torch.testing.assert_close(out[ok], ref_out[ok], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:, ok], ref_lse[:, ok], rtol=1e-12, atol=1e-12)
    assert not torch.isfinite(out[30:45]).any()
    assert not torch.isfinite(out[:20, :2]).any() and torch.isfinite(out[:20, 2:]).all()


def test_infinite_query_reports_nan_not_minus_inf():
    gen = torch.Generator().manual_seed(5)
    q, k, v, _ = _inputs(gen, torch.float64, "cpu")
    q[0, 9, 0] = float("inf")
    out, lse = attention_forward(q, k, v, causal=True, q_offset=0, k_offset=5, backend="reference")
    assert torch.isnan(lse[0, 0, 9]) and torch.isnan(out[0, 9, 0]).all()
    # rows 0..4 see no key at all (k_offset 5): those are the only -inf rows, with out = 0
    assert torch.isneginf(lse[..., :5]).all() and (out[:, :5] == 0).all()
    assert not torch.isneginf(lse[..., 5:]).any()


# ---------------------------------------------------------------------------------------------------------------
# the guard around kernels that leak (torch's fused ops), checked with a deliberately leaky kernel


def _leaky_causal(q, k, v):
    """Dense causal attention the way a fused kernel multiplies: P @ V over the whole tile (0 x NaN leaks)."""
    group = q.shape[-2] // k.shape[-2]
    ke, ve = k.repeat_interleave(group, -2), v.repeat_interleave(group, -2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) / q.shape[-1] ** 0.5
    n = q.shape[1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)), ve), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_seen_nan_survives_a_merge_whose_weight_underflows(dtype):
    """A row that sees a NaN value is NaN however its keys are split, and with a sink: the merges clear only rows
    that saw no key (lse -inf), not a partial whose weight underflows to 0 against a much larger score."""
    from fa4dist.kernels import merge_partials

    gap = 200.0 if dtype == torch.float32 else 2000.0  # exp(-gap) is 0 in the dtype
    q = torch.ones(1, 1, 1, 1, dtype=dtype)
    k = torch.tensor([-gap / 2, gap / 2], dtype=dtype).view(1, 2, 1, 1)
    v = torch.tensor([float("nan"), 1.0], dtype=dtype).view(1, 2, 1, 1)
    kw = dict(softmax_scale=1.0)
    assert torch.isnan(attention_forward(q, k, v, **kw)[0]).all()  # one call: the row sees the NaN value
    out, lse = torch.zeros(1, 1, 1, 1, dtype=dtype), torch.full((1, 1, 1), float("-inf"), dtype=dtype)
    for j in range(2):
        attention_forward(q, k[:, j:j + 1], v[:, j:j + 1], k_offset=j, out=out, lse=lse, accumulate=True, **kw)
    assert torch.isnan(out).all()
    parts = [attention_forward(q, k[:, j:j + 1], v[:, j:j + 1], k_offset=j, **kw) for j in range(2)]
    assert torch.isnan(merge_partials([p[0] for p in parts], [p[1] for p in parts])[0]).all()
    sinks = torch.tensor([gap], dtype=dtype)  # a sink that outweighs the keys
    assert torch.isnan(attention_forward(q, k, v, sinks=sinks, **kw)[0]).all()
    # rows that saw no key still contribute nothing, whatever their out holds
    garbage = torch.full((1, 1, 1, 1), float("nan"), dtype=dtype)
    unseen = torch.full((1, 1, 1), float("-inf"), dtype=dtype)
    merged, _ = merge_partials([garbage, parts[1][0]], [unseen, parts[1][1]])
    assert torch.equal(merged, parts[1][0].to(merged.dtype))


def test_guard_stops_a_leaky_kernel():
    gen = torch.Generator().manual_seed(6)
    q, k, v, _ = _inputs(gen, torch.float64, "cpu")
    p = 33
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    v[:, p, 0] = float("nan")
    k[:, p + 5, 1] = float("inf")
    leaky_out, _ = _leaky_causal(q, k, v)
    assert not torch.isfinite(leaky_out[:, :p]).all(), "the test kernel must leak, or this test proves nothing"
    out, lse = guarded_causal_forward(_leaky_causal, q, k, v)
    torch.testing.assert_close(out[:, :p], ref_out[:, :p], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[..., :p], ref_lse[..., :p], rtol=1e-12, atol=1e-12)
    assert not torch.isfinite(out[:, p:, :2]).any()
    want = attention_forward(q, k, v, causal=True, backend="reference")
    assert torch.equal(torch.isfinite(out), torch.isfinite(want[0]))


def test_guard_backward_matches_reference_on_clean_positions():
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = _inputs(gen, torch.float64, "cpu", batch=1)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    q, k, v, dout = (t[0] for t in (q, k, v, dout))
    out, lse = attention_forward(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="reference")
    k[12, 0] = float("nan")
    dout[50, 1] = float("inf")
    want = attention_backward(dout, q, k, v, out, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              backend="reference")

    def leaky_packed_backward(do_, q_, k_, v_, o_, l_):
        """The backward formulas given the global out/lse, multiplied the way a fused kernel does."""
        grads = [torch.zeros_like(t) for t in (q_, k_, v_)]
        scale = q_.shape[-1] ** -0.5
        for a, b in ((0, 30), (30, 70)):
            qs, ks, vs, dos, os_ = (t[a:b] for t in (q_, k_, v_, do_, o_))
            group = qs.shape[-2] // ks.shape[-2]
            ke, ve = ks.repeat_interleave(group, -2), vs.repeat_interleave(group, -2)
            s_ = torch.einsum("qhd,khd->hqk", qs, ke) * scale
            s_ = s_.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
            probs = torch.exp(s_ - l_[:, a:b].unsqueeze(-1))
            dp = torch.einsum("qhd,khd->hqk", dos, ve)
            delta = (dos * os_).sum(-1).transpose(0, 1).unsqueeze(-1)
            ds = probs * (dp - delta)
            grads[0][a:b] = torch.einsum("hqk,khd->qhd", ds, ke) * scale
            grads[1][a:b] = torch.einsum("hqk,qhd->khd", ds, qs).unflatten(1, (-1, group)).sum(2) * scale
            grads[2][a:b] = torch.einsum("hqk,qhd->khd", probs, dos).unflatten(1, (-1, group)).sum(2)
        return grads

    leaked = leaky_packed_backward(dout, q, k, v, out, lse)
    assert not torch.equal(torch.isfinite(leaked[0]), torch.isfinite(want[0])), "the test kernel must leak"
    got = guarded_causal_backward(leaky_packed_backward, dout, q, k, v, out, lse, cu)
    for g, w in zip(got, want):
        assert torch.equal(torch.isfinite(g), torch.isfinite(w))
        fin = torch.isfinite(w)
        torch.testing.assert_close(g[fin], w[fin], rtol=1e-9, atol=1e-9)



@pytest.mark.parametrize("where", ["v", "out", "k", "q", "dout", "lse"])
def test_guarded_backward_poisons_the_gradients_the_reference_makes_nan(where):
    """dv_j = sum_i P_ij dout_i reads neither v_j nor out_i: a non-finite value vector (or output row) makes dk and
    the rows' dq NaN but leaves dv finite in the reference (and in the fused kernel on the cleaned inputs).  The
    guard poisoned dv too (every bad key, every key a bad row sees), so sdpa's dv was NaN where the reference's is
    finite; now both give the same non-finite pattern for every input a row or key can hold garbage in."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = _inputs(gen, torch.float64, "cpu", batch=1, seqlen=24)
    out, lse = attention_forward(q, k, v, causal=True, backend="reference")
    inputs = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    if where == "lse":
        inputs[where][0, 1, 9] = float("nan")
    else:
        inputs[where][0, 9, 1] = float("nan")  # one token's head vector (a kv head for k and v)
    args = [inputs[n] for n in ("dout", "q", "k", "v", "out", "lse")]
    want = attention_backward(*args, causal=True, backend="reference")

    def kernel(*t):
        return attention_backward(*t, causal=True, backend="reference")

    got = guarded_causal_backward(kernel, *args)
    assert any(not torch.isfinite(w).all() for w in want)
    for g, w in zip(got, want):
        assert torch.equal(torch.isfinite(g), torch.isfinite(w))


# ---------------------------------------------------------------------------------------------------------------
# GPU backends


def _gpu_backends():
    if not torch.cuda.is_available():
        return ["sdpa"]
    return [b for b in available_backends("cuda") if b != "reference"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _gpu_backends())
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_gpu_backend_masked_garbage(backend, layout):
    gen = torch.Generator().manual_seed(8)
    n, heads = 1000, 4  # not a multiple of any tile
    q, k, v, dout = _inputs(gen, torch.bfloat16, "cuda", batch=1, seqlen=n, heads=heads, heads_kv=heads, d=64)
    kw = dict(causal=True)
    if layout == "packed":
        q, k, v, dout = (t[0] for t in (q, k, v, dout))
        cu = torch.tensor([0, 300, 1000], dtype=torch.int32, device="cuda")
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref_out, ref_lse = naive_attention(q.cpu(), k.cpu(), v.cpu(), **{a: (b.cpu() if torch.is_tensor(b) else b)
                                                                    for a, b in kw.items()})
    seq = (lambda t: t) if layout == "packed" else (lambda t: t[0])
    for p, garbage in ((250, float("nan")), (999, float("inf"))):
        kk, vv = k.clone(), v.clone()
        seq(vv)[p] = garbage
        seq(kk)[p - 3] = garbage
        out, lse = attention_forward(q, kk, vv, backend=backend, **kw)
        rows = slice(0, p - 3)
        err = (seq(out)[rows].double().cpu() - seq(ref_out)[rows]).norm() / seq(ref_out)[rows].norm()
        assert err < REL_TOL[torch.bfloat16], (backend, layout, p, float(err))
        assert not torch.isfinite(seq(out)[p - 3:p + 1].float()).all()
        assert not torch.isneginf(lse).any()
        dq, dk, dv = attention_backward(dout, q, kk, vv, out, lse, backend=backend, **kw)
        assert torch.isfinite(seq(dq)[rows].float()).all(), (backend, layout)


def test_band_any_matches_its_definition():
    """kernels/guard._band_any (prefix counts, or the first / last flag for a half-open band) against the loop
    that defines it: row i sees a flag at j with lo <= j - i <= hi within i's segment."""
    from fa4dist.kernels.guard import _band_any

    gen = torch.Generator().manual_seed(3)
    for trial in range(240):
        m = int(torch.randint(1, 30, (1,), generator=gen))
        flags = torch.rand(2, m, 3, generator=gen) < (0.0, 0.08, 0.4)[trial % 3]
        lo, hi = (None, -3, 0, 2)[trial % 4], (None, 0, 3, -1)[(trial // 4) % 4]
        if lo is not None and hi is not None and hi < lo:
            continue
        cuts = None
        if trial % 2:
            cuts = sorted({0, m, *torch.randint(0, m + 1, (3,), generator=gen).tolist()})
        n_out = m if cuts else m + (trial // 16) % 3 * 4 - 4
        if n_out < 1:
            continue
        want = torch.zeros(2, n_out, 3, dtype=torch.bool)
        for i in range(n_out):
            seg_lo, seg_hi = 0, m
            if cuts:
                seg_lo = max(c for c in cuts if c <= i)
                seg_hi = min((c for c in cuts if c > i), default=m)
            for j in range(seg_lo, seg_hi):
                if (lo is None or j - i >= lo) and (hi is None or j - i <= hi):
                    want[:, i] |= flags[:, j]
        cu = torch.tensor(cuts) if cuts else None
        got = _band_any(flags if cu is None else flags[0], n_out, lo, hi, cu)
        assert torch.equal(got, want if cu is None else want[0]), (trial, lo, hi, m, n_out, cuts)


def test_guard_takes_a_call_without_tokens():
    """A packed sliding-window call whose documents are all empty (cu_seqlens [0, 0]: sdpa's flash path takes it as
    square, aligned segments) has no token to flag: the guard passes the kernel's empty results through (it took a
    slice of the first token and raised)."""
    from fa4dist.kernels.guard import _band_any, guarded_backward, guarded_forward

    cu = torch.tensor([0, 0], dtype=torch.int32)
    q, k = torch.zeros(0, 4, 8), torch.zeros(0, 2, 8)
    lse = torch.zeros(4, 0)
    out, got_lse = guarded_forward(lambda q_, k_, v_: (torch.zeros_like(q_), lse), q, k, k, -3, 2, cu)
    assert out.shape == (0, 4, 8) and got_lse.shape == (4, 0)
    grads = guarded_backward(lambda *t: (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k)),
                             q, q, k, k, q, lse, -3, 2, cu)
    assert [tuple(g.shape) for g in grads] == [(0, 4, 8), (0, 2, 8), (0, 2, 8)]
    # no key at all: no row sees a flagged one, whatever the band
    assert not _band_any(torch.zeros(2, 0, 3, dtype=torch.bool), 5, -1, 2, None).any()


# ---------------------------------------------------------------------------------------------------------------
# non-finite sinks: the sink is one more key (score sink_h, value 0), merged as the partial (out = 0, lse = sink_h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sink", [float("inf"), float("nan")])
def test_a_non_finite_sink_makes_its_heads_rows_nan(dtype, sink):
    """A +inf or NaN sink is a non-finite score every row of its head sees: those rows' softmax is undefined, so
    out and lse are NaN (as for a row that sees a non-finite key), rows that see no real key included, and so is
    the sink's gradient; the other heads are untouched.  Before: a +inf sink gave out = 0 with lse = NaN (the merge
    dropped the sink's NaN weight), and a row that saw no key gave out = 0 with a NaN lse for either sink."""
    from fa4dist.kernels import merge_partials
    from fa4dist.kernels.merge import with_sink

    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = _inputs(gen, dtype, "cpu", batch=1, seqlen=12, heads=4, heads_kv=2, d=8)
    kw = dict(causal=True, k_offset=3)  # rows 0..2 see no key
    finite = torch.randn(4, dtype=dtype, generator=gen)
    sinks = finite.clone()
    sinks[1] = sink
    want_out, want_lse = attention_forward(q, k, v, sinks=finite, **kw)
    out, lse = attention_forward(q, k, v, sinks=sinks, **kw)
    assert torch.isnan(out[:, :, 1]).all() and torch.isnan(lse[:, 1]).all()
    others = [0, 2, 3]
    assert torch.equal(out[:, :, others], want_out[:, :, others]) and torch.equal(lse[:, others], want_lse[:, others])
    # the same keys split over two accumulate calls, the sinks in the second
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    run_out = torch.zeros(out.shape, dtype=acc)
    run_lse = torch.full(lse.shape, float("-inf"), dtype=acc)
    for a, b, s in ((0, 5, None), (5, 12, sinks)):
        attention_forward(q, k[:, a:b], v[:, a:b], causal=True, k_offset=3 + a, sinks=s, out=run_out, lse=run_lse,
                          accumulate=True)
    assert torch.equal(torch.isnan(run_out), torch.isnan(out.to(acc))) and torch.isnan(run_lse[:, 1]).all()
    # the out-of-place, differentiable merge and merge_partials of the virtual partial (0, sink) agree
    keys_out, keys_lse = attention_forward(q, k, v, **kw)
    merged = with_sink(keys_out.to(acc), keys_lse, sinks)
    partial = merge_partials([keys_out, torch.zeros_like(keys_out)], [keys_lse, sinks.to(acc).view(-1, 1).expand(
        keys_lse.shape[1:]).unsqueeze(0)])
    for got_out, got_lse in (merged, partial):
        assert torch.isnan(got_out[:, :, 1]).all() and torch.isnan(got_lse[:, 1]).all()
    # backward: the head's sink gradient is NaN, the others' finite
    dsinks = attention_backward(dout, q, k, v, out, lse, sinks=sinks, **kw)[3]
    assert torch.isnan(dsinks[1]) and torch.isfinite(dsinks[others]).all()
    leaf = sinks.clone().requires_grad_()
    got = fa4dist.attention(q, k, v, sinks=leaf, **kw)
    assert torch.equal(torch.isnan(got), torch.isnan(out))
    got.backward(dout)
    assert torch.isnan(leaf.grad[1]) and torch.isfinite(leaf.grad[others]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_minus_inf_sink_is_no_sink(dtype):
    """A -inf sink weighs exp(-inf) = 0: its head's rows are those without sinks (a row that sees no key keeps
    out = 0, lse = -inf), and its gradient is 0."""
    gen = torch.Generator().manual_seed(10)
    q, k, v, dout = _inputs(gen, dtype, "cpu", batch=1, seqlen=12, heads=4, heads_kv=2, d=8)
    kw = dict(causal=True, k_offset=3)
    sinks = torch.randn(4, dtype=dtype, generator=gen)
    sinks[2] = float("-inf")
    out, lse = attention_forward(q, k, v, sinks=sinks, **kw)
    plain_out, plain_lse = attention_forward(q, k, v, **kw)
    torch.testing.assert_close(out[:, :, 2], plain_out[:, :, 2], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, 2], plain_lse[:, 2], rtol=0, atol=0)
    assert torch.isneginf(lse[:, 2, :3]).all() and (out[:, :3, 2] == 0).all()
    dsinks = attention_backward(dout, q, k, v, out, lse, sinks=sinks, **kw)[3]
    assert dsinks[2] == 0 and torch.isfinite(dsinks).all()


def test_scores_that_overflow_to_neg_inf_weigh_nothing_beside_a_finite_one_and_alone_are_undefined():
    """README, Range: finite inputs whose scaled product passes fp32's range give a -inf score. Beside a finite score
    of the same call it weighs nothing; a call in which it is all a row sees has no defined softmax (NaN), so the
    row merged from such a split is NaN where one call gives the finite row (documented, not hidden)."""
    q = torch.tensor([1e20, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[-1e20, 0.0], [1e-20, 0.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[5.0, 6.0], [7.0, 8.0]]).view(1, 2, 1, 2)
    out, lse = attention_forward(q, k, v, backend="reference")
    assert torch.equal(out, v[:, 1:]) and torch.isfinite(lse).all()
    alone_out, alone_lse = attention_forward(q, k[:, :1], v[:, :1], backend="reference")
    assert torch.isnan(alone_lse).all() and torch.isnan(alone_out).all()
    run_out, run_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    for j in (0, 1):
        attention_forward(q, k[:, j:j + 1], v[:, j:j + 1], k_offset=j, out=run_out, lse=run_lse, accumulate=True,
                          backend="reference")
    assert torch.isnan(run_lse).all() and torch.isnan(run_out).all()
