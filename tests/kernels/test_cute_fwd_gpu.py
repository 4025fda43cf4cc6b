"""GPU tests of the Hopper CuTe DSL forward kernel against a float64 dense masked reference.

Fresh random inputs every case, outputs poisoned with NaN before the run (every element must be written), masks
with aligned / shifted / fully visible / fully masked / partial offsets, GQA, varlen with empty segments and
per-segment offsets, odd lengths, both dtypes, accumulate mode (merge into a running out/lse with -inf rows).
"""

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from fa4dist.kernels.cute import forward as fa4cute  # noqa: E402

if not fa4cute.is_available():
    pytest.skip("cute backend not available", allow_module_level=True)

# FA4DIST_FWD_OVERRIDE="intra_wg_overlap=0,rescale_threshold=0" (read by forward.py) runs the suite on a variant

TOL = {torch.bfloat16: (2.5e-2, 1.2e-2), torch.float16: (4e-3, 2e-3)}  # (max abs err, rel L2 err) on out


def ref_segment(q, k, v, scale, causal, q_off, k_off):
    """q (sq, h, d), k/v (sk, hk, d) -> out (sq, h, d) fp64, lse (h, sq) fp64."""
    h, hk = q.shape[1], k.shape[1]
    qd, kd, vd = q.double(), k.double(), v.double()
    kd = kd.repeat_interleave(h // hk, dim=1)
    vd = vd.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    if causal:
        qi = torch.arange(q.shape[0], device=q.device) + q_off
        kj = torch.arange(k.shape[0], device=q.device) + k_off
        s = s.masked_fill(~(kj[None, :] <= qi[:, None])[None], -math.inf)
    lse = torch.logsumexp(s, dim=-1) if k.shape[0] else torch.full(s.shape[:2], -math.inf, dtype=s.dtype,
                                                                      device=s.device)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("hqk,khd->qhd", p, vd)
    return out, lse


def ref_dense(q, k, v, scale, causal, q_offs, k_offs):
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse_b = ref_segment(q[b], k[b], v[b], scale, causal, q_offs[b], k_offs[b])
        outs.append(o)
        lses.append(lse_b)
    return torch.stack(outs), torch.stack(lses)


def ref_varlen(q, k, v, cu_q, cu_k, scale, causal, q_offs, k_offs):
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        o, lse_b = ref_segment(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], scale, causal,
                               q_offs[b], k_offs[b])
        out[cq[b]:cq[b + 1]] = o
        lse[:, cq[b]:cq[b + 1]] = lse_b
    return out, lse


def ref_merge(out_old, lse_old, out_blk, lse_blk):
    m = torch.maximum(lse_old, lse_blk)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_old = torch.exp(lse_old - m_safe)
    w_blk = torch.exp(lse_blk - m_safe)
    tot = w_old + w_blk
    new_lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(m, -math.inf))
    tot_safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    a = torch.where(tot > 0, w_old / tot_safe, torch.ones_like(tot))
    c = torch.where(tot > 0, w_blk / tot_safe, torch.zeros_like(tot))
    return a, c, new_lse


def check(out, lse, ref_out, ref_lse, dtype, lse_layout_h_first):
    assert not torch.isnan(out).any(), "NaN in out (unwritten or bad math)"
    assert not torch.isnan(lse).any(), "NaN in lse"
    atol, rtol = TOL[dtype]
    err = (out.double() - ref_out).abs()
    assert err.max().item() <= atol, f"out max abs err {err.max().item():.3e} > {atol}"
    den = ref_out.norm().item()
    if den > 0:
        assert err.norm().item() / den <= rtol, f"out rel err {err.norm().item() / den:.3e}"
    inf_ref = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf_ref), "lse -inf pattern differs"
    if (~inf_ref).any():
        lerr = (lse.double() - ref_lse)[~inf_ref].abs()
        scale = ref_lse[~inf_ref].abs().clamp_min(1.0)
        assert (lerr / scale).max().item() <= 2e-4, f"lse err {(lerr / scale).max().item():.3e}"


def run(q, k, v, causal, q_off, k_off, *, cu_q=None, cu_k=None, max_q=None, out_dtype=None, accumulate=False,
        out=None, lse=None):
    varlen = cu_q is not None
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=out_dtype or q.dtype, device=q.device)
    if lse is None:
        shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.full(shape, float("nan"), dtype=torch.float32, device=q.device)
    fa4cute.forward(q, k, v, out, lse, causal=causal, q_offset=q_off, k_offset=k_off, cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, max_seqlen_q=max_q, accumulate=accumulate)
    torch.cuda.synchronize()
    return out, lse


def rand(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32, device="cuda").to(dtype)


