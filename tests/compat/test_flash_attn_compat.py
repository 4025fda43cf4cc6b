"""fa4dist.compat: flash-attn 2's and 4's entry points against an oracle of flash-attn's own documented mask
(bottom-right aligned causal masks and windows: query i of seqlen_q sees key j of seqlen_k iff
i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right), in fp64, with gradients; what fa4dist does
not compute is refused by name."""

from __future__ import annotations

import pytest
import torch

from fa4dist.compat import flash_attn as fa2
from fa4dist.compat import flash_attn_cute as fa4

TOL = 1e-10


def oracle(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, sinks=None, visible=None):
    """(out, lse) of one (batch, seqlen, heads, dim) call, flash-attn's mask written out, fp64 (``visible``: a
    (seqlen_q, seqlen_k) mask of its own instead)."""
    q, k, v = q.double(), k.double(), v.double()
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window[0], 0 if causal else window[1]
    if visible is None:
        visible = torch.ones(sq, sk, dtype=torch.bool)
        if causal or right >= 0:
            visible &= j <= i + max(right, 0)
        if left >= 0:
            visible &= j >= i - left
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs, v), lse


def leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def grads_of(outputs, inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


def close(got, want, what):
    got, want = got.detach(), want.detach()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel() == 0:
        return
    scale = max(float(want.abs().max()), 1e-30)
    err = float((got - want).abs().max())
    assert err <= TOL * scale, f"{what}: {err:.2e} vs max {scale:.2e}"


@pytest.mark.parametrize("sq, sk", [(12, 12), (5, 12), (12, 5)])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "causal-window", "softcap"])
def test_flash_attn_2_func_equals_its_documented_mask(sq, sk, mask):
    q, k, v = leaves((2, sq, 4, 8), (2, sk, 2, 8), (2, sk, 2, 8))
    kw = dict(causal=mask.startswith("causal"), window_size=(3, 2) if "window" in mask else (-1, -1),
              softcap=1.5 if mask == "softcap" else 0.0)
    out, lse, probs = fa2.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    want_out, want_lse = oracle(q, k, v, kw["causal"], kw["window_size"], kw["softcap"])
    assert probs.shape == (0,) and probs.dtype == q.dtype  # flash-attn 2's S_dmask without dropout
    close(out, want_out, "out")
    seen = ~torch.isneginf(want_lse)  # (rows that see no key: out 0, lse -inf)
    close(lse[seen], want_lse[seen], "lse")
    for name, g, w in zip("qkv", grads_of([out, lse.masked_fill(~seen, 0)], (q, k, v)),
                          grads_of([want_out, want_lse.masked_fill(~seen, 0)], (q, k, v))):
        close(g, w, f"d{name}")


def test_flash_attn_2_packed_forms_equal_the_plain_call():
    q, k, v = leaves((2, 9, 4, 8), (2, 9, 4, 8), (2, 9, 4, 8), seed=2)
    want = fa2.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
    assert torch.equal(fa2.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True, softmax_scale=0.3),
                       want)
    assert torch.equal(fa2.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True, softmax_scale=0.3),
                       want)
    # the varlen qkv-packed form (README: "the qkvpacked / kvpacked forms too") was called by no test
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    want_varlen = fa2.flash_attn_varlen_func(*flat, cu, cu, 9, 9, causal=True, softmax_scale=0.3)
    close(want_varlen.view_as(want), want, "varlen out")  # another layout: the same values, not the same bits
    assert torch.equal(fa2.flash_attn_varlen_qkvpacked_func(torch.stack(flat, 1), cu, 9, causal=True,
                                                            softmax_scale=0.3), want_varlen)
    # a packed form's refusals name it (they named flash_attn_func / flash_attn_varlen_func, which it called)
    slopes = torch.zeros(4)
    for call, args in (("flash_attn_qkvpacked_func", (torch.stack([q, k, v], 2),)),
                       ("flash_attn_kvpacked_func", (q, torch.stack([k, v], 2))),
                       ("flash_attn_varlen_qkvpacked_func", (torch.stack(flat, 1), cu, 9)),
                       ("flash_attn_varlen_kvpacked_func", (flat[0], torch.stack(flat[1:], 1), cu, cu, 9, 9))):
        with pytest.raises(NotImplementedError, match=f"^{call}: alibi_slopes"):
            getattr(fa2, call)(*args, alibi_slopes=slopes)


def test_flash_attn_2_varlen_aligns_each_sequence_bottom_right():
    """Sequences of different query and key lengths (a chunked prefill against its keys), causal with a window."""
    lens_q, lens_k = [3, 7, 1], [8, 7, 4]
    q, k, v = leaves((sum(lens_q), 4, 8), (sum(lens_k), 2, 8), (sum(lens_k), 2, 8), seed=3)
    cu_q = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 15, 19], dtype=torch.int32)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 8, causal=True, window_size=(4, -1),
                                             return_attn_probs=True)
    outs, lses = [], []
    for a, b, c, d in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        o, s = oracle(q[None, a:b], k[None, c:d], v[None, c:d], causal=True, window=(4, -1))
        outs.append(o[0])
        lses.append(s[0])
    want_out, want_lse = torch.cat(outs), torch.cat(lses, dim=-1)
    close(out, want_out, "out")
    close(lse, want_lse, "lse")
    for name, g, w in zip("qkv", grads_of([out], (q, k, v)), grads_of([want_out], (q, k, v))):
        close(g, w, f"d{name}")
    packed = fa2.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, 7, 8, causal=True,
                                                 window_size=(4, -1))
    assert torch.equal(packed, out)


