"""Sliding windows, softcap and attention sinks through the kernel contract, against the independent fp64 oracle.

Every mask combination (causal or not, packed documents or not, window left/right bounded or not, softcap or not,
sinks or not, GQA) with the keys split at random into 1..8 blocks merged through the contract's accumulate mode
(running result poisoned with NaN first; the sinks passed to exactly one block), forward and backward (dsinks
included) at 1e-10.  Then: the split and N-way merge paths agree, autograd and double backward of
``fa4dist.attention``, clear errors for bad options, garbage outside the window contributing nothing, and the sdpa
backend's window path run on the CPU against a leaky emulation of torch's flash op (the real op: the gpu tests)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import random

import pytest
import torch

import fa4dist
from fa4dist.kernels import attention_backward, attention_forward, merge_partials
from fa4dist.kernels.merge import merge_sink_
from oracle import flash_op_keep, naive_attention

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)

COMBOS = list(itertools.product([False, True], [False, True], [-1, 3], [-1, 2], [None, 1.5], [False, True]))


def _combo_id(c):
    causal, docs, left, right, softcap, sinks = c
    return (f"{'causal' if causal else 'full'}-{'docs' if docs else 'dense'}-w{left},{right}"
            f"{'-cap' if softcap else ''}{'-sinks' if sinks else ''}")


class Case:
    """Inputs of one combination: dense (batch 2, q and k at different offsets) or packed documents (per-segment
    offsets, q and k segments of different lengths), GQA."""

    def __init__(self, seed, causal, docs, window, softcap, with_sinks):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        self.rng, self.docs = rng, docs
        heads_kv = rng.choice([1, 2])
        heads_q = heads_kv * rng.choice([2, 3])
        d = 8
        if docs:
            q_lens = [rng.randint(0 if i == 2 else 1, 12) for i in range(4)]
            k_lens = [max(0, n + rng.randint(-3, 3)) for n in q_lens]
            self.cu_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
            self.cu_k = torch.tensor([0] + list(itertools.accumulate(k_lens)), dtype=torch.int32)
            self.q_off = [rng.randint(0, 6) for _ in q_lens]
            self.k_off = [rng.randint(0, 6) for _ in q_lens]
            q_shape, k_shape = (int(self.cu_q[-1]), heads_q, d), (int(self.cu_k[-1]), heads_kv, d)
        else:
            self.cu_q = self.cu_k = None
            self.q_off, self.k_off = rng.randint(0, 12), rng.randint(0, 4)
            q_shape, k_shape = (2, rng.randint(9, 20), heads_q, d), (2, rng.randint(9, 24), heads_kv, d)
        self.q = torch.randn(q_shape, dtype=F64, generator=gen)
        self.k = torch.randn(k_shape, dtype=F64, generator=gen)
        self.v = torch.randn(k_shape, dtype=F64, generator=gen)
        self.dout = torch.randn(q_shape, dtype=F64, generator=gen)
        self.sinks = torch.randn(heads_q, dtype=F64, generator=gen) if with_sinks else None
        self.opts = dict(causal=causal, window=window, softcap=softcap, softmax_scale=rng.choice([None, 0.7]))

    def oracle(self):
        """out, lse and the gradients of q, k, v (and sinks) by autograd through the oracle."""
        leaves = [t.clone().requires_grad_() for t in (self.q, self.k, self.v)]
        sinks = self.sinks.clone().requires_grad_() if self.sinks is not None else None
        out, lse = naive_attention(*leaves, sinks=sinks, q_offset=self.q_off, k_offset=self.k_off,
                                   cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, **self.opts)
        out.backward(self.dout)
        grads = [t.grad for t in leaves] + ([sinks.grad] if sinks is not None else [])
        return out.detach(), lse.detach(), grads

    def key_blocks(self, n_blocks):
        """A random split of the keys into n_blocks blocks: per block the key indices (along the token dim) and the
        contract arguments that place it (k_offset, and cu_seqlens_k for packed documents)."""
        rng = self.rng
        if not self.docs:
            sk = self.k.shape[1]
            cuts = sorted(rng.sample(range(1, sk), min(n_blocks - 1, sk - 1)))
            bounds = [0, *cuts, sk]
            return [(torch.arange(a, b), dict(k_offset=self.k_off + a)) for a, b in zip(bounds, bounds[1:])]
        cu = self.cu_k.tolist()
        parts = []  # per segment: n_blocks (start, end) within the segment
        for s in range(len(cu) - 1):
            n = cu[s + 1] - cu[s]
            cuts = sorted(rng.choice(range(n + 1)) for _ in range(n_blocks - 1))
            bounds = [0, *cuts, n]
            parts.append(list(zip(bounds, bounds[1:])))
        blocks = []
        for b in range(n_blocks):
            index = torch.cat([torch.arange(cu[s] + a, cu[s] + e) for s, ps in enumerate(parts)
                               for a, e in [ps[b]]]).long()
            lens = [ps[b][1] - ps[b][0] for ps in parts]
            cu_b = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
            k_off = [self.k_off[s] + ps[b][0] for s, ps in enumerate(parts)]
            blocks.append((index, dict(k_offset=k_off, cu_seqlens_k=cu_b)))
        return blocks

    def call_kwargs(self, extra):
        kw = dict(self.opts, q_offset=self.q_off, backend="reference", **extra)
        if self.docs:
            kw["cu_seqlens_q"] = self.cu_q
        return kw

    @property
    def seq_dim(self):
        return 0 if self.docs else 1


@pytest.mark.parametrize("combo", COMBOS, ids=[_combo_id(c) for c in COMBOS])
def test_split_keys_match_the_oracle(combo):
    causal, docs, left, right, softcap, with_sinks = combo
    seed = COMBOS.index(combo)
    case = Case(seed, causal, docs, (left, right), softcap, with_sinks)
    ref_out, ref_lse, ref_grads = case.oracle()
    sd = case.seq_dim
    blocks = case.key_blocks(random.Random(seed).randint(1, 8))
    sink_block = random.Random(seed + 1).randrange(len(blocks))  # the sinks join exactly one call

    out = torch.full(ref_out.shape, float("nan"), dtype=F64)  # garbage where lse = -inf must not leak
    lse = torch.full(ref_lse.shape, float("-inf"), dtype=F64)
    for b, (index, place) in enumerate(blocks):
        sinks = case.sinks if b == sink_block else None
        k, v = case.k.index_select(sd, index), case.v.index_select(sd, index)
        attention_forward(case.q, k, v, out=out, lse=lse, accumulate=True, sinks=sinks, **case.call_kwargs(place))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)  # -inf rows compare equal

    dq, dk, dv = torch.zeros_like(case.q), torch.zeros_like(case.k), torch.zeros_like(case.v)
    dsinks = torch.zeros(case.q.shape[-2], dtype=F64) if with_sinks else None
    for b, (index, place) in enumerate(blocks):
        k, v = case.k.index_select(sd, index), case.v.index_select(sd, index)
        dk_b, dv_b = torch.zeros_like(k), torch.zeros_like(v)
        extra = dict(sinks=case.sinks, dsinks=dsinks) if with_sinks and b == sink_block else {}
        attention_backward(case.dout, case.q, k, v, out, lse, dq=dq, dk=dk_b, dv=dv_b, accumulate=True,
                           **case.call_kwargs(dict(place, **extra)))
        dk.index_add_(sd, index, dk_b)
        dv.index_add_(sd, index, dv_b)
    got = [dq, dk, dv] + ([dsinks] if with_sinks else [])
    for name, g, want in zip(("dq", "dk", "dv", "dsinks"), got, ref_grads):
        torch.testing.assert_close(g, want, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("seed", range(4))
def test_n_way_merge_with_the_sink_merged_once_equals_one_call(seed):
    case = Case(100 + seed, seed % 2 == 0, seed >= 2, (4, -1 if seed % 2 == 0 else 1), 2.0, True)
    sd = case.seq_dim
    full_out, full_lse = attention_forward(case.q, case.k, case.v, sinks=case.sinks,
                                           **case.call_kwargs(dict(k_offset=case.k_off, **(
                                               dict(cu_seqlens_k=case.cu_k) if case.docs else {}))))
    outs, lses = [], []
    for index, place in case.key_blocks(5):
        o, lse = attention_forward(case.q, case.k.index_select(sd, index), case.v.index_select(sd, index),
                                   **case.call_kwargs(place))
        outs.append(o)
        lses.append(lse)
    out, lse = merge_partials(outs, lses)
    merge_sink_(out, lse, case.sinks)
    torch.testing.assert_close(out, full_out, **TOL)
    torch.testing.assert_close(lse, full_lse, **TOL)
    # merged twice, a sink would count twice: the test would notice
    merge_sink_(out, lse, case.sinks)
    assert not torch.allclose(lse[torch.isfinite(lse)], full_lse[torch.isfinite(full_lse)])


def test_autograd_gives_dsinks_and_a_double_backward():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 7, 4, 4, dtype=F64, generator=gen, requires_grad=True)
    k = torch.randn(1, 7, 2, 4, dtype=F64, generator=gen, requires_grad=True)
    v = torch.randn(1, 7, 2, 4, dtype=F64, generator=gen, requires_grad=True)
    sinks = torch.randn(4, dtype=F64, generator=gen, requires_grad=True)
    kw = dict(causal=True, window=(2, -1), softcap=1.5, backend="reference")
    out = fa4dist.attention(q, k, v, sinks=sinks, **kw)
    ref, _ = naive_attention(q, k, v, sinks=sinks, causal=True, window=(2, -1), softcap=1.5)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.autograd.grad(out.square().sum(), [q, k, v, sinks])
    want = torch.autograd.grad(ref.square().sum(), [q, k, v, sinks])
    for a, b in zip(g, want):
        torch.testing.assert_close(a, b, **TOL)
    fn = lambda a, b, c, s: fa4dist.attention(a, b, c, sinks=s, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradgradcheck(fn, (q, k, v, sinks), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(F64, TOL), (torch.float32, dict(atol=2e-5, rtol=2e-5))], ids=["fp64", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_cp_invariant_attention_with_sinks_matches_the_oracle(dtype, tol, packed):
    """cp_invariant=True takes sinks: out and every gradient (the sinks' from one fixed-point sum over the rows)
    as the fp64 oracle's, within the dtype's tolerance; a row without keys keeps its sink's share."""
    gen = torch.Generator().manual_seed(11)
    lead = (37,) if packed else (2, 37)
    q = torch.randn(*lead, 4, 8, dtype=F64, generator=gen)
    k = torch.randn(*lead, 2, 8, dtype=F64, generator=gen)
    v = torch.randn(*lead, 2, 8, dtype=F64, generator=gen)
    dout = torch.randn(*lead, 4, 8, dtype=F64, generator=gen)
    sinks = torch.randn(4, dtype=F64, generator=gen)
    cu = torch.tensor([0, 5, 5, 30, 37], dtype=torch.int32) if packed else None
    # q_offset below k's: the first rows of a dense sequence see no key (their out is 0, their sink's share 1)
    kw = dict(causal=True, window=(6, -1), softcap=2.5, cu_seqlens_q=cu, cu_seqlens_k=cu)
    if not packed:
        kw.update(q_offset=0, k_offset=3)
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fa4dist.attention(*leaves[:3], sinks=leaves[3], backend="reference", cp_invariant=True, **kw)
    out.backward(dout.to(dtype))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref, _ = naive_attention(*ref_leaves[:3], sinks=ref_leaves[3], **kw)
    ref.backward(dout)
    torch.testing.assert_close(out.double(), ref, **tol)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, **tol)


