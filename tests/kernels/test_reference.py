"""The reference backend against the independent fp64 oracle; gradients; merging of split key ranges."""

import random

import pytest
import torch

import fa4dist
from fa4dist.kernels import attention_backward, attention_forward, merge_partials, reference
from oracle import naive_attention, random_cu_seqlens

F64 = torch.float64


def _dense_case(rng: random.Random, gen: torch.Generator):
    batch = rng.randint(1, 3)
    heads_kv = rng.choice([1, 2, 3])
    heads_q = heads_kv * rng.choice([1, 2, 4])
    sq, sk = rng.choice([1, 7, 33, 64, 129]), rng.choice([1, 5, 31, 64, 130])
    d, dv = rng.choice([8, 16, 40]), None
    dv = rng.choice([d, 24])
    causal = rng.random() < 0.7
    q_off, k_off = rng.randint(-40, 200), rng.randint(-40, 200)
    q = torch.randn(batch, sq, heads_q, d, dtype=F64, generator=gen)
    k = torch.randn(batch, sk, heads_kv, d, dtype=F64, generator=gen)
    v = torch.randn(batch, sk, heads_kv, dv, dtype=F64, generator=gen)
    return q, k, v, dict(causal=causal, q_offset=q_off, k_offset=k_off, softmax_scale=rng.choice([None, 0.3]))


def _packed_case(rng: random.Random, gen: torch.Generator):
    n = rng.randint(1, 5)
    cu_q = random_cu_seqlens(n, 40, gen)
    cu_k = random_cu_seqlens(n, 40, gen)
    heads_kv = rng.choice([1, 2])
    heads_q = heads_kv * rng.choice([1, 3])
    d = 16
    q = torch.randn(int(cu_q[-1]), heads_q, d, dtype=F64, generator=gen)
    k = torch.randn(int(cu_k[-1]), heads_kv, d, dtype=F64, generator=gen)
    v = torch.randn(int(cu_k[-1]), heads_kv, d, dtype=F64, generator=gen)
    q_off = [rng.randint(0, 50) for _ in range(n)]
    k_off = [rng.randint(0, 50) for _ in range(n)]
    return q, k, v, dict(causal=rng.random() < 0.7, q_offset=q_off, k_offset=k_off, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k)


@pytest.mark.parametrize("seed", range(24))
def test_reference_forward_matches_oracle(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    q, k, v, kw = (_packed_case if seed % 3 == 2 else _dense_case)(rng, gen)
    out, lse = attention_forward(q, k, v, backend="reference", **kw)
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    assert out.dtype == F64 and lse.dtype == F64
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)  # -inf rows compare equal


def test_empty_rows_give_zero_and_neg_inf():
    q = torch.randn(1, 8, 2, 16, dtype=F64)
    k = torch.randn(1, 8, 2, 16, dtype=F64)
    # keys start at position 4: queries 0..3 see nothing
    out, lse = attention_forward(q, k, k, causal=True, q_offset=0, k_offset=4, backend="reference")
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()


@pytest.mark.parametrize("seed", range(12))
def test_reference_backward_matches_oracle_autograd(seed):
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    q, k, v, kw = (_packed_case if seed % 3 == 2 else _dense_case)(rng, gen)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(qr, kr, vr, **kw)
    dout = torch.randn(ref_out.shape, dtype=F64, generator=gen)
    ref_out.backward(dout)
    out, lse = attention_forward(q, k, v, backend="reference", **kw)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, backend="reference", **kw)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=False),
        dict(causal=True),
        dict(causal=True, q_offset=3, k_offset=0),
        dict(causal=True, q_offset=0, k_offset=2),  # the first two queries see nothing
    ],
)
def test_gradcheck_tiny(kw):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 5, 4, 6, dtype=F64, generator=gen, requires_grad=True)
    k = torch.randn(1, 4, 2, 6, dtype=F64, generator=gen, requires_grad=True)
    v = torch.randn(1, 4, 2, 6, dtype=F64, generator=gen, requires_grad=True)
    fn = lambda q, k, v: fa4dist.attention(q, k, v, backend="reference", **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def test_gradcheck_packed():
    gen = torch.Generator().manual_seed(8)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 4, dtype=F64, generator=gen, requires_grad=True)
    k = torch.randn(7, 1, 4, dtype=F64, generator=gen, requires_grad=True)
    v = torch.randn(7, 1, 4, dtype=F64, generator=gen, requires_grad=True)
    fn = lambda q, k, v: fa4dist.attention(  # noqa: E731
        q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="reference"
    )
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def _random_split(rng, length, max_blocks):
    n = rng.randint(1, max_blocks)
    cuts = sorted(rng.sample(range(1, length), min(n - 1, length - 1))) if length > 1 else []
    bounds = [0] + cuts + [length]
    return list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(16))