def test_flash_attn_4_funcs_return_out_and_lse_with_sinks():
    q, k, v = leaves((2, 10, 4, 8), (2, 10, 2, 8), (2, 10, 2, 8), seed=4)
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, window_size=(3, None), learnable_sink=sinks,
                                   return_lse=True)
    want_out, want_lse = oracle(q, k, v, causal=True, window=(3, -1), sinks=sinks)
    close(out, want_out, "out")
    close(lse, want_lse, "lse")
    for name, g, w in zip(["q", "k", "v", "sinks"], grads_of([out, lse], (q, k, v, sinks)),
                          grads_of([want_out, want_lse], (q, k, v, sinks))):
        close(g, w, f"d{name}")
    _, detached = fa4.flash_attn_func(q, k, v, causal=True)  # return_lse=False: an lse without a gradient
    assert not detached.requires_grad
    cu = torch.tensor([0, 10, 20], dtype=torch.int32)
    varlen, _ = fa4.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu,
                                           cu_seqlens_k=cu, causal=True, window_size=(3, None), learnable_sink=sinks,
                                           num_splits=4, pack_gqa=True)
    close(varlen, want_out.flatten(0, 1), "varlen out")


@pytest.mark.parametrize("call, kwargs, error, match", [
    (fa2.flash_attn_func, dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1 is not supported"),
    (fa2.flash_attn_func, dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes=a Tensor"),
    (fa2.flash_attn_func, dict(window_size=(2,)), TypeError, r"window_size must be a pair"),
    (fa2.flash_attn_func, dict(window_size=(-2, 0)), ValueError, "window_size's left side must be >= -1"),
    (fa4.flash_attn_func, dict(mask_mod=lambda *a: True), NotImplementedError, "mask_mod=a function"),
    (fa4.flash_attn_func, dict(qv=torch.ones(1)), NotImplementedError, "qv=a Tensor"),
    # sparse MLA's backward options: flash-attn 4 raises for them without gather_kv_indices (they were ignored)
    (fa4.flash_attn_func, dict(gather_bwd_recompute_p=True), NotImplementedError, "gather_bwd_recompute_p=True"),
    (fa4.flash_attn_func, dict(gather_bwd_token_chunk=64), NotImplementedError, "gather_bwd_token_chunk=64"),
    (fa4.flash_attn_varlen_func, dict(gather_bwd_recompute_p=True), NotImplementedError,
     "gather_bwd_recompute_p=True"),
    (fa4.flash_attn_varlen_func, dict(gather_bwd_token_chunk=64), NotImplementedError, "gather_bwd_token_chunk=64"),
])
def test_what_fa4dist_does_not_compute_is_refused_by_name(call, kwargs, error, match):
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(error, match=match):
        call(q, q, q, **kwargs)


def test_varlen_refusals():
    q = torch.randn(6, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is shorter than the longest sequence \\(4 tokens\\)"):
        fa2.flash_attn_varlen_func(q, q, q, cu, cu, 3, 4)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int or None, got 4.0"):  # (was int()'s own error)
        fa2.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4.0)
    with pytest.raises(ValueError, match="with block_table, the paged k cache must be \\(num_pages, page_size, "):
        fa2.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k\\[0\\]=3 is outside the sequence's 2 rows"):
        fa4.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   seqused_k=torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_q must be a \\(2,\\) int32 tensor"):
        fa4.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="with cu_seqlens_q, q must be \\(total_q, heads, head_dim\\)"):
        fa4.flash_attn_varlen_func(q[None], q, q, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   seqused_k=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="give both cu_seqlens_q and cu_seqlens_k"):
        fa2.flash_attn_varlen_func(q, q, q, cu, None, 4, 4)
    # flash-attn 4 takes one packed side with a batched one; the other side's form is then checked by name
    with pytest.raises(ValueError, match="without cu_seqlens_k, k must be \\(batch=2, seqlen, heads, head_dim\\)"):
        fa4.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu)
    # boundaries that address rows are checked before they are used (they failed deep inside, or were taken)
    used = dict(seqused_k=torch.tensor([1, 2], dtype=torch.int32))
    for bad, message in ((cu.float(), "cu_seqlens_q must have dtype torch.int32, got torch.float32"),
                         (torch.tensor([0, 3, 2], dtype=torch.int32), "cu_seqlens_q must be non-decreasing"),
                         (torch.tensor([1, 2, 6], dtype=torch.int32), "cu_seqlens_q must start at 0, got 1"),
                         (torch.tensor([0, 2, 7], dtype=torch.int32), "cu_seqlens_q ends at row 7, past q's 6 rows")):
        with pytest.raises((TypeError, ValueError), match=message):
            fa4.flash_attn_varlen_func(q, q, q, cu_seqlens_q=bad, cu_seqlens_k=cu, **used)
    with pytest.raises(TypeError, match="cu_seqlens_k must have dtype torch.int32, got torch.float32"):
        fa2.flash_attn_varlen_func(q, q[None], q[None], cu, cu.float(), 4, 4,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q holds 1 sequences but cu_seqlens_k 2"):
        fa2.flash_attn_varlen_func(q, q[None], q[None], cu[:2], cu, 4, 4,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table cannot be given with cu_seqlens_k"):
        fa4.flash_attn_varlen_func(q, q[None], q[None], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   page_table=torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("sq, sk, causal", [(9, 9, True), (5, 11, True), (11, 5, False), (7, 7, False)])
def test_sdpa_drop_in_equals_torchs_own(sq, sk, causal):
    """fa4dist.compat.sdpa against torch's scaled_dot_product_attention (top-left is_causal), GQA, a scale, with
    gradients."""
    from fa4dist.compat.sdpa import scaled_dot_product_attention

    q, k, v = leaves((2, 4, sq, 8), (2, 2, sk, 8), (2, 2, sk, 8), seed=6)
    kw = dict(is_causal=causal, scale=0.4, enable_gqa=True)
    got = scaled_dot_product_attention(q, k, v, **kw)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    close(got, want, "out")
    for name, g, w in zip("qkv", grads_of([got], (q, k, v)), grads_of([want], (q, k, v))):
        close(g, w, f"d{name}")
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        scaled_dot_product_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="attn_mask=a Tensor is not supported"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(sq, sk, dtype=torch.bool), enable_gqa=True)


@pytest.mark.parametrize("sq, sk", [(3, 0), (0, 3), (0, 0)])
def test_sdpa_drop_in_takes_empty_sequences(sq, sk):
    """A length of 0 made the reshape to one batch dim ambiguous (RuntimeError: cannot reshape tensor of 0 elements
    into shape [-1, ...]); torch gives zeros (no key) or an empty out, and so does the drop-in, 3-D inputs too."""
    from fa4dist.compat.sdpa import scaled_dot_product_attention

    for lead in ((1,), ()):
        q, k = torch.randn(*lead, 2, sq, 4, dtype=torch.float64), torch.randn(*lead, 2, sk, 4, dtype=torch.float64)
        for causal in (False, True):
            got = scaled_dot_product_attention(q, k, k, is_causal=causal)
            assert torch.equal(got, torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=causal))
    with pytest.raises(ValueError, match="key has 2 heads but value 1"):  # (named in the caller's layout)
        scaled_dot_product_attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4),
                                     enable_gqa=True)