def test_the_invariant_sink_gradient_is_one_exact_sum_whatever_the_shapes():
    """invariant.sink_grad: a subset of the heads, or the rows in another batch layout, give the same bytes per
    head (integer sums); close to merge.sink_grad's float sum; a zero sum is +0; a non-finite term makes its head
    NaN and no other."""
    from fa4dist.kernels import invariant
    from fa4dist.kernels.merge import sink_grad

    gen = torch.Generator().manual_seed(5)
    dout, out = (torch.randn(3, 50, 4, 8, generator=gen) for _ in range(2))
    lse = torch.randn(3, 4, 50, generator=gen).abs() + 2.0
    sinks = torch.randn(4, generator=gen)
    whole = invariant.sink_grad(dout, out, lse, sinks)
    torch.testing.assert_close(whole, sink_grad(dout, out, lse, sinks), atol=1e-5, rtol=1e-5)
    part = invariant.sink_grad(dout[:, :, 1:3], out[:, :, 1:3], lse[:, 1:3], sinks[1:3])
    assert torch.equal(part.view(torch.int32), whole[1:3].view(torch.int32))
    # the same rows as one packed sequence (t, h, d)
    packed = invariant.sink_grad(dout.flatten(0, 1), out.flatten(0, 1), lse.transpose(0, 1).flatten(1), sinks)
    assert torch.equal(packed.view(torch.int32), whole.view(torch.int32))
    zero = invariant.sink_grad(torch.zeros_like(dout), out, lse, sinks)
    assert torch.equal(zero.view(torch.int32), torch.zeros(4, dtype=torch.int32))  # +0, not -0
    bad = dout.clone()
    bad[1, 7, 2, 3] = float("inf")
    got = invariant.sink_grad(bad, out, lse, sinks)
    assert torch.isnan(got[2]) and torch.equal(got[[0, 1, 3]], whole[[0, 1, 3]])