DENSE_CASES = [
    # (b, sq, sk, h, hk, d, causal, q_off, k_off)
    (2, 1000, 1000, 4, 4, 128, False, 0, 0),
    (2, 1000, 1000, 4, 4, 128, True, 0, 0),  # aligned
    (1, 1000, 1000, 4, 4, 128, True, 0, 300),  # shifted: first 300 rows see nothing
    (1, 1000, 1000, 2, 2, 128, True, 5000, 0),  # fully visible
    (1, 777, 513, 2, 2, 128, True, 0, 5000),  # fully masked
    (1, 17, 4097, 2, 2, 128, True, 4080, 0),  # partial, sq << sk
    (1, 4097, 1000, 2, 2, 128, True, 0, 2000),  # partial, sq >> sk
    (1, 1, 1, 2, 2, 128, False, 0, 0),
    (1, 1, 1, 2, 2, 128, True, 0, 0),
    (3, 200, 333, 8, 4, 128, True, 100, 0),  # GQA 2
    (1, 4097, 4097, 16, 2, 128, True, 0, 0),  # GQA 8, odd length
    (1, 1000, 16500, 2, 1, 128, False, 0, 0),  # 176-key tiles (forward.wide_tiles_launch), the last one partial
    (1, 1000, 16500, 2, 1, 128, True, 15500, 0),  # causal: 160-key tiles, bottom-right diagonal, last one partial
    (1, 16400, 16400, 2, 2, 128, True, 0, 0),  # causal 160-key tiles from the top, padding rows
    (2, 1000, 1000, 6, 3, 64, False, 0, 0),
    (2, 1000, 1500, 6, 3, 64, True, 500, 0),
    (1, 2049, 2049, 2, 1, 96, True, 0, 0),
    (1, 300, 700, 2, 2, 96, False, 0, 0),
    (1, 1000, 1000, 2, 2, 64, True, 0, 123),
    (2, 300, 300, 4, 2, 64, True, 0, 0),  # at most 512 rows: forward.tiny_tiles
    (2, 1000, 1000, 4, 2, 256, True, 0, 0),  # hdim 256 (Gemma 2 / 3): 128 x 64 tiles
    (1, 700, 1300, 2, 2, 256, False, 0, 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=[str(c) for c in DENSE_CASES])
def test_dense(case, dtype):
    b, sq, sk, h, hk, d, causal, qo, ko = case
    if dtype == torch.float16 and d == 96:
        pytest.skip("fp16 d96 covered by the varlen cases")
    torch.manual_seed(hash(case) % 2**31)
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype)
    out, lse = run(q, k, v, causal, qo, ko)
    ref_out, ref_lse = ref_dense(q, k, v, 1 / math.sqrt(d), causal, [qo] * b, [ko] * b)
    check(out, lse, ref_out, ref_lse, dtype, False)


def test_dense_per_sequence_offsets_and_fp32_out():
    torch.manual_seed(7)
    b, s, h, d = 3, 600, 4, 128
    q, k, v = (rand(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    qo, ko = [0, 1000, 0], [0, 0, 400]
    out, lse = run(q, k, v, True, qo, ko, out_dtype=torch.float32)
    ref_out, ref_lse = ref_dense(q, k, v, 1 / math.sqrt(d), True, qo, ko)
    check(out, lse, ref_out, ref_lse, torch.bfloat16, False)


LONG_ROW_CASES = [
    # (b, sq, sk, h, hk, d, causal): rows of 64k keys (q_offset sk - sq when causal: the bottom-right diagonal)
    (1, 256, 65536, 2, 1, 128, False),  # 176-key tiles (forward.wide_tiles_launch): 373 of them
    (1, 256, 65536, 2, 1, 128, True),  # 160-key tiles
    (1, 384, 65536, 2, 2, 64, False),  # 128-key tiles: 512
]


@pytest.mark.parametrize("split_tail", [True, False], ids=["split", "one_loop"])
@pytest.mark.parametrize("case", LONG_ROW_CASES, ids=[str(c) for c in LONG_ROW_CASES])
def test_long_rows_lse_does_not_drift(case, split_tail):
    """A row's lse over many key tiles stays within a few fp32 roundings of its magnitude from the fp64 lse,
    whatever the tile count: the online softmax must not rescale its sum by a factor other than exactly 1 while the
    row max holds (a fused ``m_old * c - m * c`` is m * c's rounding error, whose exp2 is 1 + ~1 ulp, and the lse
    drifted by that every key tile: 1.5e-5 over 94 tiles on the H200, so ~4.5e-5 over 373). One loop over every
    tile, and split tiles (parts)."""
    b, sq, sk, h, hk, d, causal = case
    torch.manual_seed(sk + sq + d)
    q, k, v = rand(b, sq, h, d, dtype=torch.bfloat16), rand(b, sk, hk, d, dtype=torch.bfloat16), \
        rand(b, sk, hk, d, dtype=torch.bfloat16)
    q_off = sk - sq if causal else 0
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
    fa4cute.forward(q, k, v, out, lse, causal=causal, q_offset=q_off, split_tail=split_tail)
    torch.cuda.synchronize()
    ref_o, ref_l = ref_dense(q, k, v, d**-0.5, causal, [q_off] * b, [0] * b)
    check(out, lse, ref_o, ref_l, torch.bfloat16, True)
    # 8 roundings of fp32 at the lse's magnitude (|lse| ~ 11.5 here: 1.1e-5); the drift was 4-5x that
    bound = 8 * 2.0**-23 * ref_l.abs().clamp_min(1.0)
    err = (lse.double() - ref_l).abs()
    print(f"lse max abs err {err.max().item():.2e}, max err / bound {(err / bound).max().item():.2f}")
    assert (err <= bound).all(), f"lse off the fp64 lse by {err.max().item():.2e} (bound {bound.max().item():.2e})"


def _segments(seed, nseg, max_len, allow_empty=True):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0 if allow_empty else 1, max_len + 1, (nseg,), generator=g)
    return lens


VARLEN_CASES = [
    # (seed, nseg, max_len_q, max_len_k, h, hk, d, causal, per_segment_offsets)
    (1, 5, 700, 900, 4, 2, 128, False, False),
    (2, 6, 1100, 800, 4, 4, 128, True, False),
    (3, 7, 600, 1300, 8, 1, 128, True, True),
    (4, 4, 2000, 2000, 2, 2, 64, True, True),
    (5, 5, 500, 500, 3, 3, 96, False, False),
    (6, 3, 129, 4097, 2, 2, 128, True, True),
    (7, 9, 1000, 1000, 4, 2, 64, True, False),  # short documents: at most 1024 rows (forward.short_documents)
    (8, 12, 400, 400, 4, 2, 64, True, True),  # at most 512 rows a document: forward.tiny_tiles
    (9, 5, 900, 900, 4, 1, 256, True, True),  # hdim 256
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=[str(c) for c in VARLEN_CASES])
def test_varlen(case, dtype):
    seed, nseg, mq, mk, h, hk, d, causal, per_seg = case
    lq, lk = _segments(seed, nseg, mq), _segments(seed + 100, nseg, mk)
    lq[0] = 0  # an empty query segment
    lk[-1] = 0  # queries without keys
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32).cuda()
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32).cuda()
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    torch.manual_seed(seed)
    q, k, v = rand(tq, h, d, dtype=dtype), rand(tk, hk, d, dtype=dtype), rand(tk, hk, d, dtype=dtype)
    if per_seg:
        g = torch.Generator().manual_seed(seed + 7)
        qo = torch.randint(0, 3000, (nseg,), generator=g).tolist()
        ko = torch.randint(0, 3000, (nseg,), generator=g).tolist()
        q_off = torch.tensor(qo, dtype=torch.int32, device="cuda")
        k_off = torch.tensor(ko, dtype=torch.int32, device="cuda")
    else:
        qo, ko = [64] * nseg, [0] * nseg
        q_off, k_off = 64, 0
    out, lse = run(q, k, v, causal, q_off, k_off, cu_q=cu_q, cu_k=cu_k, max_q=int(lq.max()))
    ref_out, ref_lse = ref_varlen(q, k, v, cu_q, cu_k, 1 / math.sqrt(d), causal, qo, ko)
    check(out, lse, ref_out, ref_lse, dtype, True)