def test_flash_attn_2_unbounds_a_window_side_of_at_least_the_key_count():
    """flash-attn 2's kernels set a window side of at least seqlen_k (max_seqlen_k, packed) to -1 before aligning
    the window bottom-right; its docstring's formula alone hides keys from the first rows of a non-causal call with
    more queries than keys (window right 2 >= 2 keys: every row sees both keys). flash-attn 4 keeps the formula."""
    q, k, v = leaves((1, 6, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8), seed=7)
    got = fa2.flash_attn_func(q, k, v, window_size=(-1, 2))
    close(got, oracle(q, k, v)[0], "out (window right unbounded)")
    close(fa2.flash_attn_func(q, k, v, window_size=(5, 1)), oracle(q, k, v, window=(-1, 1))[0], "out (left)")
    cu = torch.tensor([0, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 2], dtype=torch.int32)
    packed = fa2.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 6, 2, window_size=(-1, 2))
    close(packed, got[0], "packed out")
    close(fa4.flash_attn_func(q, k, v, window_size=(None, 2))[0], oracle(q, k, v, window=(-1, 2))[0], "fa4 out")


def fa2_kernel_mask(sq, sk, causal, window):
    """flash-attn 2's kernels (flash_api.cpp mha_fwd, set_params_fprop; mask.h): a side >= seqlen_k is -1, causal
    makes right 0, and a bounded left side with an unbounded right one makes right seqlen_k."""
    left, right = (-1 if s >= sk else s for s in window)
    right = 0 if causal else (sk if left >= 0 and right < 0 else right)
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    return visible


@pytest.mark.parametrize("sq, sk, window", [(6, 4, (1, -1)), (6, 4, (1, 100)), (8, 3, (1, 4)), (8, 3, (0, -1)),
                                            (4, 6, (1, -1)), (6, 4, (-1, 1))])
def test_flash_attn_2_bounded_left_side_makes_an_unbounded_right_one_the_key_count(sq, sk, window):
    """flash-attn 2's kernels turn an unbounded right side next to a bounded left one into seqlen_k, which hides the
    last keys from the first rows of a non-causal call with more queries than keys (rows 0-1 of 8 queries against
    3 keys at (1, 4) see none); the compat unbounded it, and matched neither its kernels nor its docstring."""
    q, k, v = leaves((1, sq, 2, 8), (1, sk, 2, 8), (1, sk, 2, 8), seed=11)
    visible = fa2_kernel_mask(sq, sk, False, window)
    want_out, want_lse = oracle(q, k, v, visible=visible)
    out, lse, _ = fa2.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
    close(out, want_out, "out")
    seen = ~torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    close(lse[seen], want_lse[seen], "lse")
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (sq, sk))
    close(fa2.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, sq, sk, window_size=window), out[0], "varlen")


def fa4_mask(sq, sk, causal, window):
    """flash-attn 4.0.0b36 (flash_attn/cute/interface.py _resolve_causal_local_window, cute/mask.py): two negative
    int sides are no window, then causal makes right 0; None is unbounded and ints are literal, negative ones too
    (sides summing below 0: no key visible)."""
    left, right = window
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    right = 0 if causal else right
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right is not None:
        visible &= j <= i + right
    if left is not None:
        visible &= j >= i - left
    return visible