# ---- bad values ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=(3,)), TypeError, r"window must be a \(left, right\) pair"),
    (dict(window=5), TypeError, r"window must be a \(left, right\) pair"),
    (dict(window=(-2, 0)), ValueError, "window left must be an int >= -1"),
    (dict(window=(3, 2**62)), ValueError, r"window right must be an int >= -1 \(-1: unbounded\) and < 2\*\*62"),
    (dict(window=(1, 2.0)), TypeError, "window right must be an int >= -1"),
    (dict(window=(True, 0)), TypeError, "window left must be an int"),
    (dict(softcap=0.0), ValueError, "softcap must be finite and > 0, or None"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    (dict(softcap="1"), TypeError, "softcap must be a float > 0 or None"),
    # the fp32 scores of these inputs would hold inf * 0 or 0 / 0: NaN results, silently
    (dict(softcap=1e39), ValueError, r"softcap must be within float32's range .* for torch.float32 inputs"),
    (dict(softcap=1e-50), ValueError, r"softcap must be within float32's range .* got 1e-50"),
    # a scale past float32's range is inf there (NaN scores); one below it is 0 or a denormal (the zero refused above)
    (dict(softmax_scale=1e39), ValueError,
     r"softmax_scale must be within float32's range in magnitude \[.*\] for torch.float32 inputs"),
    (dict(softmax_scale=-1e39), ValueError, r"softmax_scale must be within float32's range in magnitude .* -1e\+39"),
    (dict(softmax_scale=1e-50), ValueError, r"softmax_scale must be within float32's range in magnitude .* got 1e-50"),
    (dict(sinks=[0.0] * 4), TypeError, r"sinks must be a torch.Tensor of shape \(4,\)"),
    (dict(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \(4,\): one logit per query head"),
    (dict(sinks=torch.zeros(1, 4)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks must be float16, bfloat16, float32 or float64"),
    (dict(sinks=torch.zeros(4, device="meta")), ValueError, "sinks must be on the inputs' device cpu"),
])
def test_bad_options_get_clear_errors(kwargs, error, match):
    q, k = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8)
    with pytest.raises(error, match=match):
        attention_forward(q, k, k, causal=True, **kwargs)
    out, lse = attention_forward(q, k, k, causal=True)
    with pytest.raises(error, match=match):
        attention_backward(torch.randn_like(q), q, k, k, out, lse, causal=True, **kwargs)


@pytest.mark.parametrize("cap", [1e-50, 1e39, 1e300])
def test_softcaps_outside_float32_are_computed_for_float64_inputs(cap):
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 6, 2, 8, dtype=F64, generator=gen) for _ in range(4))
    out, lse = attention_forward(q, k, v, causal=True, softcap=cap, backend="reference")
    ref, ref_lse = naive_attention(q, k, v, causal=True, softcap=cap)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    grads = attention_backward(dout, q, k, v, out, lse, causal=True, softcap=cap, backend="reference")
    assert all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("scale", [1e-50, -1e39])