def test_varlen_without_max_seqlen():
    lq = torch.tensor([5, 0, 300, 77])
    lk = torch.tensor([9, 4, 250, 0])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32).cuda()
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32).cuda()
    q = rand(int(cu_q[-1]), 2, 128, dtype=torch.bfloat16)
    k, v = rand(int(cu_k[-1]), 2, 128, dtype=torch.bfloat16), rand(int(cu_k[-1]), 2, 128, dtype=torch.bfloat16)
    out, lse = run(q, k, v, True, 0, 0, cu_q=cu_q, cu_k=cu_k, max_q=None)
    ref_out, ref_lse = ref_varlen(q, k, v, cu_q, cu_k, 1 / math.sqrt(128), True, [0] * 4, [0] * 4)
    check(out, lse, ref_out, ref_lse, torch.bfloat16, True)


ACC_CASES = [
    # (varlen, causal, q_off, k_off, d)
    (False, False, 0, 0, 128),
    (False, True, 0, 0, 128),
    (False, True, 0, 500, 64),  # block has -inf rows
    (False, True, 0, 5000, 128),  # block fully masked: running result unchanged
    (True, True, 100, 0, 128),
    (True, False, 0, 0, 96),
    (False, True, 0, 300, 256),  # hdim 256: the running rows merged one at a time
    (True, True, 100, 0, 256),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ACC_CASES, ids=[str(c) for c in ACC_CASES])