@pytest.mark.parametrize("sq, sk", [(5, 5), (4, 7), (7, 4)])
@pytest.mark.parametrize("causal, window", [(False, (None, -1)), (False, (-1, 0)), (False, (-1, 2)), (False, (2, -1)),
                                            (False, (-2, 3)), (False, (-1, -1)), (False, (None, -2)),
                                            (False, (-3, None)), (True, (-1, None)), (True, (2, -5)),
                                            (False, (3, 1)), (False, (None, 9)), (False, (-2, 1)),
                                            (False, (1, -2)), (True, (-1, None)), (True, (-2, 5)), (True, (-1, -1))])
def test_flash_attn_4_takes_window_sides_literally(sq, sk, causal, window):
    """flash-attn 4 takes a negative window side literally ((None, -1): the keys strictly before the diagonal) and
    unbounds only None; the compat read -1 as unbounded, flash-attn 2's convention (a wrong answer in 636 of 7200
    small cases, a review found).  Sides that sum below 0 leave no key (they were read as no window: full or causal
    attention, another review found).  Out, lse and the gradients, packed input too."""
    q, k, v = leaves((1, sq, 2, 8), (1, sk, 2, 8), (1, sk, 2, 8), seed=12)
    want_out, want_lse = oracle(q, k, v, visible=fa4_mask(sq, sk, causal, window))
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    close(out, want_out, "out")
    seen = ~torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    close(lse[seen], want_lse[seen], "lse")
    for name, g, w in zip("qkv", grads_of([out], (q, k, v)), grads_of([want_out], (q, k, v))):
        close(g, w, f"d{name}")
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (sq, sk))
    packed = fa4.flash_attn_varlen_func(torch.cat([q[0], q[0]]), torch.cat([k[0], k[0]]), torch.cat([v[0], v[0]]),
                                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, window_size=window)[0]
    close(packed, torch.cat([out[0], out[0]]), "packed out")


def test_softcap_signs_and_empty_aux_follow_each_flash_attn():
    """flash-attn 2 caps only above 0 (a negative softcap is none); flash-attn 4 computes c * tanh(s / c), the same
    as |c|.  flash-attn 4 takes empty aux_tensors / aux_scalars as absent.  All were refused."""
    q, k, v = leaves((1, 6, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8), seed=13)
    assert torch.equal(fa2.flash_attn_func(q, k, v, softcap=-1.0), fa2.flash_attn_func(q, k, v))
    close(fa4.flash_attn_func(q, k, v, softcap=-1.5)[0], oracle(q, k, v, softcap=1.5)[0], "fa4 negative softcap")
    assert torch.equal(fa4.flash_attn_func(q, k, v, aux_tensors=[], aux_scalars=())[0], fa4.flash_attn_func(q, k, v)[0])
    with pytest.raises(ValueError, match=r"flash_attn_func: learnable_sink must be a tensor of shape \(num_heads,\) "
                                         r"= \(2,\), got \(3,\)"):
        fa4.flash_attn_func(q, k, v, learnable_sink=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"flash_attn_func: learnable_sink must be a float16, bfloat16 or float32 "):
        fa4.flash_attn_func(q, k, v, learnable_sink=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be a 1-D int32 tensor .* got shape \(1, 2\)"):
        fa2.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([[0, 6]], dtype=torch.int32),
                                   torch.tensor([0, 6], dtype=torch.int32), 6, 6)


def test_a_padded_packed_buffer_computes_the_tokens_its_cu_seqlens_cover():
    """flash-attn runs a fixed-size token buffer longer than cu_seqlens[-1] (its kernels compute the covered
    tokens); it was refused.  Rows past the end: out 0, lse -inf, no gradient."""
    q, k, v = leaves((11, 2, 8), (9, 2, 8), (9, 2, 8), seed=14)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 7], dtype=torch.int32)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 4, causal=True, return_attn_probs=True)
    want, want_lse, _ = fa2.flash_attn_varlen_func(q[:8], k[:7], v[:7], cu_q, cu_k, 5, 4, causal=True,
                                                   return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 11)
    assert torch.equal(out[:8], want) and torch.equal(lse[:, :8], want_lse)
    assert not out[8:].any() and torch.isneginf(lse[:, 8:]).all()
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert not dq[8:].any() and not dk[7:].any()


def test_packed_layouts_and_default_values_are_checked_by_name():
    """A packed tensor of another layout ((batch, seqlen, heads, 3, head_dim), say) was Python's bare unpacking
    error; an option at its default given as a numpy or tensor zero was refused as unsupported."""
    import numpy as np

    qkv = torch.randn(1, 4, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"flash_attn_qkvpacked_func: qkv must be \(batch, seqlen, 3, heads, "):
        fa2.flash_attn_qkvpacked_func(qkv)
    with pytest.raises(ValueError, match=r"flash_attn_varlen_kvpacked_func: kv must be \(total_k, 2, kv_heads, "):
        fa2.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0].transpose(1, 2),  # (total, 3, heads, dim)
                                            torch.tensor([0, 4], dtype=torch.int32),
                                            torch.tensor([0, 4], dtype=torch.int32), 4, 4)
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    for zero in (np.float32(0.0), torch.tensor(0.0)):
        torch.testing.assert_close(fa2.flash_attn_func(q, q, q, dropout_p=zero), fa2.flash_attn_func(q, q, q))
    with pytest.raises(ValueError, match="paged k cache"):  # a (1, 1) table of block 0 is a page, not an absent one
        fa2.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                   torch.tensor([0, 4], dtype=torch.int32), 4, 4,
                                   block_table=torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("shape_q, shape_k, gqa", [((5, 7, 8), (5, 9, 8), False), ((6, 7, 8), (2, 9, 8), True),
                                                   ((2, 3, 4, 7, 8), (2, 3, 2, 9, 8), True)])