def test_softmax_scales_outside_float32_are_computed_for_float64_inputs(scale):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=F64, generator=gen) for _ in range(3))
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=scale, backend="reference")
    ref, ref_lse = naive_attention(q, k, v, causal=True, softmax_scale=scale)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_dsinks_buffer_needs_sinks():
    q, k = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8)
    out, lse = attention_forward(q, k, k)
    with pytest.raises(ValueError, match="dsinks= is the buffer of the sinks' gradient: pass sinks= too"):
        attention_backward(torch.randn_like(q), q, k, k, out, lse, dsinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"dsinks must have shape \(4,\)"):
        attention_backward(torch.randn_like(q), q, k, k, out, lse, sinks=torch.zeros(4), dsinks=torch.zeros(3))


# ---- garbage outside the window -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["k", "v"])
def test_garbage_outside_the_window_contributes_nothing(where):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 40, 4, 8, dtype=F64, generator=gen)
    k, v = (torch.randn(1, 40, 2, 8, dtype=F64, generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, dtype=F64, generator=gen)
    kw = dict(causal=True, window=(5, -1), softcap=3.0, backend="reference")
    clean_out, clean_lse = attention_forward(q, k, v, **kw)
    clean = attention_backward(dout, q, k, v, clean_out, clean_lse, **kw)
    p = 17  # rows 17..22 see key 17; the others never do
    (k if where == "k" else v)[:, p, 1] = float("nan")
    sees = torch.zeros(40, dtype=torch.bool)
    sees[p:p + 6] = True
    for splits in ([], [p], [9, 18, 30], list(range(4, 40, 4))):
        out = torch.full(q.shape, float("nan"), dtype=F64)
        lse = torch.full((1, 4, 40), float("-inf"), dtype=F64)
        bounds = [0, *splits, 40]
        for a, b in zip(bounds, bounds[1:]):
            attention_forward(q, k[:, a:b], v[:, a:b], k_offset=a, out=out, lse=lse, accumulate=True, **kw)
        torch.testing.assert_close(out[:, ~sees], clean_out[:, ~sees], rtol=1e-12, atol=1e-12)
        assert not torch.isfinite(out[:, sees, 2:]).any()  # query heads 2, 3 read kv head 1
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **kw)
        torch.testing.assert_close(dq[:, ~sees], clean[0][:, ~sees], rtol=1e-12, atol=1e-12)
        keys_clean = torch.ones(40, dtype=torch.bool)
        keys_clean[p - 5:p + 6] = False  # keys seen by the poisoned rows, and the bad key itself
        torch.testing.assert_close(dk[:, keys_clean], clean[1][:, keys_clean], rtol=1e-12, atol=1e-12)