def test_accumulate(case, dtype):
    varlen, causal, qo, ko, d = case
    torch.manual_seed(11 + qo + ko + d)
    h, hk = 4, 2
    if varlen:
        lq, lk = torch.tensor([300, 0, 1000, 77]), torch.tensor([500, 20, 900, 0])
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32).cuda()
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32).cuda()
        q = rand(int(cu_q[-1]), h, d, dtype=dtype)
        k, v = rand(int(cu_k[-1]), hk, d, dtype=dtype), rand(int(cu_k[-1]), hk, d, dtype=dtype)
        ref_out, ref_lse = ref_varlen(q, k, v, cu_q, cu_k, 1 / math.sqrt(d), causal, [qo] * 4, [ko] * 4)
        lse_shape, max_q = (h, q.shape[0]), int(lq.max())
    else:
        b, sq, sk = 2, 700, 900
        q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype)
        cu_q = cu_k = max_q = None
        ref_out, ref_lse = ref_dense(q, k, v, 1 / math.sqrt(d), causal, [qo] * b, [ko] * b)
        lse_shape = (b, h, sq)
    # running result: random, with some -inf rows (nothing seen yet)
    out_old = torch.randn(q.shape, dtype=torch.float32, device="cuda")
    lse_old = torch.randn(lse_shape, dtype=torch.float32, device="cuda") * 2 + 3
    lse_old.view(-1)[::7] = -math.inf
    out_run, lse_run = out_old.clone(), lse_old.clone()
    run(q, k, v, causal, qo, ko, cu_q=cu_q, cu_k=cu_k, max_q=max_q, accumulate=True, out=out_run, lse=lse_run)
    # expected merge in fp64; lse layout (.., h, s) vs out layout (.., s, h, d)
    a, c, new_lse = ref_merge(out_old.double(), lse_old.double(), ref_out, ref_lse)
    if varlen:
        a_o, c_o = a.transpose(0, 1)[..., None], c.transpose(0, 1)[..., None]
    else:
        a_o, c_o = a.transpose(1, 2)[..., None], c.transpose(1, 2)[..., None]
    exp_out = torch.where(a_o == 0, torch.zeros_like(ref_out), out_old.double() * a_o) + ref_out * c_o
    assert not torch.isnan(out_run).any() and not torch.isnan(lse_run).any()
    atol, rtol = TOL[dtype]
    err = (out_run.double() - exp_out).abs().max().item()
    assert err <= atol, f"accumulated out err {err:.3e}"
    inf_ref = torch.isinf(new_lse)
    assert torch.equal(torch.isinf(lse_run), inf_ref)
    lerr = ((lse_run.double() - new_lse)[~inf_ref].abs() / new_lse[~inf_ref].abs().clamp_min(1)).max().item()
    assert lerr <= 2e-4, f"accumulated lse err {lerr:.3e}"