def test_sdpa_takes_torchs_leading_batch_dims(shape_q, shape_k, gqa):
    """torch's (N, ..., heads, L, E): no batch dim (dim -3 the heads, as torch's enable_gqa reads it) or several."""
    from fa4dist.compat.sdpa import scaled_dot_product_attention

    q, k, v = leaves(shape_q, shape_k, (*shape_k[:-1], 6), seed=len(shape_q))
    for causal in (False, True):
        got = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        assert got.shape == want.shape
        close(got, want, f"out, causal={causal}")
        for name, g, w in zip("qkv", grads_of([got], (q, k, v)), grads_of([want], (q, k, v))):
            close(g, w, f"d{name}, causal={causal}")
    with pytest.raises(ValueError, match="must share their leading batch dims"):
        scaled_dot_product_attention(q, k[..., :1, :, :, :] if k.dim() == 5 else k[None], v)


def test_sdpa_refuses_nested_tensors_and_a_zero_scale_by_its_own_names():
    from fa4dist.compat.sdpa import scaled_dot_product_attention

    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)], layout=layout)
        with pytest.raises(TypeError, match="query is a nested tensor"):
            scaled_dot_product_attention(nested, nested, nested)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="scale=0 .* is not supported"):
        scaled_dot_product_attention(q, q, q, scale=0.0)


def _turned(x, cos, sin, positions, interleaved):
    """Rotary embedding written as complex rotation (the test's own form): channel pairs (2i, 2i+1) when
    interleaved, (i, i + half) otherwise, turned by the angle whose cos / sin the tables hold at each position."""
    half = cos.shape[1]
    rot = torch.complex(cos[positions], sin[positions]).unsqueeze(2)  # (batch, seqlen, 1, half)
    head, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        pairs = torch.complex(head[..., 0::2], head[..., 1::2]) * rot
        head = torch.stack((pairs.real, pairs.imag), -1).flatten(-2)
    else:
        pairs = torch.complex(head[..., :half], head[..., half:]) * rot
        head = torch.cat((pairs.real, pairs.imag), -1)
    return torch.cat((head, rest), -1)


@pytest.mark.parametrize("case", ["equal lengths", "ragged", "indexed and left-padded", "rotary interleaved",
                                  "rotary halves, not causal", "window and softcap"])
def test_flash_attn_2_with_kvcache_appends_then_attends_each_sequences_cache_rows(case):
    """flash_attn_with_kvcache against the oracle run per sequence on the cache rows it documents: the new k / v
    written at cache_seqlens[b] of cache row cache_batch_idx[b], keys from cache_leftpad[b], masks bottom-right,
    rotary at the rows' cache indices (q at cache_seqlens[b] + i when causal or windowed, else at cache_seqlens[b])."""
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    batch, sq, new, heads, kv_heads, d, cache_len, cache_rows = 3, 3, 2, 4, 2, 16, 24, 4
    q = torch.randn(batch, sq, heads, d, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(cache_rows, cache_len, kv_heads, d, generator=gen, dtype=torch.float64)
                        for _ in range(2))
    k_new, v_new = (torch.randn(batch, new, kv_heads, d, generator=gen, dtype=torch.float64) for _ in range(2))
    seqlens, idx, leftpad, causal = torch.tensor([7, 7, 7], dtype=torch.int32), None, None, True
    kw, rotary, interleaved, window, softcap = {}, False, True, (-1, -1), 0.0
    if case != "equal lengths":
        seqlens = torch.tensor([5, 0, 11], dtype=torch.int32)
    if case == "indexed and left-padded":
        idx, leftpad = torch.tensor([3, 0, 2], dtype=torch.int32), torch.tensor([2, 0, 4], dtype=torch.int32)
    if case.startswith("rotary"):
        rotary, interleaved, causal = True, "interleaved" in case, "not causal" not in case
        angles = torch.rand(cache_len, 6, generator=gen, dtype=torch.float64) * 6.3
        kw = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=interleaved)
    if case == "window and softcap":
        window, softcap = (4, -1), 2.5
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                           cache_batch_idx=idx, cache_leftpad=leftpad, causal=causal,
                                           window_size=window, softcap=softcap, return_softmax_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (batch, heads, sq)
    rows = idx.tolist() if idx is not None else list(range(batch))
    starts = leftpad.tolist() if leftpad is not None else [0] * batch
    for b, (r, end, start) in enumerate(zip(rows, seqlens.tolist(), starts)):
        k_b, q_b = k_new[b:b + 1], q[b:b + 1]
        if rotary:
            k_b = _turned(k_b, kw["rotary_cos"], kw["rotary_sin"], torch.arange(end, end + new)[None], interleaved)
            steps = torch.arange(sq) if causal else torch.zeros(sq, dtype=torch.int64)
            q_b = _turned(q_b, kw["rotary_cos"], kw["rotary_sin"], (end + steps)[None], interleaved)
        torch.testing.assert_close(k_cache[r, end:end + new], k_b[0], rtol=1e-13, atol=1e-13)  # written in place
        torch.testing.assert_close(v_cache[r, end:end + new], v_new[b], rtol=0, atol=0)
        keys, values = k_cache[r:r + 1, start:end + new], v_cache[r:r + 1, start:end + new]
        torch.testing.assert_close(keys[:, :end - start], before_k[r:r + 1, start:end], rtol=0, atol=0)
        # (flash-attn 2: a bounded left side with an unbounded right one makes the right one the cache's length)
        want_out, want_lse = oracle(q_b, keys, values, causal=causal, softcap=softcap,
                                    window=(window[0], cache_len if window[0] >= 0 and not causal else window[1]))
        close(out[b:b + 1], want_out, f"out of sequence {b}")
        seen = torch.isfinite(want_lse)  # (a row before the sequence's first key sees none: lse -inf)
        assert torch.equal(torch.isneginf(lse[b:b + 1]), ~seen), f"keyless rows of sequence {b}"
        close(lse[b:b + 1][seen], want_lse[seen], f"lse of sequence {b}")
    untouched = [r for r in range(cache_rows) if r not in rows]
    assert all(torch.equal(k_cache[r], before_k[r]) and torch.equal(v_cache[r], before_v[r]) for r in untouched)