# ---- the sdpa backend's window path, on the CPU ---------------------------------------------------------------------


def _leaky_flash_forward(q, k, v, scale, causal, cu_q=None, cu_k=None, max_q=None, max_k=None, window=(-1, -1)):
    """torch's flash forward as documented, in fp64, multiplying masked probabilities (0) by the values the way a
    fused kernel does (so 0 x NaN leaks): bottom-right aligned window, a window >= seqlen_k is unbounded, an empty
    row gets lse = +inf."""
    out, lse = torch.zeros_like(q), []
    for qs, ks, q_len, k_len, lim in _flash_segments(q, k, cu_q, cu_k, max_k):
        keep = flash_op_keep(q_len, k_len, window, causal, unbounded_from=lim)
        group = q.shape[-2] // k.shape[-2]
        ke, ve = k[ks].repeat_interleave(group, -2), v[ks].repeat_interleave(group, -2)
        s = torch.einsum("...qhd,...khd->...hqk", q[qs], ke) * scale
        s = s.masked_fill(~keep, float("-inf"))
        seg_lse = torch.logsumexp(s, -1)
        seg_lse = torch.where(keep.any(-1), seg_lse, torch.full_like(seg_lse, float("inf")))
        probs = torch.exp(s - seg_lse.unsqueeze(-1))
        out[qs] = torch.einsum("...hqk,...khd->...qhd", probs, ve)
        lse.append(seg_lse)
    return out, torch.cat(lse, dim=-1)


def _leaky_flash_backward(dout, q, k, v, out, lse, scale, causal, cu_q=None, cu_k=None, max_q=None, max_k=None,
                          window=(-1, -1)):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = q.shape[-2] // k.shape[-2]
    starts = cu_q.tolist()[:-1] if cu_q is not None else [0]
    for (qs, ks, q_len, k_len, lim), start in zip(_flash_segments(q, k, cu_q, cu_k, max_k), starts):
        keep = flash_op_keep(q_len, k_len, window, causal, unbounded_from=lim)
        ke, ve = k[ks].repeat_interleave(group, -2), v[ks].repeat_interleave(group, -2)
        seg_lse = lse[..., start:start + q_len] if cu_q is not None else lse
        s = (torch.einsum("...qhd,...khd->...hqk", q[qs], ke) * scale).masked_fill(~keep, float("-inf"))
        probs = torch.exp(s - seg_lse.unsqueeze(-1))
        dp = torch.einsum("...qhd,...khd->...hqk", dout[qs], ve)
        delta = (dout[qs] * out[qs]).sum(-1).transpose(-1, -2).unsqueeze(-1)
        ds = probs * (dp - delta)
        dq[qs] = torch.einsum("...hqk,...khd->...qhd", ds, ke) * scale
        dk[ks] = torch.einsum("...hqk,...qhd->...khd", ds, q[qs]).unflatten(-2, (-1, group)).sum(-2) * scale
        dv[ks] = torch.einsum("...hqk,...qhd->...khd", probs, dout[qs]).unflatten(-2, (-1, group)).sum(-2)
    return dq, dk, dv


def _flash_segments(q, k, cu_q, cu_k, max_k):
    if cu_q is None:
        yield (slice(None),), (slice(None),), q.shape[1], k.shape[1], k.shape[1]
        return
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for s in range(len(cq) - 1):
        yield (slice(cq[s], cq[s + 1]),), (slice(ck[s], ck[s + 1]),), cq[s + 1] - cq[s], ck[s + 1] - ck[s], max_k


@pytest.fixture
def emulated_flash(monkeypatch):
    from fa4dist.kernels import sdpa

    monkeypatch.setattr(sdpa, "_flash_forward", _leaky_flash_forward)
    monkeypatch.setattr(sdpa, "_flash_backward", _leaky_flash_backward)
    return sdpa.SdpaFlashBackend()