def test_split_keys_and_merge_equals_full(seed):
    """Any split of the keys into 1..8 blocks at random boundaries, merged, gives the full result (fp64, 1e-12):
    once with the in-place accumulate mode and once with the fixed-order N-way merge; gradients summed over the
    blocks, each computed with the global out/lse, give the full gradients."""
    rng, gen = random.Random(1000 + seed), torch.Generator().manual_seed(1000 + seed)
    batch, sq, sk, hq, hkv, d = 2, rng.randint(1, 70), rng.randint(2, 90), 4, rng.choice([1, 2, 4]), 16
    causal, q_off, k_off = rng.random() < 0.75, rng.randint(0, 60), rng.randint(0, 30)
    q = torch.randn(batch, sq, hq, d, dtype=F64, generator=gen)
    k = torch.randn(batch, sk, hkv, d, dtype=F64, generator=gen)
    v = torch.randn(batch, sk, hkv, d, dtype=F64, generator=gen)
    full_out, full_lse = attention_forward(q, k, v, causal=causal, q_offset=q_off, k_offset=k_off, backend="reference")
    blocks = _random_split(rng, sk, 8)

    run_out = torch.full((batch, sq, hq, d), float("nan"), dtype=F64)  # garbage where lse = -inf must not leak
    run_lse = torch.full((batch, hq, sq), float("-inf"), dtype=F64)
    outs, lses = [], []
    for ks, ke in blocks:
        kw = dict(causal=causal, q_offset=q_off, k_offset=k_off + ks, backend="reference")
        attention_forward(q, k[:, ks:ke], v[:, ks:ke], out=run_out, lse=run_lse, accumulate=True, **kw)
        o, part_lse = attention_forward(q, k[:, ks:ke], v[:, ks:ke], **kw)
        outs.append(o)
        lses.append(part_lse)
    merged_out, merged_lse = merge_partials(outs, lses)
    for got_out, got_lse in ((run_out, run_lse), (merged_out, merged_lse)):
        torch.testing.assert_close(got_out, full_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(got_lse, full_lse, atol=1e-12, rtol=1e-12)

    dout = torch.randn(full_out.shape, dtype=F64, generator=gen)
    full_grads = attention_backward(dout, q, k, v, full_out, full_lse, causal=causal, q_offset=q_off,
                                    k_offset=k_off, backend="reference")
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for ks, ke in blocks:
        attention_backward(dout, q, k[:, ks:ke], v[:, ks:ke], full_out, full_lse, causal=causal, q_offset=q_off,
                           k_offset=k_off + ks, dq=dq, dk=dk[:, ks:ke], dv=dv[:, ks:ke], accumulate=True,
                           backend="reference")
    for got, want in zip((dq, dk, dv), full_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_merge_all_neg_inf_is_zero_not_nan():
    out = torch.full((1, 3, 2, 4), float("nan"))
    lse = torch.full((1, 2, 3), float("-inf"))
    blk = torch.zeros(1, 3, 2, 4)
    attention_lse = torch.full((1, 2, 3), float("-inf"))
    from fa4dist.kernels import merge_into_

    merge_into_(out, lse, blk, attention_lse)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    o, merged_lse = merge_partials([blk, blk], [attention_lse, attention_lse])
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(merged_lse).all()
    # a hand-built partial that saw no key (lse -inf) but holds garbage contributes nothing, as in merge_into_
    seen_lse = torch.randn(1, 2, 3)
    seen = torch.randn(1, 3, 2, 4)
    for garbage in (float("nan"), float("inf"), 7.0):
        o, merged_lse = merge_partials([torch.full_like(seen, garbage), seen], [attention_lse, seen_lse])
        assert torch.equal(o, seen) and torch.equal(merged_lse, seen_lse), garbage


def test_merge_into_ignores_the_out_of_block_rows_that_saw_no_key():
    """merge_into_ agrees with merge_partials: a block row whose lse is -inf contributed nothing, so whatever its
    out holds (NaN, inf, garbage) is ignored; a row that saw keys keeps the running result exactly."""
    from fa4dist.kernels import merge_into_

    gen = torch.Generator().manual_seed(5)
    run_out, run_lse = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 2, 3, generator=gen)
    run_lse[0, 1, 2] = float("-inf")  # a row neither side saw: 0, -inf
    run_out[0, 2, 1] = 0.0
    block_lse = torch.full((1, 2, 3), float("-inf"))
    for garbage in (float("nan"), float("inf"), 7.0):
        out, lse = run_out.clone(), run_lse.clone()
        merge_into_(out, lse, torch.full_like(run_out, garbage), block_lse)
        want_out, want_lse = merge_partials([run_out, torch.full_like(run_out, garbage)], [run_lse, block_lse])
        assert torch.equal(out, run_out) and torch.equal(out, want_out), garbage
        assert torch.equal(lse, run_lse) and torch.equal(lse, want_lse), garbage


def test_chunking_boundaries(monkeypatch):
    """Tiny tiles force many query and key chunks with partial causal tiles; the result must not change."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 300, 2, 8, dtype=F64, generator=gen)
    k = torch.randn(1, 250, 1, 8, dtype=F64, generator=gen)
    kw = dict(causal=True, q_offset=17, k_offset=40)
    want = attention_forward(q, k, k, backend="reference", **kw)
    monkeypatch.setattr(reference, "_QUERY_CHUNK", 16)
    monkeypatch.setattr(reference, "_KEY_CHUNK", 7)
    got = attention_forward(q, k, k, backend="reference", **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


def test_long_sequence_memory_is_bounded(monkeypatch):
    """A 16k-token causal sequence on the CPU: the reference walks it in tiles (never a 16k x 16k score matrix)."""
    s, h, d = 16384, 1, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, h, d, generator=gen)
    largest = [0]
    einsum = torch.einsum

    def recording_einsum(*args):
        result = einsum(*args)
        largest[0] = max(largest[0], result.numel())
        return result

    monkeypatch.setattr(torch, "einsum", recording_einsum)
    out, lse = attention_forward(q, q, q, causal=True, backend="reference")
    monkeypatch.undo()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tile = reference._QUERY_CHUNK * reference._KEY_CHUNK
    assert 0 < largest[0] <= tile, f"a tile of {largest[0]} elements (the matrix is {s * s})"
    # spot-check a few rows against the oracle on their visible prefix
    for row in (0, 1, 12345, s - 1):
        o, row_lse = naive_attention(q[:, row : row + 1], q[:, : row + 1], q[:, : row + 1], causal=True,
                                     q_offset=row)
        torch.testing.assert_close(out[:, row : row + 1].double(), o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[..., row : row + 1].double(), row_lse, atol=1e-5, rtol=1e-5)


def test_half_precision_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 65, 4, 32, generator=gen).bfloat16()
    k = torch.randn(2, 65, 2, 32, generator=gen).bfloat16()
    out, lse = attention_forward(q, k, k, causal=True, backend="reference")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = naive_attention(q, k, k, causal=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)  # bf16 output rounding (8 bits)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # fp32 accumulation


@pytest.mark.parametrize("layout", ["dense-causal-offsets", "dense-full-gqa", "packed", "keyless-rows",
                                    "no-visible-key", "packed-empty-key-segment"])
def test_double_backward(layout):
    """gradgradcheck: the gradients are themselves differentiable (create_graph=True), not a silent constant; rows
    that see no key (out 0) contribute nothing, also to the second derivatives (no NaN through them)."""
    gen = torch.Generator().manual_seed(11)
    if layout == "packed":
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        shapes, kw = ((8, 2, 4), (8, 1, 4)), dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    elif layout == "packed-empty-key-segment":
        cu_q, cu_k = torch.tensor([0, 3, 5, 8], dtype=torch.int32), torch.tensor([0, 2, 2, 6], dtype=torch.int32)
        shapes, kw = ((8, 2, 4), (6, 1, 4)), dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    elif layout in ("keyless-rows", "no-visible-key"):  # rows 0-1 (all rows) before the first key
        shapes, kw = ((1, 4, 2, 4), (1, 4, 1, 4)), dict(causal=True, k_offset=2 if layout == "keyless-rows" else 10)
    elif layout == "dense-full-gqa":
        shapes, kw = ((2, 5, 4, 4), (2, 7, 2, 4)), dict(causal=False)
    else:
        shapes, kw = ((1, 6, 2, 4), (1, 9, 2, 4)), dict(causal=True, q_offset=3, k_offset=0)
    q = torch.randn(*shapes[0], dtype=F64, generator=gen, requires_grad=True)
    k, v = (torch.randn(*shapes[1], dtype=F64, generator=gen, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradgradcheck(lambda a, b, c: fa4dist.attention(a, b, c, **kw), (q, k, v))


@pytest.mark.parametrize("create_graph", [False, True])
def test_autocast_does_not_lower_the_reference_precision(create_graph):
    """Under an ambient torch.autocast (bf16 on the CPU), fp32 inputs are still computed in fp32: the same bits as
    without autocast (forward, lse and gradients; also the differentiable gradients of create_graph=True), not
    bf16 matrix products under an fp32 result."""
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 48, heads, 32, generator=gen) for heads in (4, 2, 2)]

    def step(autocast):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, lse = fa4dist.attention(q, k, v, causal=True, backend="reference", return_lse=True)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=create_graph)
        return out, lse, *grads

    plain, autocast = step(False), step(True)
    assert plain[0].dtype == torch.float32
    for a, b in zip(plain, autocast):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_cp_invariant_bits_do_not_depend_on_the_inputs_strides(packed):
    """cp_invariant's arithmetic sums one contiguous axis per element, so its bits are a function of the values: a
    q/k/v whose head_dim is not the innermost axis (a transposed view) gave other scores, hence another out, lse and
    gradients, than the same values laid out contiguously (in fp32 at head_dim 32) -- and a context-parallel run
    with such views another result at every cp size and strategy."""
    gen = torch.Generator().manual_seed(3)
    lead = (40,) if packed else (2, 40)
    q = torch.randn(*lead, 4, 32, generator=gen)
    k, v = (torch.randn(*lead, 2, 32, generator=gen) for _ in range(2))
    dout = torch.randn(*lead, 4, 32, generator=gen)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32) if packed else None

    def run(q, k, v):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = fa4dist.attention(*leaves, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="reference",
                                     cp_invariant=True, return_lse=True)
        out.backward(dout)
        return [out.detach(), lse.detach()] + [t.grad for t in leaves]

    def head_dim_outer(x):  # the same values, head_dim's stride the head count's (not 1)
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    want = run(q, k, v)
    got = run(*(head_dim_outer(t) for t in (q, k, v)))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
def test_a_large_scale_scales_the_scores_not_the_queries(cp_invariant):
    """scale * (q . k) is the score: with float16 inputs and a scale near float32's top (allowed: it is within
    float32's normal range), q * scale overflows float32 although every score is finite.  The forward scaled q first,
    so every row's scores were inf and out, lse NaN; the backward, which scales the products, had finite
    probabilities from the same inputs."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 24, 2, 16, generator=gen) * 1000).half()
    k = (torch.randn(1, 24, 2, 16, generator=gen) * 2e-7).half()  # float16 subnormals: scores ~1e30
    v, dout = (torch.randn(1, 24, 2, 16, generator=gen).half() for _ in range(2))
    scale = 1e36  # q * scale > 3.4e38 for |q| > 340
    assert torch.isinf(q.float() * scale).any()
    kw = dict(causal=True, softmax_scale=scale, backend="reference", cp_invariant=cp_invariant)
    out, lse = attention_forward(q, k, v, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True, softmax_scale=scale)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out.half(), atol=0, rtol=1e-3)  # rounded once: within an fp16 ulp
    torch.testing.assert_close(lse.double(), ref_lse, atol=0, rtol=1e-6)
    _, _, dv = attention_backward(dout, q, k, v, out, lse, **kw)
    # (dq and dk are scale x the rounding of rowsum(dout * out) - dout . v here: not compared)
    v64 = v.double().requires_grad_()
    ref_dv, = torch.autograd.grad(naive_attention(q, k, v64, causal=True, softmax_scale=scale)[0], v64,
                                  dout.double())
    torch.testing.assert_close(dv, ref_dv.half(), atol=0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
def test_values_near_the_top_of_the_range_give_a_finite_out(dtype, cp_invariant):
    """out is a convex combination of the values, so it is finite whenever they are; but P @ V sums up to seqlen_k
    values times weights of at most 1, which overflowed float32 for values of ~1e38: rows that saw two or more
    such keys came out inf where the oracle (rounded to the dtype) is finite."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 40, 2, 16, generator=gen).to(dtype), torch.randn(1, 40, 1, 16, generator=gen).to(dtype)
    v = (torch.rand(1, 40, 1, 16, generator=gen) * 1e38 + 2e38).to(dtype)  # one kv head (GQA), all ~2-3e38
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=cp_invariant)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out.to(dtype), atol=0, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
def test_values_near_the_bottom_of_the_range_keep_their_precision(dtype, cp_invariant):
    """The weights entered P @ V times 2^-32 in every call (so that values near the top of the range do not
    overflow the sum), which pushed the products of small values below float32's normal range: values of ~1e-33
    lost 8 of out's bits and values of ~1e-36 (or subnormal) gave out = 0 where the oracle is not.  Only a head
    whose values can overflow the sum is weighted now: here kv head 0 holds ~1e-36, kv head 1 ~2e38 (each head's
    weight is its own)."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 40, 4, 16, generator=gen).to(dtype), torch.randn(2, 40, 2, 16, generator=gen).to(dtype)
    v = torch.rand(2, 40, 2, 16, generator=gen) + 1  # one sign: no cancellation in out
    v[..., 0, :] *= 1e-36
    v[..., 1, :] = v[..., 1, :] * 1e38
    v = v.to(dtype)
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=cp_invariant)
    ref_out, _ = naive_attention(q, k, v, causal=True)
    tol = dict(atol=0, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(out[..., :2, :], ref_out[..., :2, :].to(dtype), **tol)  # kv head 0: small values
    torch.testing.assert_close(out[..., 2:, :], ref_out[..., 2:, :].to(dtype), **tol)  # kv head 1: near the top
    sub = (v[..., :1, :].float() * 1e-3).to(dtype)  # float32 / bfloat16 subnormals
    out, _ = attention_forward(q[..., :2, :], k[..., :1, :], sub, causal=True, backend="reference",
                               cp_invariant=cp_invariant)
    ref_out, _ = naive_attention(q[..., :2, :], k[..., :1, :], sub, causal=True)
    torch.testing.assert_close(out, ref_out.to(dtype), atol=0, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
def test_a_huge_value_a_row_cannot_see_leaves_its_small_values_alone(cp_invariant):
    """The overflow guard's weight was taken from every key of the call: a 3e38 value after a causal row pushed that
    row's products of ~1e-36 values into subnormals (55 ulps off, a subnormal out 24% off).  Each row's weight now
    comes from the keys up to the last it sees, so the rows before the huge key have the bits of the call without
    it, and the row that sees it stays finite and accurate."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 64, 2, 16, generator=gen), torch.randn(1, 64, 2, 16, generator=gen)
    v = (torch.rand(1, 64, 2, 16, generator=gen) + 1) * 1e-36
    loud = v.clone()
    loud[0, -1, :, 0] = 3e38
    quiet_out, _ = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=cp_invariant)
    out, _ = attention_forward(q, k, loud, causal=True, backend="reference", cp_invariant=cp_invariant)
    assert torch.equal(out[:, :-1], quiet_out[:, :-1])
    ref_out, _ = naive_attention(q.double(), k.double(), loud.double(), causal=True)
    torch.testing.assert_close(out[:, -1].double(), ref_out[:, -1], atol=0, rtol=1e-5)


def _oracle_grads(dout, q, k, v, dlse=None, **kw):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q64, k64, v64, **kw)
    loss = (out * dout.double()).sum() + ((lse * dlse.double()).sum() if dlse is not None else 0)
    return torch.autograd.grad(loss, (q64, k64, v64), allow_unused=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
@pytest.mark.parametrize("large", ["v", "dout", "dout and dlse"])
def test_backward_of_values_near_the_top_of_the_range(dtype, cp_invariant, large):
    """dS = P * (dout . v - dout . out): with values (or output gradients) near the top of the range both dot
    products overflow float32 (64 x 1e37) although their difference, and every gradient, is finite: the backward
    gave inf - inf = NaN for dq and dk of every row.  The gradients are linear in v - out and in dout, so they must
    be, bit for bit, 2^100 times those of the same inputs scaled by 2^-100 (where nothing overflows), and near the
    fp64 oracle (out is given in float32: in bfloat16 its rounding alone moves dout . (v - out) by 40% here; with
    v's spread of 1%, dP - delta cancels to 1% of its terms, so float32's rounding shows 100 times larger).  With
    the lse's gradient (dlse=, ~1e37 too) the gradients are linear in (dout, dlse) together."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 40, 4, 64, generator=gen).to(dtype), torch.randn(1, 40, 2, 64, generator=gen).to(dtype)
    v = torch.randn(1, 40, 2, 64, generator=gen)
    dout = torch.rand(1, 40, 4, 64, generator=gen) + 0.5  # one sign: dout . v adds up
    dlse = torch.randn(1, 4, 40, generator=gen) * 1e37 if large == "dout and dlse" else None
    if large == "v":
        v = 1e37 * (1 + 0.01 * v)  # one sign too, spread 1%
    else:
        dout = dout * 1e37
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    kw = dict(causal=True, backend="reference", cp_invariant=cp_invariant)
    out, lse = attention_forward(q, k, v, out=torch.empty(q.shape), **kw)

    def grads(dout, v, out, dlse=dlse):
        return attention_backward(dout, q, k, v, out, lse, dq=torch.empty(q.shape), dk=torch.empty(k.shape),
                                  dv=torch.empty(v.shape), dlse=dlse, **kw)

    got = grads(dout, v, out)
    small = 2.0**-100
    if large == "v":  # dq, dk linear in (v, out); dv does not read them
        want = [g * 2.0**100 for g in grads(dout, v * small, out * small)[:2]] + [grads(dout, v, out)[2]]
    else:
        want = [g * 2.0**100 for g in grads(dout * small, v, out, None if dlse is None else dlse * small)]
    for name, g, w, oracle in zip(("dq", "dk", "dv"), got, want, _oracle_grads(dout, q, k, v, dlse, causal=True)):
        assert torch.isfinite(oracle).all() and torch.isfinite(g).all(), name
        assert torch.equal(g, w), name
        assert ((g.double() - oracle).norm() / oracle.norm()).item() < (1e-3 if large == "v" else 1e-5), name


@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
def test_backward_of_an_lse_gradient_near_the_top_of_the_range(cp_invariant):
    """A loss of the lse alone (dout = 0) with |dlse| ~ 3e38 and small values (1e-3): dq and dk (~1e36) are finite,
    but P dlse summed over the keys overflows float32, and the rescaled form took its unit from dout and v alone
    (tau ~ 2^10 for these v): dlse times it overflowed again, and dq came out inf, dk NaN (the two-pass route,
    which carries dlse in dout', had them right).  Now the row's factor bounds |dlse| tau too: the gradients are
    2^100 times those of dlse * 2^-100 (where nothing overflows), bit for bit, and near the fp64 oracle."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 16, 2, 64, generator=gen), 3 + 0.1 * torch.randn(1, 16, 2, 64, generator=gen)
    v = 1e-3 * torch.randn(1, 16, 2, 64, generator=gen)
    dout, dlse = torch.zeros(q.shape), torch.full((1, 2, 16), 3e38)
    kw = dict(causal=True, softmax_scale=1e-3, backend="reference", cp_invariant=cp_invariant)
    out, lse = attention_forward(q, k, v, **kw)

    def grads(dlse):
        return attention_backward(dout, q, k, v, out, lse, dlse=dlse, dq=torch.empty(q.shape),
                                  dk=torch.empty(k.shape), **kw)[:2]

    want = [g * 2.0**100 for g in grads(dlse * 2.0**-100)]
    for name, g, w, oracle in zip(("dq", "dk"), grads(dlse), want, _oracle_grads(dout, q, k, v, dlse, causal=True,
                                                                                 softmax_scale=1e-3)):
        assert torch.isfinite(oracle.float()).all() and torch.isfinite(g).all(), name
        assert torch.equal(g, w), name
        assert ((g.double() - oracle).norm() / oracle.norm()).item() < 1e-5, name


@pytest.mark.parametrize("cp_invariant", [False, True], ids=["einsum", "cp-invariant"])
def test_huge_values_at_masked_keys_leave_the_backward_of_other_rows_alone(cp_invariant):
    """The backward's guard against overflowing dot products looks at the call's values, masked keys included; a
    huge finite value there (padding of float32's max) must still leave the rows that cannot see it bit for bit as
    on clean input (a rescaled tile would round them differently)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 40, 2, 16, generator=gen) for _ in range(4))
    p = 30  # rows < p cannot see key p
    kw = dict(causal=True, backend="reference", cp_invariant=cp_invariant)
    clean = attention_backward(dout, q, k, v, *attention_forward(q, k, v, **kw), **kw)
    v[:, p] = torch.finfo(torch.float32).max
    got = attention_backward(dout, q, k, v, *attention_forward(q, k, v, **kw), **kw)
    assert torch.equal(got[0][:, :p], clean[0][:, :p])  # dq of the rows that cannot see key p
    assert torch.equal(got[2], clean[2])  # dv = P^T dout reads no value