def test_flash_attn_2_with_kvcache_without_new_rows_reads_the_cache_and_refuses_what_it_cannot_do():
    q, k_cache, v_cache = (torch.randn(2, s, 2, 8, dtype=torch.float64) for s in (1, 10, 10))
    out = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=6, causal=True)
    close(out, oracle(q, k_cache[:, :6], v_cache[:, :6], causal=True)[0], "a decode step on the cache alone")
    out = fa2.flash_attn_with_kvcache(q, k_cache, v_cache)  # no cache_seqlens: the whole cache, as flash-attn 2
    close(out, oracle(q, k_cache, v_cache)[0], "the whole cache")
    cos = sin = torch.ones(16, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="pass cache_seqlens with k and v"):  # (where would they go)
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, q.clone(), q.clone())
    with pytest.raises(ValueError, match="pass k and v"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin, cache_seqlens=3)
    with pytest.raises(ValueError, match="outside the cache"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, q.clone(), q.clone(), cache_seqlens=10)
    with pytest.raises(ValueError, match="cache_batch_idx\\[1\\]=5"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="give both k and v"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, q.clone())
    with pytest.raises(ValueError, match="cache_seqlens must be an int or a \\(2,\\) integer tensor"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([1.0, 2.0]))


def test_flash_attn_2_with_kvcache_refuses_before_it_writes_and_steps_rotary_as_flash_attn_2():
    """A call refused by the attention's own checks (heads, scale) leaves the cache as it was; a window whose sides
    are all at least the cache's length is no window (flash-attn 2 clamps them to -1 first), so a non-causal call
    turns every query at cache_seqlens, as with (-1, -1)."""
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache = (torch.randn(2, s, h, 8, generator=gen, dtype=torch.float64)
                           for s, h in ((3, 4), (12, 3), (12, 3)))
    k_new, v_new = (torch.randn(2, 2, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    before = k_cache.clone()
    with pytest.raises(ValueError, match="query heads \\(4\\) must be a multiple"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=3)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa2.flash_attn_with_kvcache(q[:, :, :3], k_cache, v_cache, k_new, v_new, cache_seqlens=3, softmax_scale=0.0)
    assert torch.equal(k_cache, before)
    q = q[:, :, :3]
    angles = torch.rand(16, 4, generator=gen, dtype=torch.float64) * 6.3
    rotary = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), cache_seqlens=5)
    want = fa2.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, **rotary)
    for window in [(100, 100), (-1, 12), (12, -1)]:
        got = fa2.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, window_size=window,
                                          **rotary)
        close(got, want, f"window {window}")