@pytest.mark.parametrize("window, causal", [((3, -1), True), ((0, 0), False), ((2, 4), False), ((-1, 1), False),
                                            ((6, 2), False), ((30, -1), True)])
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_sdpa_window_path_on_an_emulated_flash_op(emulated_flash, window, causal, layout):
    """band_decomposition + flash_window + the band guard, with NaN planted in k, v and dout: the backend's window
    path must give the reference's values and the same non-finite pattern, for any alignment."""
    from fa4dist.kernels.mask import visible_rect
    from fa4dist.kernels.problem import validate_inputs

    gen = torch.Generator().manual_seed(11)
    rng = random.Random(sum(window) + causal)
    if layout == "dense":
        n, m = rng.randint(5, 20), rng.randint(5, 20)
        q = torch.randn(2, n, 4, 8, dtype=F64, generator=gen)
        k, v = (torch.randn(2, m, 2, 8, dtype=F64, generator=gen) for _ in range(2))
        place = dict(q_offset=rng.randint(0, 12), k_offset=rng.randint(0, 8))
    else:
        cu = torch.tensor([0, 7, 7, 19, 30], dtype=torch.int32)
        q = torch.randn(30, 4, 8, dtype=F64, generator=gen)
        k, v = (torch.randn(30, 2, 8, dtype=F64, generator=gen) for _ in range(2))
        offsets = [3, 0, 5, 1]
        place = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=offsets, k_offset=offsets)
    sd = q.dim() - 3
    kw = dict(causal=causal, window=window, **place)
    problem = validate_inputs(q, k, v, **kw)
    bad_k, bad_v = 4, 2  # in the packed case keys of the first document, which its rows see
    if layout == "dense":  # keys inside the visible rectangle, so that some rows see the garbage
        rect = visible_rect(n, m, place["q_offset"], place["k_offset"], problem.mask)
        bad_k, bad_v = rect.k_start + rect.k_len // 2, rect.k_start
    k.narrow(sd, bad_k, 1)[..., 1, 2] = float("nan")
    v.narrow(sd, bad_v, 1)[..., 0, 0] = float("inf")
    out, lse = emulated_flash._windowed_forward(problem, q, k, v)
    want_out, want_lse = attention_forward(q, k, v, backend="reference", **kw)
    assert torch.isfinite(want_out).any() and not torch.isfinite(want_out).all(), "garbage must reach some rows"
    _same_rows(out, want_out)
    _same_rows(lse.unsqueeze(-1), want_lse.unsqueeze(-1))
    # backward: garbage in k and dout (the guard poisons dv of keys seen by a row with a bad output too, which the
    # exact reference need not; so v is clean here)
    v.narrow(sd, bad_v, 1)[..., 0, 0] = 0.5
    dout = torch.randn(q.shape, dtype=F64, generator=gen)
    dout.narrow(sd, 6, 1)[..., 3, 1] = float("nan")
    want_out, want_lse = attention_forward(q, k, v, backend="reference", **kw)
    got = emulated_flash._windowed_backward(problem, dout, q, k, v, want_out, want_lse)
    want = attention_backward(dout, q, k, v, want_out, want_lse, backend="reference", **kw)
    for g, w in zip(got, want):
        _same_rows(g, w)


def _same_rows(got, want):
    """The same (token, head) rows are non-finite (the guard poisons a whole row where the reference may leave a
    single element), and the finite rows agree at fp64 precision."""
    bad = ~torch.isfinite(want).all(-1)
    assert torch.equal(~torch.isfinite(got).all(-1), bad)
    torch.testing.assert_close(got[~bad], want[~bad], **TOL)


def test_sdpa_supports_says_what_goes_to_the_reference():
    """Which windowed / softcapped calls the sdpa backends take (checked on meta tensors placed on "cuda")."""
    from dataclasses import replace

    from fa4dist.kernels.problem import validate_inputs
    from fa4dist.kernels.sdpa import SdpaCudnnBackend, SdpaFlashBackend

    def on_cuda(*tensors, **kw):
        return replace(validate_inputs(*tensors, **kw), device=torch.device("cuda"))

    flash, cudnn = SdpaFlashBackend(), SdpaCudnnBackend()
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="meta")
    capped = flash.supports(on_cuda(q, q, q, causal=True, softcap=5.0), "forward")
    assert capped.fallback and "no softcap" in capped.reason
    assert flash.supports(on_cuda(q, q, q, causal=True, window=(3, -1)), "forward") is None
    assert flash.supports(on_cuda(q, q, q, window=(3, 2), q_offset=5), "backward") is None
    windowed = cudnn.supports(on_cuda(q, q, q, causal=True, window=(3, -1)), "forward")
    assert windowed.fallback and "no sliding window" in windowed.reason
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device="meta")
    kw = dict(causal=True, window=(2, -1), cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert flash.supports(on_cuda(packed, packed, packed, q_offset=[0, 4], k_offset=[0, 4], **kw), "forward") is None
    shifted = flash.supports(on_cuda(packed, packed, packed, q_offset=[0, 4], k_offset=[1, 4], **kw), "forward")
    assert shifted.fallback and "square, aligned segments" in shifted.reason


def test_cute_takes_windows_with_an_upper_edge_and_softcap():
    from dataclasses import replace

    from fa4dist.kernels.cute.backend import CuteSm90Backend
    from fa4dist.kernels.problem import validate_inputs

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="meta")

    def supports(**kw):
        problem = replace(validate_inputs(q, q, q, **kw), device=torch.device("cuda"))
        return CuteSm90Backend().supports(problem, "forward")

    for kw in (dict(causal=True, window=(3, -1)), dict(window=(3, 2)), dict(window=(-1, 0)), dict(window=(0, 0))):
        assert supports(**kw) is None, kw
    assert supports(causal=True, softcap=5.0) is None  # verified on the H200 (tests/kernels/test_window_gpu.py)
    assert supports(window=(100, 0), softcap=30.0) is None
    left_only = supports(window=(3, -1))  # a lower edge and no upper one: not a band below a diagonal
    assert left_only is not None and left_only.fallback and "upper edge" in left_only.reason
    # the sinks: in the forward's epilogue (fused_sinks) or merged by the contract, around the kernels
    assert supports(causal=True, sinks=torch.zeros(2, device="meta")) is None