def test_accumulate_matches_two_step_full():
    """Two accumulate calls over the two halves of the keys equal one call over all keys."""
    torch.manual_seed(3)
    b, s, h, d = 2, 1024, 4, 128
    q, k, v = (rand(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device="cuda")
    lse = torch.full((b, h, s), -math.inf, dtype=torch.float32, device="cuda")
    half = s // 2
    for lo in (half, 0):  # later keys first: order must not matter
        fa4cute.forward(q, k[:, lo:lo + half], v[:, lo:lo + half], out, lse, causal=True, q_offset=0,
                        k_offset=lo, accumulate=True)
    ref_out, ref_lse = ref_dense(q, k, v, 1 / math.sqrt(d), True, [0] * b, [0] * b)
    torch.cuda.synchronize()
    check(out, lse, ref_out, ref_lse, torch.bfloat16, False)


def test_registry_backend_roundtrip():
    import fa4dist.kernels as K

    torch.manual_seed(5)
    q, k, v = (rand(2, 512, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    out, lse = K.attention_forward(q, k, v, causal=True, q_offset=128, k_offset=0, backend="cute")
    ref_out, ref_lse = ref_dense(q, k, v, 1 / math.sqrt(128), True, [128] * 2, [0] * 2)
    torch.cuda.synchronize()
    check(out, lse, ref_out, ref_lse, torch.bfloat16, False)


def test_steady_state_no_recompile():
    q, k, v = (rand(1, 256, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    run(q, k, v, True, 0, 0)
    n = len(fa4cute.cache_info())
    for s in (100, 300, 1000):
        q2, k2, v2 = (rand(2, s, 2, 128, dtype=torch.bfloat16) for _ in range(3))
        run(q2, k2, v2, True, 7, 3)
    assert len(fa4cute.cache_info()) == n


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_rows_equal_expanded_rows(packed, d):
    """A query head's out and lse do not depend on how many query heads share its K/V: GQA gives the bytes of K/V
    expanded per query head (cp_invariant's forward relies on it and skips the expansion)."""
    from fa4dist.kernels import attention_forward, invariant

    g = torch.Generator(device="cuda").manual_seed(torch.seed() % (2**31))
    if packed:
        cu = torch.tensor([0, 300, 1000, 1777], dtype=torch.int32, device="cuda")
        shape_q, shape_k, kw = (1777, 8, d), (1777, 2, d), dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        shape_q, shape_k, kw = (2, 1500, 8, d), (2, 1500, 2, d), {}
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    gqa = attention_forward(q, k, v, causal=True, backend="cute", **kw)
    expanded = attention_forward(q, invariant.expand_kv(k, 4), invariant.expand_kv(v, 4), causal=True,
                                 backend="cute", **kw)
    for a, b in zip(gqa, expanded):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


PERSISTENT_CASES = [
    # (name, b, sq, sk, h, hk, d, causal, q_off, k_off, extra)
    ("full", 2, 1500, 1100, 4, 2, 128, False, 0, 0, {}),
    ("causal_gqa", 3, 2000, 2000, 8, 2, 128, True, 0, 0, {}),
    ("causal_d64", 2, 1700, 1700, 6, 3, 64, True, 0, 0, {}),
    ("shifted", 2, 1000, 1300, 4, 4, 128, True, 0, 600, {}),  # tiles without keys between tiles with keys
    ("window", 2, 2100, 2100, 4, 2, 128, True, 0, 0, dict(window_left=300)),
    ("softcap_sinks", 2, 1200, 1200, 4, 2, 128, True, 0, 0, dict(softcap=30.0)),
    # hdim 96 causal: 32 producer registers on both sides (the persistent grid's default; 24 spill there)
    ("causal_d96_regs32", 2, 1500, 1500, 4, 2, 96, True, 0, 0, dict(regs_producer=32)),
]


# every case on one CTA per SM of an H200 (most CTAs walk 2-4 tiles), two also on 5 CTAs (dozens of tiles each);
# the static walk and the dynamic one (tiles claimed from a global counter)
# (exact: both kernels merge with fixed roundings, FwdConfig.exact_merge, and the merges must agree bitwise too)
PERSISTENT_RUNS = ([(c, 132, dyn, False) for c in PERSISTENT_CASES for dyn in (False, True)]
                   + [(PERSISTENT_CASES[i], 5, dyn, False) for i in (1, 4) for dyn in (False, True)]
                   + [(PERSISTENT_CASES[i], 132, True, True) for i in (0, 1, 4)])


@pytest.mark.parametrize("case,ctas,dynamic,exact", PERSISTENT_RUNS,
                         ids=[f"{c[0]}-{n}{'-dynamic' if d else ''}{'-exact' if e else ''}"
                              for c, n, d, e in PERSISTENT_RUNS])
def test_persistent_grid_gives_the_bits_of_one_cta_per_tile(case, ctas, dynamic, exact):
    """A persistent grid (each CTA walks several tiles, its pipelines running on from one tile into the next)
    writes every out / lse byte a one-CTA-per-tile grid writes: plain, with GQA, masked, windowed, capped with
    sinks, NaN in masked V rows, packed (with the dynamic walk); and the accumulate-merge form within fp32
    rounding. (Packed and merge launches are persistent only on request: forward.default_persistent_ctas.)"""
    _, b, sq, sk, h, hk, d, causal, qo, ko, extra = case
    torch.manual_seed(ctas + sq)
    q, k, v = rand(b, sq, h, d, dtype=torch.bfloat16), rand(b, sk, hk, d, dtype=torch.bfloat16), \
        rand(b, sk, hk, d, dtype=torch.bfloat16)
    if causal:
        v[:, -5] = float("nan")  # masked for most rows: the sanitizer's stage bookkeeping runs across tiles
    sinks = torch.randn(h, device="cuda") if extra.get("softcap") else None
    running = (torch.randn(q.shape, dtype=torch.float32, device="cuda"),
               torch.randn((b, h, sq), dtype=torch.float32, device="cuda"))

    def launch(**kw):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
        fa4cute.forward(q, k, v, out, lse, causal=causal, q_offset=qo, k_offset=ko, sinks=sinks, **extra, **kw)
        # the same rows merged into a running result, and packed
        run_o, run_l = (t.clone() for t in running)
        if sinks is None:
            fa4cute.forward(q, k, v, run_o, run_l, causal=causal, q_offset=qo, k_offset=ko, accumulate=True,
                            **extra, **kw)
        results = [out, lse, run_o, run_l]
        if dynamic:  # packed launches are persistent only with the dynamic walk
            cu_q = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * sq
            cu_k = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * sk
            pk_o = torch.full((b * sq, h, d), float("nan"), dtype=q.dtype, device="cuda")
            pk_l = torch.full((h, b * sq), float("nan"), dtype=torch.float32, device="cuda")
            fa4cute.forward(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), pk_o, pk_l, causal=causal,
                            q_offset=qo, k_offset=ko, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq,
                            sinks=sinks, **extra, **kw)
            results += [pk_o, pk_l]
        torch.cuda.synchronize()
        return results

    merge_kw = dict(exact_merge=True) if exact else {}
    want = launch(persistent_ctas=0, **merge_kw)
    # (the last wave's split over keys, on by default for dense non-causal launches, is test_split_tail_tiles')
    got = launch(persistent_ctas=ctas, dynamic_tiles=dynamic, split_tail=False, **merge_kw)
    for name, a, g in zip(("out", "lse", "packed out", "packed lse"), want[:2] + want[4:], got[:2] + got[4:]):
        assert torch.equal(a.view(torch.uint8), g.view(torch.uint8)), f"{name} differs with {ctas} persistent CTAs"
    # the merge epilogue compiled into the persistent kernel rounds o_old * w_old + o_blk apart from the other kernel
    # (fused or not: measured up to 2.6e-5 relative to small results) unless exact_merge fixes the roundings; both
    # must still be the merge to fp32 rounding of its O(1) terms
    for name, a, g in zip(("merged out", "merged lse"), want[2:], got[2:]):
        if exact:
            assert torch.equal(a.view(torch.uint8), g.view(torch.uint8)), f"{name} differs with exact merges"
            continue
        assert torch.equal(torch.isnan(a), torch.isnan(g)), f"{name}: NaN pattern differs"
        err = (a - g).abs().nan_to_num(0.0).max().item()
        print(f"{name}: max abs difference {err:.2e}")
        assert err <= 16 * 2.0 ** -23, f"{name} differs by {err:.2e} with {ctas} persistent CTAs"


SPLIT_TAIL_CASES = [
    # (b, sq, sk, h, hk, d): dense non-causal launches with a partial last wave on 132 SMs
    (1, 4000, 4050, 5, 1, 128),  # 160 tiles, 28 split in 4: padding rows, the last key block cut, MQA
    (1, 3000, 2048, 9, 3, 64),  # 192-row tiles: 144, 12 split in 4
    (2, 1500, 1500, 6, 2, 96),  # 144, 12 split in 3
    (1, 2200, 16500, 9, 3, 128),  # 162 tiles of 176-key blocks (forward.wide_tiles_launch), a partial last block
]


@pytest.mark.parametrize("case", SPLIT_TAIL_CASES, ids=[str(c) for c in SPLIT_TAIL_CASES])
def test_split_tail_tiles(case):
    """The tiles of a launch's last partial wave run as parts over their key blocks (FwdConfig.split_tail,
    split_plans.split_plan), merged by the part that finishes last, in part order: against the fp64 oracle with every
    element written (out / lse poisoned), the tiles before the split with the bytes of the unsplit launch, the same
    bytes from run to run, and a NaN in a V row NaN in every row that sees it, as unsplit."""
    b, sq, sk, h, hk, d = case
    cfg = fa4cute.make_config(torch.bfloat16, d, causal=False, varlen=False, accumulate=False,
                              wide=fa4cute.wide_tiles_launch(d, False, True, sk))  # the call's own key tiles
    assert cfg.split_tail
    start, parts = fa4cute.dense_split_plan(cfg, (b, sq, h, d), sk)
    if parts == 1:
        pytest.skip(f"no split on {cfg.persistent_ctas} SMs")
    torch.manual_seed(sq + d)
    q, k, v = rand(b, sq, h, d, dtype=torch.bfloat16), rand(b, sk, hk, d, dtype=torch.bfloat16), \
        rand(b, sk, hk, d, dtype=torch.bfloat16)

    def launch(**kw):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
        fa4cute.forward(q, k, v, out, lse, **kw)
        torch.cuda.synchronize()
        return out, lse

    out, lse = launch()
    ref_o, ref_l = ref_dense(q, k, v, d**-0.5, False, [0] * b, [0] * b)
    check(out, lse, ref_o, ref_l, torch.bfloat16, True)
    again = launch()
    for a, g in zip((out, lse), again):
        assert torch.equal(a.view(torch.uint8), g.view(torch.uint8)), "split tiles differ from run to run"
    plain_o, plain_l = launch(split_tail=False)
    split_rows = fa4cute.split_rows(cfg, q.shape, (start, parts)).cuda()  # (b, h, sq)
    assert torch.equal(lse.view(torch.int32)[~split_rows], plain_l.view(torch.int32)[~split_rows])
    keep = ~split_rows.transpose(1, 2)  # (b, sq, h)
    assert torch.equal(out.view(torch.int16)[keep], plain_o.view(torch.int16)[keep])
    assert (lse - plain_l)[split_rows].abs().max().item() < 1e-5
    assert (out.float() - plain_o.float())[~keep].abs().max().item() < TOL[torch.bfloat16][0]
    v[:, 17, 0] = float("nan")  # every query head of kv head 0 sees it (non-causal): NaN rows, split or not
    nan_o, _ = launch()
    plain_nan_o, _ = launch(split_tail=False)
    assert torch.equal(torch.isnan(nan_o), torch.isnan(plain_nan_o))
    assert torch.isnan(nan_o[:, :, : h // hk]).all() and not torch.isnan(nan_o[:, :, h // hk:]).any()


CAUSAL_SPLIT_CASES = [
    # (b, sq, sk, h, hk, d, q_offset): dense causal launches of one wave or less on 132 SMs
    (1, 4096, 4096, 4, 1, 128, 0),  # 128 tiles: the 9 longest of every head in halves
    (1, 4096, 4096, 1, 1, 128, 0),  # 32 tiles: the 17 longest in quarters
    (1, 4000, 4050, 3, 1, 128, 0),  # padding rows, the last key block cut, the keys past the queries' reach
    (1, 2048, 4096, 6, 2, 128, 2048),  # bottom-right diagonal (q_offset: every tile long)
    (2, 3000, 3000, 2, 2, 64, -200),  # 192-row tiles; the first 200 rows see no key
    (1, 5000, 5000, 2, 1, 96, 0),
    (2, 3000, 3000, 2, 2, 128, (0, -700)),  # one offset per sequence (the plan takes the first's diagonal)
    (1, 16384, 16384, 1, 1, 128, 0),  # 128 tiles on 160-key blocks (forward.wide_tiles_launch), the last one cut
    (2, 2000, 16500, 2, 1, 128, (14500, 13000)),  # 160-key blocks, one offset per sequence
]


@pytest.mark.parametrize("case", CAUSAL_SPLIT_CASES, ids=[str(c) for c in CAUSAL_SPLIT_CASES])
def test_causal_split_tiles(case):
    """A causal launch of few waves runs its longest tiles as parts over their key blocks, claimed first
    (split_plans.causal_split_plan, FwdConfig.split_tail), merged by the part that finishes last, in part order:
    against the fp64 oracle with every element written (out / lse poisoned), the other tiles with the bytes of the
    unsplit launch, the same bytes from run to run, and NaN in a V row NaN in exactly the rows that see it (also a
    row that only a split tile's last part sees), as unsplit."""
    b, sq, sk, h, hk, d, q_off = case
    offsets = list(q_off) if isinstance(q_off, tuple) else [q_off] * b
    if isinstance(q_off, tuple):  # per sequence: a tensor for the kernel
        q_off = torch.tensor(q_off, dtype=torch.int32, device="cuda")
    cfg = fa4cute.make_config(torch.bfloat16, d, causal=True, varlen=False, accumulate=False,
                              seg_offsets=isinstance(q_off, torch.Tensor),
                              wide=fa4cute.wide_tiles_launch(d, True, True, sk))  # the call's own key tiles
    assert cfg.split_tail
    edge, parts = fa4cute.dense_split_plan(cfg, (b, sq, h, d), sk, 0 if isinstance(q_off, torch.Tensor) else q_off)
    if parts == 1:
        pytest.skip(f"no split on {cfg.persistent_ctas} SMs")
    assert edge % (b * h) == 0
    torch.manual_seed(sq + d)
    q, k, v = rand(b, sq, h, d, dtype=torch.bfloat16), rand(b, sk, hk, d, dtype=torch.bfloat16), \
        rand(b, sk, hk, d, dtype=torch.bfloat16)

    def launch(values=v, **kw):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
        fa4cute.forward(q, k, values, out, lse, causal=True, q_offset=q_off, **kw)
        torch.cuda.synchronize()
        return out, lse

    out, lse = launch()
    ref_o, ref_l = ref_dense(q, k, v, d**-0.5, True, offsets, [0] * b)
    check(out, lse, ref_o, ref_l, torch.bfloat16, True)
    again = launch()
    for a, g in zip((out, lse), again):
        assert torch.equal(a.view(torch.uint8), g.view(torch.uint8)), "split tiles differ from run to run"
    plain_o, plain_l = launch(split_tail=False)
    split_rows = fa4cute.split_rows(cfg, q.shape, (edge, parts)).cuda()  # the longest edge / (b * h) tiles of each
    assert torch.equal(lse.view(torch.int32)[~split_rows], plain_l.view(torch.int32)[~split_rows])
    keep = ~split_rows.transpose(1, 2)  # (b, sq, h)
    assert torch.equal(out.view(torch.int16)[keep], plain_o.view(torch.int16)[keep])
    assert (lse - plain_l)[split_rows].abs().max().item() < 1e-5
    assert (out.float() - plain_o.float())[~keep].abs().max().item() < TOL[torch.bfloat16][0]
    for bad in (17, sk - 5):  # seen by most rows / only by the last rows (a split tile's last part)
        v_bad = v.clone()
        v_bad[:, bad, 0] = float("nan")
        nan_o, _ = launch(v_bad)
        plain_nan_o, _ = launch(v_bad, split_tail=False)
        want = torch.zeros(b, sq, h, dtype=torch.bool, device="cuda")
        for i in range(b):  # rows whose diagonal reaches the bad key
            want[i, :, : h // hk] = (torch.arange(sq, device="cuda") + offsets[i] >= bad)[:, None]
        assert torch.equal(torch.isnan(nan_o).any(-1), want), f"V row {bad}"
        assert torch.equal(torch.isnan(nan_o), torch.isnan(plain_nan_o)), f"V row {bad}"


SCHEDULE_FIELD_CASES = [
    # (b, s, h, hk, d, causal, extra)
    (2, 1500, 4, 2, 128, False, {}),
    (2, 1500, 4, 2, 128, True, {}),
    (2, 1500, 6, 3, 64, False, {}),
    (2, 1500, 6, 3, 64, True, {}),
    (1, 1200, 4, 2, 128, True, dict(softcap=30.0, window_left=300)),
]


@pytest.mark.parametrize("field", fa4cute._SCHEDULE_FIELDS)
@pytest.mark.parametrize("case", SCHEDULE_FIELD_CASES, ids=[str(c[:6]) + ("-" + "-".join(c[6]) if c[6] else "")
                                                            for c in SCHEDULE_FIELD_CASES])
def test_schedule_fields_give_the_same_bits(case, field):
    """Each of forward._SCHEDULE_FIELDS (late_pv_wait: the K / V waits tried before they block, P converted with
    inline cvts; hoist_descriptors / hoist_q_slices: the smem descriptor bases, and Q's slices, computed once per
    tile; interleave_lengths: long and short causal tiles alternating in the launch order; chained_max: the row
    max as four max.f32 chains, the same max for rows without a NaN score; defer_v_marks: a masked block's rows
    that see a bad V row marked one step later; reset_counter: the stream's tile counter, reset by the last
    claim; elect_release: the step's stage releases by elect.sync; late_k_release: by the tile's elect.sync winner,
    the K release after the step's softmax) changes where ptxas schedules or which CTA
    computes what, not what is computed: out / lse bytes equal
    either way, fresh and merged into a running result, with NaN in masked V rows (one in the last key block,
    masked for all rows but the last few; one mid-sequence, in a masked step of its tile's own blocks and a plain
    block of later tiles)."""
    b, s, h, hk, d, causal, extra = case
    torch.manual_seed(s + d)
    q, k, v = rand(b, s, h, d, dtype=torch.bfloat16), rand(b, s, hk, d, dtype=torch.bfloat16), \
        rand(b, s, hk, d, dtype=torch.bfloat16)
    if causal:
        v[:, -5] = float("nan")  # masked for all rows but the last few
        v[:, s // 2 + 3, :, 1] = float("inf")
    running = (torch.randn(q.shape, dtype=torch.float32, device="cuda"),
               torch.randn((b, h, s), dtype=torch.float32, device="cuda"))

    def launch(on):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((b, h, s), float("nan"), dtype=torch.float32, device="cuda")
        fa4cute.forward(q, k, v, out, lse, causal=causal, **{field: on}, **extra)
        run_o, run_l = (t.clone() for t in running)
        fa4cute.forward(q, k, v, run_o, run_l, causal=causal, accumulate=True, **{field: on}, **extra)
        torch.cuda.synchronize()
        return out, lse, run_o, run_l

    want, got = launch(False), launch(True)
    for name, a, g in zip(("out", "lse", "merged out", "merged lse"), want, got):
        assert torch.equal(a.view(torch.uint8), g.view(torch.uint8)), f"{name} differs with {field}"
    if not causal:  # (causal cases hold a NaN V row: their oracle rows are NaN too)
        ref_o, ref_l = ref_dense(q, k, v, d**-0.5, False, [0] * b, [0] * b)
        check(got[0], got[1], ref_o, ref_l, torch.bfloat16, True)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_stale_row_max_still_matches_the_oracle(causal, d):
    """rescale_threshold > 0 (a measurement knob): the row max is kept until the new one exceeds it by more than
    the threshold (log2 units), so O is rescaled less often, and the result must not move: keys whose scores grow
    along the sequence (each tile's max a little above the last, a few tiles far above) put both branches to work;
    out and lse against the fp64 oracle, as the default kernel's."""
    b, s, h = 2, 1500, 4
    torch.manual_seed(d + causal)
    q, v = rand(b, s, h, d, dtype=torch.bfloat16), rand(b, s, h, d, dtype=torch.bfloat16)
    growth = torch.linspace(0.5, 2.0, s, device="cuda")[None, :, None, None]
    growth[:, 700:720] *= 4  # a jump far past any threshold
    k = (torch.randn(b, s, h, d, device="cuda") * growth).to(torch.bfloat16)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((b, h, s), float("nan"), dtype=torch.float32, device="cuda")
    fa4cute.forward(q, k, v, out, lse, causal=causal, rescale_threshold=8.0)
    torch.cuda.synchronize()
    ref_o, ref_l = ref_dense(q, k, v, d**-0.5, causal, [0] * b, [0] * b)
    check(out, lse, ref_o, ref_l, torch.bfloat16, True)


@pytest.mark.parametrize("causal", [False, True])
def test_reset_counter_hands_the_stream_counter_on_at_zero(causal):
    """FwdConfig.reset_counter: the launch's last tile claim writes the counter back to 0, so launches in one
    stream's order share that stream's counter (host.tile_counter) with no fill: three launches in a row give the
    bytes of fresh-counter launches (a counter left non-zero would skip tiles, and the poisoned out would show it),
    the counter reads 0 after them, another stream gets a counter of its own, and a CUDA graph's capture takes a
    fresh one whose replays give the same bytes."""
    from fa4dist.kernels.cute import host

    torch.manual_seed(7 + causal)
    b, s, h, d = 2, 3000, 8, 128  # ~400 tiles on the persistent grid, several waves
    q, k, v = (rand(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    knobs = dict(reset_counter=True, split_tail=False)  # (a split launch takes fresh counters of its own)

    def launch(**kw):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((b, h, s), float("nan"), dtype=torch.float32, device="cuda")
        fa4cute.forward(q, k, v, out, lse, causal=causal, **kw)
        return out, lse

    want = launch(reset_counter=False, split_tail=False)
    got = [launch(**knobs) for _ in range(3)]
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    counter = host._STREAM_COUNTERS[(stream.device.index, stream.cuda_stream)]
    assert counter.item() == 0
    for out, lse in got:
        assert torch.equal(out.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(lse.view(torch.uint8), want[1].view(torch.uint8))
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        side_out, _ = launch(**knobs)
    stream.wait_stream(side)
    assert host._STREAM_COUNTERS[(side.device.index, side.cuda_stream)] is not counter
    assert torch.equal(side_out.view(torch.uint8), want[0].view(torch.uint8))

    static_out = torch.empty_like(q)
    static_lse = torch.empty((b, h, s), dtype=torch.float32, device="cuda")
    launch(**knobs)  # (compiled and warm before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fa4cute.forward(q, k, v, static_out, static_lse, causal=causal, **knobs)
    for _ in range(2):
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out.view(torch.uint8), want[0].view(torch.uint8))
    assert counter.item() == 0