def _paged(caches, page, blocks, gen):
    """Paged copies of contiguous (batch, seqlen, kv_heads, dim) caches: each sequence's pages in shuffled blocks of
    ``blocks`` (the rest random), and their block table."""
    batch, capacity = caches[0].shape[:2]
    per_seq = -(-capacity // page)
    table = torch.randperm(blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    out = []
    for cache in caches:
        paged = torch.randn(blocks, page, *cache.shape[2:], generator=gen, dtype=cache.dtype)
        for b in range(batch):
            for j in range(per_seq):
                rows = cache[b, j * page:(j + 1) * page]
                paged[int(table[b, j]), :rows.shape[0]] = rows
        out.append(paged)
    return (*out, table)


def _contiguous(paged, table, lengths):
    """Each sequence's first ``lengths[b]`` positions of a paged cache, read through its block table."""
    page = paged.shape[1]
    return [torch.cat([paged[0, :0]] + [paged[int(table[b, j])] for j in range(-(-n // page))])[:n]
            for b, n in enumerate(lengths)]


@pytest.mark.parametrize("case", ["ragged causal", "rotary and window", "one page each, no new rows"])
def test_flash_attn_2_with_kvcache_on_a_paged_cache_equals_the_contiguous_cache(case):
    """A paged cache (block_table) gives what the same cache laid out contiguously gives, and its new rows land in
    the pages the block table names for their positions, no other block touched."""
    gen = torch.Generator().manual_seed(len(case))
    batch, sq, heads, kv_heads, d, page, blocks = 3, 2, 4, 2, 8, 4, 20
    capacity = 3 * page if case != "one page each, no new rows" else page
    new = 0 if "no new rows" in case else 3
    q = torch.randn(batch, sq, heads, d, generator=gen, dtype=torch.float64)
    k_cont, v_cont = (torch.randn(batch, capacity, kv_heads, d, generator=gen, dtype=torch.float64)
                      for _ in range(2))
    k_new, v_new = (torch.randn(batch, new, kv_heads, d, generator=gen, dtype=torch.float64) for _ in range(2))
    seqlens = torch.tensor([5, 0, 9] if new else [4, 1, 3], dtype=torch.int32)
    kw = dict(causal=True)
    if case == "rotary and window":
        angles = torch.rand(capacity, 3, generator=gen, dtype=torch.float64) * 6.3
        kw = dict(causal=False, window_size=(3, 1), rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                  rotary_interleaved=False, softcap=2.0)
    ends = [int(e) + new for e in seqlens]
    k_paged, v_paged, table = _paged((k_cont, v_cont), page, blocks, gen)
    before_k, before_v = k_paged.clone(), v_paged.clone()
    args = (k_new, v_new) if new else (None, None)
    got, got_lse = fa2.flash_attn_with_kvcache(q, k_paged, v_paged, *args, cache_seqlens=seqlens, block_table=table,
                                               return_softmax_lse=True, **kw)
    want, want_lse = fa2.flash_attn_with_kvcache(q, k_cont, v_cont, *args, cache_seqlens=seqlens,
                                                 return_softmax_lse=True, **kw)
    close(got, want, "out")
    seen = torch.isfinite(want_lse)
    assert torch.equal(seen, torch.isfinite(got_lse))
    close(got_lse[seen], want_lse[seen], "lse")
    for name, paged, cont in (("k", k_paged, k_cont), ("v", v_paged, v_cont)):  # the appended rows, in their pages
        for b, rows in enumerate(_contiguous(paged, table, [capacity] * batch)):
            assert torch.equal(rows[:ends[b]], cont[b, :ends[b]]), f"{name} cache of sequence {b}"
    untouched = sorted(set(range(blocks)) - set(table.flatten().tolist()))
    assert torch.equal(k_paged[untouched], before_k[untouched]) and torch.equal(v_paged[untouched], before_v[untouched])


def test_flash_attn_2_varlen_on_a_paged_cache_equals_its_packed_keys():
    """flash_attn_varlen_func with block_table: sequence b's keys are the first cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] positions its block table row addresses; gradients reach the pages they were read from."""
    gen = torch.Generator().manual_seed(3)
    lengths_q, lengths_k, page, blocks, heads, kv_heads, d = [3, 1, 4], [6, 0, 9], 4, 9, 4, 2, 8
    q = torch.randn(sum(lengths_q), heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k_pages, v_pages = (torch.randn(blocks, page, kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
                        for _ in range(2))
    table = torch.tensor([[4, 0, 7], [8, 1, 2], [3, 6, 5]], dtype=torch.int32)
    cu_q, cu_k = (torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
                  for lengths in (lengths_q, lengths_k))
    kw = dict(causal=True, return_attn_probs=True)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 9, block_table=table, **kw)
    keys = torch.cat(_contiguous(k_pages, table, lengths_k))
    values = torch.cat(_contiguous(v_pages, table, lengths_k))
    want_out, want_lse, _ = fa2.flash_attn_varlen_func(q, keys, values, cu_q, cu_k, 4, 9, **kw)
    close(out, want_out, "out")
    seen = torch.isfinite(want_lse)
    close(lse[seen], want_lse[seen], "lse")
    for name, g, w in zip(("dq", "dk pages", "dv pages"), grads_of([out], (q, k_pages, v_pages)),
                          grads_of([want_out], (q, k_pages, v_pages))):
        close(g, w, name)


def test_flash_attn_4_page_table_refuses_keys_past_its_rows():
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    pages = torch.randn(5, 4, 2, 8, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k\\[1\\]=9 is outside the sequence's 8 rows"):
        fa4.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu_q, page_table=table,
                                   seqused_k=torch.tensor([3, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table must be a \\(1, max_pages_per_seq\\) integer tensor"):
        fa4.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu_q[:2], page_table=table)


def test_paged_caches_refuse_what_flash_attn_2_refuses_and_blocks_they_do_not_hold():
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    pages = torch.randn(5, 4, 2, 8, dtype=torch.float64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for name in ("cache_batch_idx", "cache_leftpad"):
        with pytest.raises(ValueError, match=f"{name} cannot be given with block_table"):
            fa2.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table,
                                        **{name: torch.tensor([0, 1], dtype=torch.int32)})
    with pytest.raises(ValueError, match="block_table\\[1, 1\\]=9 is not one of the caches' 5 pages"):
        fa2.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=torch.tensor([3, 6]),
                                    block_table=torch.tensor([[0, 9], [2, 9]], dtype=torch.int32))
    # (an entry past a sequence's positions is never read: -1 is fine there)
    out = fa2.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=torch.tensor([3, 4]),
                                      block_table=torch.tensor([[0, -1], [2, -1]], dtype=torch.int32))
    close(out, torch.cat([oracle(q[b:b + 1], pages[blk:blk + 1, :n], pages[blk:blk + 1, :n])[0]
                          for b, (blk, n) in enumerate(((0, 3), (2, 4)))]), "pages read through the table")
    with pytest.raises(ValueError, match="outside the 8 positions its block_table row addresses"):
        fa2.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=9, block_table=table)
    with pytest.raises(TypeError, match="k and v \\(torch.float32, torch.float32\\) must have the caches' dtype "
                                        "\\(torch.float64, torch.float64\\)"):  # (they were cast into the cache)
        new = torch.randn(2, 1, 2, 8)
        fa2.flash_attn_with_kvcache(q, pages, pages, new, new, cache_seqlens=3, block_table=table)
    with pytest.raises(ValueError, match="block_table must be a \\(2, max_pages_per_seq\\) integer tensor"):
        fa2.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table.float())


@pytest.mark.parametrize("layout", ["packed q and k, seqused_q and seqused_k", "batched q and k, seqused_k",
                                    "batched q, paged k, seqused_k", "packed q, paged k, seqused_k",
                                    "packed q, batched k", "batched q, packed k"])
def test_flash_attn_4_varlen_reads_the_rows_each_sequence_uses(layout):
    """flash-attn 4's seqused_q / seqused_k (each sequence's first rows only), page_table (keys through a page
    table) and one packed side with a batched one (cu_seqlens of that side only; refused before): every sequence
    against the oracle of its used rows, with a window, softcap and sinks; the rows a sequence does not use get out
    0 and lse -inf and no gradient."""
    gen = torch.Generator().manual_seed(len(layout))
    batch, heads, kv_heads, d, page = 3, 4, 2, 8, 4
    rows_q, rows_k = [5, 3, 6], [7, 0, 9]
    kw = dict(causal=True, window_size=(3, None), softcap=2.0)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64, requires_grad=True)
    seqs_q = [torch.randn(n, heads, d, generator=gen, dtype=torch.float64) for n in rows_q]
    seqs_k = [torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64) for n in rows_k]
    seqs_v = [torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64) for n in rows_k]
    cu = lambda lengths: torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)  # noqa: E731
    pad = lambda seqs, n: torch.stack([torch.cat([s, s.new_zeros(n - len(s), *s.shape[1:])]) for s in seqs])  # noqa
    args = {}
    if layout.startswith("packed q"):
        q = torch.cat(seqs_q).requires_grad_()
        args["cu_seqlens_q"] = cu(rows_q)
        used_q = rows_q
        query_rows = lambda: [(b, int(cu(rows_q)[b]) + i) for b in range(batch) for i in range(used_q[b])]  # noqa
    else:
        q = pad(seqs_q, max(rows_q)).requires_grad_()
        used_q = [q.shape[1]] * batch  # (without seqused_q every row of a batched q is a query)
        query_rows = lambda: [(b, (b, i)) for b in range(batch) for i in range(used_q[b])]  # noqa: E731
    if "seqused_q" in layout:
        used_q = [4, 3, 0]
        args["seqused_q"] = torch.tensor(used_q, dtype=torch.int32)
    if "paged k" in layout:
        k_pages, v_pages, table = _paged((pad(seqs_k, 12), pad(seqs_v, 12)), page, 16, gen)
        k, v = k_pages.requires_grad_(), v_pages.requires_grad_()
        args["page_table"] = table
    elif "packed k" in layout or "packed q and k" in layout:
        k, v = torch.cat(seqs_k).requires_grad_(), torch.cat(seqs_v).requires_grad_()
        args["cu_seqlens_k"] = cu(rows_k)
        used_k = rows_k
    else:
        k, v = pad(seqs_k, max(rows_k)).requires_grad_(), pad(seqs_v, max(rows_k)).requires_grad_()
        used_k = [k.shape[1]] * batch  # (every row of a batched k is a key)
    if "seqused_k" in layout:
        used_k = [7, 0, 5]
        args["seqused_k"] = torch.tensor(used_k, dtype=torch.int32)
    query_rows = query_rows()
    out, lse = fa4.flash_attn_varlen_func(q, k, v, learnable_sink=sinks, return_lse=True, **args, **kw)
    assert out.shape == q.shape and lse.shape == ((heads, q.shape[0]) if q.dim() == 3 else (batch, heads, q.shape[1]))
    got_out = torch.stack([out[at] for _, at in query_rows])
    got_lse = torch.stack([lse[:, at] if q.dim() == 3 else lse[at[0], :, at[1]] for _, at in query_rows])
    def used_rows(t, name, lengths):  # sequence b's used rows of the leaf t, as the layout holds them
        if "paged" in layout and name != "q":
            return _contiguous(t, table, lengths)
        if t.dim() == 4:
            return [t[b, :n] for b, n in enumerate(lengths)]
        first = args["cu_seqlens_q" if name == "q" else "cu_seqlens_k"].tolist()
        return [t[first[b]:first[b] + n] for b, n in enumerate(lengths)]

    want = [oracle(q_b[None], k_b[None], v_b[None], causal=True, window=(3, -1), softcap=2.0, sinks=sinks)
            for q_b, k_b, v_b in zip(used_rows(q, "q", used_q), used_rows(k, "k", used_k), used_rows(v, "v", used_k))]
    want_out = torch.cat([o[0] for o, _ in want])
    want_lse = torch.cat([lse_b[0].transpose(0, 1) for _, lse_b in want])
    close(got_out, want_out, "out of the used rows")
    close(got_lse, want_lse, "lse of the used rows")
    used = torch.zeros(out.shape[:-2], dtype=torch.bool)
    for _, at in query_rows:
        used[at] = True
    assert not out[~used].any() and bool(torch.isneginf(lse.transpose(0, 1)[~used] if q.dim() == 3 else
                                                          lse.transpose(1, 2)[~used]).all())
    gq, gk, gv, gs = grads_of([got_out], (q, k, v, sinks))
    wq, wk, wv, ws = grads_of([want_out], (q, k, v, sinks))
    for name, g, w in (("dq", gq, wq), ("dk", gk, wk), ("dv", gv, wv), ("dsinks", gs, ws)):
        close(g, w, name)