@pytest.mark.parametrize("seed", range(5))
def test_cute_kernel_band_is_the_mask(seed):
    """The kernels see causal on a shifted diagonal plus window_left below it (cute/backend.kernel_band); for every
    band with an upper edge that must be exactly fa4dist.kernels.mask.visible."""
    from fa4dist.kernels.cute.backend import kernel_band
    from fa4dist.kernels.mask import Mask, visible

    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        left, right = (int(x) - 1 for x in torch.randint(0, 12, (2,), generator=g))
        causal = bool(torch.randint(0, 2, (1,), generator=g))
        mask = Mask.canonical(causal, (left, right))
        band = kernel_band(mask)
        if mask.hi is None:
            assert band is None or not mask.windowed
            continue
        k_causal, window_left, shift = band
        q_off, k_off = (int(x) for x in torch.randint(-20, 20, (2,), generator=g))
        q_pos, k_pos = torch.arange(15) + q_off, torch.arange(17) + k_off
        diag = q_off + shift - k_off  # the kernels' diagonal: key j visible to query i iff j <= i + diag ...
        i, j = torch.arange(15)[:, None], torch.arange(17)[None, :]
        got = j <= i + diag if k_causal else torch.ones(15, 17, dtype=torch.bool)
        if window_left >= 0:  # ... and j >= i + diag - window_left
            got = got & (j >= i + diag - window_left)
        assert torch.equal(got, visible(q_pos, k_pos, mask)), (mask, band)


class _FusedReference:
    """The reference behind a fused-epilogue interface (writes or merges into the caller's buffers itself), to
    check the contract's sink handling for such backends on the CPU."""

    name, priority, fused_epilogue, cp_invariant = "test_fused", -1, True, False

    def available(self, device):
        return True

    def supports(self, problem, direction):
        return None

    def forward(self, problem, q, k, v, out=None, lse=None, accumulate=False):
        from fa4dist.kernels import reference
        from fa4dist.kernels.merge import merge_into_

        o, m = reference.forward(problem, q, k, v)
        if accumulate:
            merge_into_(out, lse, o, m)
            return out, lse
        out.copy_(o)
        lse.copy_(m)
        return out, lse

    def backward(self, problem, dout, q, k, v, out, lse, deterministic, dq=None, dk=None, dv=None, accumulate=False):
        from fa4dist.kernels import reference

        grads = reference.backward(problem, dout, q, k, v, out, lse)
        if not accumulate:
            return tuple(g.to(q.dtype) for g in grads)
        for buf, g in zip((dq, dk, dv), grads):
            buf.add_(g)
        return dq, dk, dv


def test_sinks_through_a_fused_epilogue_backend(monkeypatch):
    from fa4dist.kernels import registry

    monkeypatch.setitem(registry._BACKENDS, "test_fused", _FusedReference())
    case = Case(7, True, False, (5, -1), None, True)
    ref_out, ref_lse, ref_grads = case.oracle()
    kw = case.call_kwargs(dict(k_offset=case.k_off))
    kw["backend"] = "test_fused"
    out, lse = attention_forward(case.q, case.k, case.v, sinks=case.sinks, **kw)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    run_out = torch.zeros(ref_out.shape, dtype=F64)
    run_lse = torch.full(ref_lse.shape, float("-inf"), dtype=F64)
    attention_forward(case.q, case.k, case.v, sinks=case.sinks, out=run_out, lse=run_lse, accumulate=True, **kw)
    torch.testing.assert_close(run_out, ref_out, **TOL)
    dq, dk, dv, dsinks = attention_backward(case.dout, case.q, case.k, case.v, out, lse, sinks=case.sinks, **kw)
    for got, want in zip((dq, dk, dv, dsinks), ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_a_row_without_keys_has_its_sink_as_lse():
    """As documented: a row that sees no key gets out = 0 and lse = -inf, or with sinks lse = its head's sink (the
    only term of its softmax), in one call and when the sink is merged into a split row; its sink gradient is 0."""
    q, k = torch.randn(1, 3, 4, 8, dtype=F64), torch.randn(1, 5, 2, 8, dtype=F64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=F64)
    kw = dict(causal=True, q_offset=0, k_offset=2)  # rows 0 and 1 see no key, row 2 sees one
    out, lse = attention_forward(q, k, k, **kw)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2])) and torch.isneginf(lse[..., :2]).all()
    out, lse = attention_forward(q, k, k, sinks=sinks, **kw)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert torch.equal(lse[0, :, :2], sinks[:, None].expand(4, 2))
    run_out, run_lse = attention_forward(q, k[:, :2], k[:, :2], **kw)
    attention_forward(q, k[:, 2:], k[:, 2:], sinks=sinks, out=run_out, lse=run_lse, accumulate=True,
                      causal=True, k_offset=4)
    torch.testing.assert_close(run_lse, lse, **TOL)
    dout = torch.randn_like(q)
    dsinks = attention_backward(dout, q, k, k, out, lse, sinks=sinks, **kw)[3]
    rows2 = attention_backward(dout[:, 2:], q[:, 2:], k, k, out[:, 2:], lse[..., 2:], sinks=sinks, causal=True,
                               q_offset=2, k_offset=2)[3]
    torch.testing.assert_close(dsinks, rows2, **TOL)


def _c_int(w: int) -> int:
    """A window side as torch's flash op reads it: its C++ entry narrows the int64 argument to a 32-bit int."""
    return (w + 2**31) % 2**32 - 2**31


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("window, causal", [((2**32 + 1, -1), True), ((2**32 + 2, 2**33), False),
                                            ((1, 2**32 + 1), False)])
def test_sdpa_window_sides_past_int32_reach_the_flash_op_as_unbounded(emulated_flash, monkeypatch, layout, window,
                                                                      causal):
    """A window side of 2**32 + 1 is legal (below 2**62) and here wider than every sequence: the op must read it as
    unbounded.  Before: the dense path handed the op left = 2**32 + 1 (band_decomposition kept a lower edge that
    never binds) and the packed path the window as given, which the op narrows to a C int: left 1, a two-key
    window, silently.  Modelled with the op's narrowing; the values must be the reference's."""
    from fa4dist.kernels import sdpa
    from fa4dist.kernels.problem import validate_inputs

    seen = []

    def narrowing(op):
        def call(*args, **kwargs):
            bound = inspect.signature(op).bind(*args, **kwargs)  # the packed path passes the window by position
            bound.apply_defaults()
            seen.append(bound.arguments["window"])
            bound.arguments["window"] = tuple(_c_int(w) for w in bound.arguments["window"])
            return op(*bound.args, **bound.kwargs)
        return call

    monkeypatch.setattr(sdpa, "_flash_forward", narrowing(_leaky_flash_forward))
    monkeypatch.setattr(sdpa, "_flash_backward", narrowing(_leaky_flash_backward))
    gen = torch.Generator().manual_seed(3)
    if layout == "dense":
        q = torch.randn(2, 9, 4, 8, dtype=F64, generator=gen)
        k, v = (torch.randn(2, 9, 2, 8, dtype=F64, generator=gen) for _ in range(2))
        kw = dict(q_offset=5, k_offset=5)
    else:
        cu = torch.tensor([0, 6, 6, 15], dtype=torch.int32)
        q = torch.randn(15, 4, 8, dtype=F64, generator=gen)
        k, v = (torch.randn(15, 2, 8, dtype=F64, generator=gen) for _ in range(2))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=[0, 3, 7], k_offset=[0, 3, 7])
    kw.update(causal=causal, window=window)
    problem = validate_inputs(q, k, v, **kw)
    fake_gpu = dataclasses.replace(problem, device=torch.device("cuda"), dtype=torch.bfloat16)
    assert emulated_flash.supports(fake_gpu, "forward") is None  # the flash path takes it (no fallback)
    out, lse = emulated_flash.forward(problem, q, k, v)
    want_out, want_lse = attention_forward(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)
    dout = torch.randn(q.shape, dtype=F64, generator=gen)
    got = emulated_flash.backward(problem, dout, q, k, v, want_out, want_lse, False)
    for g, w in zip(got, attention_backward(dout, q, k, v, want_out, want_lse, backend="reference", **kw)):
        torch.testing.assert_close(g, w, **TOL)
    assert all(-1 <= side < 2**31 for w in seen for side in w), seen
