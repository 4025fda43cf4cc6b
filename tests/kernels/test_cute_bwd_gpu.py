"""The Hopper CuTe DSL backward (fa4dist/kernels/cute/backward.py) against the fp64 reference, on the GPU.

Fresh random inputs every test, outputs poisoned with NaN first (every element must be written), lse / out taken from
the fp64 reference forward (the *global* out and lse a ring would hold). Masks and offsets (aligned, shifted, fully
visible, rows that see nothing, nothing visible), GQA ratios 1/2/8, packed documents with random lengths including
empty ones, bf16 and fp16, fp32 out/dout, accumulate mode, deterministic mode (bitwise over repeated runs on inputs
large enough for many CTAs to contend).
"""

import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

from fa4dist.kernels import attention_backward, attention_forward  # noqa: E402
from fa4dist.kernels.cute.backward import backward, supports_backward  # noqa: E402
from oracle import REL_TOL, random_cu_seqlens, rel_error  # noqa: E402


def _gen():
    return torch.Generator(device="cuda").manual_seed(torch.seed() % (2**31))


def _inputs(shape_q, shape_k, dtype, g):
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(shape_k, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape_k, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _causal_case(g, packed, d, heads_kv):
    """(q, k, v, kernel kwargs, forward kwargs), bf16, 4 query heads, causal: three packed segments of different
    lengths, or a dense batch of 2 with 1500 queries 200 positions after 1700 keys' start."""
    if packed:
        cu = torch.tensor([0, 300, 1000, 1777], dtype=torch.int32, device="cuda")
        q, k, v = _inputs((1777, 4, d), (1777, heads_kv, d), torch.bfloat16, g)
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=777, max_seqlen_k=777)
        return q, k, v, kw, dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    q, k, v = _inputs((2, 1500, 4, d), (2, 1700, heads_kv, d), torch.bfloat16, g)
    return q, k, v, dict(causal=True, q_offset=200), dict(causal=True, q_offset=200)


def _reference(q, k, v, dout, **kw):
    """fp64 out/lse (forward) and dq/dk/dv (backward) through the reference backend on upcast inputs."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    out, lse = attention_forward(q64, k64, v64, backend="reference", **kw)
    grads = attention_backward(dout.double(), q64, k64, v64, out, lse, backend="reference", **kw)
    return out, lse, grads


def _run(q, k, v, dout, out, lse, *, dtype_grads=None, accumulate=False, init=None, deterministic=False, **kw):
    dtype_grads = dtype_grads or q.dtype
    if accumulate:
        bufs = [t.clone() for t in init]
    else:
        bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=dtype_grads) for t in (q, k, v)]
    ok, why = supports_backward(q, k, v, dout=dout, out=out, lse=lse, dq=bufs[0], dk=bufs[1], dv=bufs[2],
                                cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"),
                                accumulate=accumulate)
    assert ok, why
    backward(dout, q, k, v, out, lse, *bufs, deterministic=deterministic, accumulate=accumulate, **kw)
    torch.cuda.synchronize()
    return bufs


def _assert_same_grads(want, got, deterministic, what):
    """Two backwards of one problem in forms that only move work: every gradient written, dK / dV bytes equal, and
    dQ's too when deterministic (otherwise its fp32 atomic adds ran in another order: rounding apart)."""
    for name, a, c in zip(("dq", "dk", "dv"), want, got):
        assert not torch.isnan(c).any(), f"{name}: NaN (unwritten) with {what}"
        if name != "dq" or deterministic:
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), f"{name} differs with {what}"
        else:
            assert rel_error(c.double(), a.double()) < 1e-2, f"{name} differs with {what}"


def _check(got, want, dtype, name):
    got = got.double()
    assert not torch.isnan(got).any(), f"{name}: NaN (unwritten or invalid)"
    if want.norm() == 0:
        assert got.abs().max() == 0, f"{name}: expected exact zeros"
        return
    err = rel_error(got.cpu(), want.cpu())
    assert err < 2 * REL_TOL[dtype], f"{name}: rel error {err:.2e}"


def _case(shape_q, shape_k, dtype, *, causal, q_offset=0, k_offset=0, out_fp32=False, dout_fp32=False,
          deterministic=False, **kw):
    g = _gen()
    q, k, v = _inputs(shape_q, shape_k, dtype, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32 if dout_fp32 else dtype, generator=g)
    mask = dict(causal=causal, q_offset=q_offset, k_offset=k_offset, **kw)
    out64, lse64, ref = _reference(q, k, v, dout, **mask)
    out = out64.float() if out_fp32 else out64.to(dtype)
    lse = lse64.float()
    scale = q.shape[-1] ** -0.5
    got = _run(q, k, v, dout, out, lse, softmax_scale=scale, deterministic=deterministic, **mask)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        _check(a, b, dtype, name)
    return q, k, v, dout, out, lse, ref, mask


DENSE = [
    # (batch, sq, sk, hq, hkv, d, causal, q_offset, k_offset)
    (2, 1000, 1000, 4, 4, 128, True, 0, 0),  # aligned causal, partial tiles
    (2, 777, 640, 4, 2, 128, False, 0, 0),  # full, GQA 2
    (1, 257, 513, 8, 1, 64, True, 256, 0),  # shifted: bottom rows see every key; GQA 8
    (1, 300, 300, 8, 2, 128, True, 0, 100),  # first 100 queries see nothing
    (2, 128, 384, 8, 8, 64, True, 128, 0),  # partly visible rectangle
    (1, 64, 64, 4, 4, 128, True, 0, 500),  # nothing visible at all
    (1, 200, 900, 2, 2, 128, True, 10_000, 0),  # fully visible (no mask tiles)
    (2, 1000, 1000, 6, 2, 96, True, 0, 0),  # hdim 96: causal, partial tiles, GQA 3
    (1, 777, 640, 4, 4, 96, False, 0, 0),  # hdim 96: full
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", DENSE, ids=[f"case{i}" for i in range(len(DENSE))])
def test_dense(case, dtype):
    b, sq, sk, hq, hkv, d, causal, qo, ko = case
    _case((b, sq, hq, d), (b, sk, hkv, d), dtype, causal=causal, q_offset=qo, k_offset=ko)


def test_fp32_out_and_dout_and_fp32_grads():
    g = _gen()
    q, k, v = _inputs((2, 333, 4, 128), (2, 333, 2, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32, generator=g)
    out64, lse64, ref = _reference(q, k, v, dout, causal=True)
    got = _run(q, k, v, dout, out64.float(), lse64.float(), dtype_grads=torch.float32, causal=True)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        _check(a, r, torch.bfloat16, name)


@pytest.mark.parametrize("causal", [True, False])
def test_accumulate(causal):
    g = _gen()
    q, k, v = _inputs((2, 513, 4, 128), (2, 700, 2, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = dict(causal=causal, q_offset=300, k_offset=0)
    out64, lse64, ref = _reference(q, k, v, dout, **mask)
    init = [torch.randn(t.shape, device="cuda", dtype=torch.float32, generator=g) for t in (q, k, v)]
    got = _run(q, k, v, dout, out64.to(torch.bfloat16), lse64.float(), accumulate=True, init=init, **mask)
    for name, a, b, r in zip(("dq", "dk", "dv"), got, init, ref):
        _check(a - b, r, torch.bfloat16, name)


def _packed(lens_q, lens_k, hq, hkv, d, dtype, *, causal, q_offset=0, k_offset=0):
    g = _gen()
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = _inputs((sum(lens_q), hq, d), (sum(lens_k), hkv, d), dtype, g)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)
    mask = dict(causal=causal, q_offset=q_offset, k_offset=k_offset, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out64, lse64, ref = _reference(q, k, v, dout, **mask)
    kw = dict(mask, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    got = _run(q, k, v, dout, out64.to(dtype), lse64.float(), **kw)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        _check(a, r, dtype, name)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d,dtype,hq,hkv", [(128, torch.bfloat16, 4, 2), (64, torch.float16, 8, 8),
                                            (96, torch.bfloat16, 4, 1)])
def test_packed_random(causal, d, dtype, hq, hkv):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    cu = random_cu_seqlens(6, 400, gen, allow_empty=True)
    lens = (cu[1:] - cu[:-1]).tolist()
    lens[1] = 0  # at least one empty document
    _packed(lens, lens, hq, hkv, d, dtype, causal=causal)


@pytest.mark.parametrize("packed", [False, True])
def test_more_sequences_than_a_grid_dimension_holds(packed):
    """70000 sequences of 8 tokens: the pre- and postprocess launched one CTA per (tile, head, sequence) with the
    sequences on the grid's z, which stops at 65535 (CUDA refused the launch). They share x with the tiles now."""
    n, s, dtype = 70000, 8, torch.bfloat16
    g = _gen()
    q, k, v = _inputs((n, s, 2, 64), (n, s, 1, 64), dtype, g)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)
    out64, lse64, ref = _reference(q, k, v, dout, causal=True)  # (the batch's reference: packed is the same)
    kw = dict(causal=True)
    if packed:  # the same sequences as 70000 documents of one packed call
        cu = torch.arange(0, n * s + 1, s, dtype=torch.int32, device="cuda")
        q, k, v, dout, out64 = (t.flatten(0, 1) for t in (q, k, v, dout, out64))
        lse64 = lse64.transpose(0, 1).flatten(1)  # (heads, tokens)
        ref = [t.flatten(0, 1) for t in ref]
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out, lse = attention_forward(q, k, v, backend="cute", **kw)
    assert rel_error(out.double().cpu(), out64.cpu()) < REL_TOL[dtype]
    extra = dict(max_seqlen_q=s, max_seqlen_k=s) if packed else {}
    got = _run(q, k, v, dout, out64.to(dtype), lse64.float(), **kw, **extra)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        _check(a, r, dtype, name)


def test_packed_per_segment_offsets():
    lens_q, lens_k = [100, 0, 257, 64], [300, 50, 129, 64]
    q_off = torch.tensor([200, 0, 0, 5], dtype=torch.int32, device="cuda")
    k_off = torch.tensor([0, 0, 128, 100], dtype=torch.int32, device="cuda")  # last: nothing visible
    _packed(lens_q, lens_k, 8, 2, 128, torch.bfloat16, causal=True, q_offset=q_off, k_offset=k_off)


@pytest.mark.parametrize("d", [128, 96])
@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_matches_reference(causal, d):
    _case((1, 700, 4, d), (1, 900, 2, d), torch.bfloat16, causal=causal, q_offset=200, deterministic=True)


@pytest.mark.parametrize("d", [128, 96])
@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_bitwise(causal, d):
    """Many CTAs contending for every dQ tile: the fp32 gradients' bytes must match over repeated runs."""
    g = _gen()
    b, s, h = 2, 8192, 16
    q, k, v = _inputs((b, s, h, d), (b, s, h, d), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=causal, backend="sdpa_flash")
    runs = []
    for _ in range(3):
        grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=torch.float32) for t in (q, k, v)]
        backward(dout, q, k, v, out, lse, *grads, softmax_scale=d**-0.5, causal=causal, deterministic=True)
        runs.append(grads)
    torch.cuda.synchronize()
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert not torch.isnan(a).any()
            assert torch.equal(a.view(torch.int32), c.view(torch.int32))
    # and the non-deterministic mode agrees with it to rounding
    nd = [torch.empty_like(t) for t in (q, k, v)]
    backward(dout, q, k, v, out, lse, *nd, softmax_scale=d**-0.5, causal=causal, deterministic=False)
    for a, c in zip(runs[0], nd):
        assert rel_error(a.double(), c.double()) < 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_chunked_launch_order(causal):
    """det_chunk=8 (opt-in launch order for deterministic mode): same results, bitwise stable."""
    g = _gen()
    b, s, h, d = 2, 4096, 8, 128
    q, k, v = _inputs((b, s, h, d), (b, s, h // 2, d), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=causal, backend="sdpa")
    runs = []
    for chunk in (8, 8, 0):  # (without chunks non-causal calls default to the rotated order: ask for ascending)
        grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=torch.float32) for t in (q, k, v)]
        backward(dout, q, k, v, out, lse, *grads, causal=causal, deterministic=True, det_chunk=chunk,
                 det_resident=False)
        runs.append(grads)
    torch.cuda.synchronize()
    for a, c in zip(runs[0], runs[1]):
        assert not torch.isnan(a).any()
        assert torch.equal(a.view(torch.int32), c.view(torch.int32))
    for a, c in zip(runs[0], runs[2]):  # same fixed order of additions as the default launch order
        assert torch.equal(a.view(torch.int32), c.view(torch.int32))




ROTATED = {
    # name: (q and k lengths per sequence (a dense batch when equal), hq, hkv, d)
    "dense-gqa2": ([4096, 4096], [4096, 4096], 8, 4, 128),
    "dense-d64": ([3000], [3000], 4, 4, 64),
    # packed: a sequence with more key tiles than query tiles (the ascending order), one cut mid-tile, an empty one
    "packed": ([700, 64, 0, 1500], [900, 1000, 50, 1300], 4, 2, 128),
}


@pytest.mark.parametrize("case", list(ROTATED), ids=list(ROTATED))
def test_rotated_deterministic_order(case):
    """det_resident (non-causal, deterministic): each key tile's query tiles in a rotated order and the dQ adds in
    the order the key tiles reach a query tile. The same bytes run to run, the oracle's values, and the ascending
    order's to fp32 rounding."""
    lens_q, lens_k, hq, hkv, d = ROTATED[case]
    g = _gen()
    dense = len(set(lens_q)) == 1 and lens_q == lens_k
    if dense:
        shape_q, shape_k = (len(lens_q), lens_q[0], hq, d), (len(lens_k), lens_k[0], hkv, d)
        kw = {}
    else:
        shape_q, shape_k = (sum(lens_q), hq, d), (sum(lens_k), hkv, d)
        cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    q, k, v = _inputs(shape_q, shape_k, torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out64, lse64, ref = _reference(q, k, v, dout, causal=False, **kw)
    out, lse = out64.to(torch.bfloat16), lse64.float()
    if not dense:
        kw.update(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))

    def launch(rotate):
        grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=torch.float32) for t in (q, k, v)]
        backward(dout, q, k, v, out, lse, *grads, causal=False, deterministic=True, det_resident=rotate, **kw)
        torch.cuda.synchronize()
        return grads

    first, again, ascending = launch(True), launch(True), launch(False)
    for name, a, b, c, r in zip(("dq", "dk", "dv"), first, again, ascending, ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{name}: bytes differ run to run"
        _check(a, r, torch.bfloat16, name)
        assert rel_error(a.double(), c.double()) < 1e-5, f"{name}: rotated and ascending orders apart"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_longest_first_causal_deterministic_order(packed):
    """det_resident on a causal deterministic backward launches each sequence's key tiles longest first (they all
    fit on the GPU at once) and keeps the dQ order: the bytes of the shortest-first launch."""
    g = _gen()
    if packed:
        lens = [1500, 700, 2048, 64]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v = _inputs((sum(lens), 8, 128), (sum(lens), 4, 128), torch.bfloat16, g)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        fwd_kw = dict(kw)
        kw.update(max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        q, k, v = _inputs((2, 4096, 8, 128), (2, 4096, 4, 128), torch.bfloat16, g)
        kw, fwd_kw = {}, {}
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", **fwd_kw)
    out = out.to(torch.bfloat16)
    runs = []
    for resident in (False, True, True):
        grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=torch.float32) for t in (q, k, v)]
        backward(dout, q, k, v, out, lse, *grads, causal=True, deterministic=True, det_resident=resident, **kw)
        runs.append(grads)
    torch.cuda.synchronize()
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert not torch.isnan(b).any(), f"{name}: NaN (unwritten)"
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{name}: bytes differ"


PERSISTENT = {
    # name: (batch, sq, sk, hq, hkv, d, causal, mask options)
    "causal": (2, 1000, 1000, 4, 4, 128, True, {}),
    "full-gqa2": (2, 777, 640, 4, 2, 128, False, {}),
    "d64-shifted-gqa8": (1, 257, 513, 8, 1, 64, True, {"q_offset": 256}),
    "window-softcap": (2, 900, 900, 4, 2, 128, True, {"window_left": 200, "softcap": 30.0}),
    "d64-window": (2, 1100, 1100, 4, 4, 64, True, {"window_left": 300}),
}
# (case, form): every case as a fresh 16-bit backward; two of them also accumulated into fp32 and packed
PERSISTENT_RUNS = [(c, "fresh") for c in PERSISTENT] + [(c, f) for c in ("causal", "d64-shifted-gqa8")
                                                        for f in ("accumulate", "packed")]
PERSISTENT_TEST_CTAS = 5  # every CTA walks many tiles (bench/cute_session_dev.py compiles these variants)


def persistent_case(name, form, deterministic, g):
    """(dout, q, k, v, out, lse) and the keyword arguments of one PERSISTENT_RUNS backward call (dq, dk, dv
    aside)."""
    b, sq, sk, hq, hkv, d, causal, options = PERSISTENT[name]
    q, k, v = _inputs((b, sq, hq, d), (b, sk, hkv, d), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = dict(causal=causal, **options)
    contract = {key: val for key, val in mask.items() if key != "window_left"}  # the contract's window is a pair
    if "window_left" in mask:
        contract["window"] = (mask["window_left"], -1)
    out, lse = attention_forward(q, k, v, backend="reference", **contract)
    out = out.to(torch.bfloat16)
    kw = dict(mask, deterministic=deterministic, accumulate=form == "accumulate")
    if deterministic and not causal:
        # the ascending order on both grids: the rotated one (the default for fresh non-causal gradients) is taken
        # only for sequences of at most half the grid's CTAs in key tiles, fewer than these on PERSISTENT_TEST_CTAS
        kw["det_resident"] = False
    if form == "packed":
        cu_q = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * sq
        cu_k = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * sk
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
        lse = lse.permute(1, 0, 2).reshape(hq, b * sq).contiguous()
        q, k, v, dout, out = (t.flatten(0, 1) for t in (q, k, v, dout, out))
    return (dout, q, k, v, out, lse), kw


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
@pytest.mark.parametrize("run", PERSISTENT_RUNS, ids=[f"{c}-{f}" for c, f in PERSISTENT_RUNS])
def test_persistent_grid_gives_the_bits_of_one_cta_per_tile(run, deterministic):
    """A persistent grid (each CTA claims several key tiles, its pipelines running on from one tile into the next)
    writes the dK / dV bytes of one CTA per tile, and in deterministic mode the dQ bytes too (the tickets fix the
    order of the dQ adds whichever CTA computes a tile); otherwise dQ agrees to the rounding of its fp32 adds."""
    name, form = run
    args, kw = persistent_case(name, form, deterministic, _gen())
    q, k, v = args[1:4]
    init = [torch.randn(t.shape, device="cuda", dtype=torch.float32) for t in (q, k, v)]

    def launch(ctas):
        if form == "accumulate":
            grads = [t.clone() for t in init]
        else:
            grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for t in (q, k, v)]
        backward(*args, *grads, persistent_ctas=ctas, **kw)
        torch.cuda.synchronize()
        return grads

    want, got = launch(0), launch(PERSISTENT_TEST_CTAS)
    for gname, a, c in zip(("dq", "dk", "dv"), want, got):
        assert not torch.isnan(c).any(), f"{gname}: NaN (unwritten) on the persistent grid"
        if gname != "dq" or deterministic:
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), f"{gname} differs on the persistent grid"
        else:  # fp32 atomic adds in another order: rounding apart
            tol = 1e-5 if c.dtype == torch.float32 else 1e-2
            assert rel_error(c.double(), a.double()) < tol, f"{gname} differs on the persistent grid"


@pytest.mark.parametrize("knob", ["early_vectors", "try_waits", "hoist_descriptors", "interleave_lengths",
                                  "lpt_over_heads"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_step_forms_give_the_same_bits(causal, deterministic, knob):
    """Forms of the step that only move work (early_vectors: a step's lse2 / dPsum read while its first GEMMs run;
    try_waits: the Q / dO waits tried before they block, P^T / dS^T converted with inline cvts; hoist_descriptors:
    the smem descriptor bases computed once per CTA, not per step; interleave_lengths: long and short causal key
    tiles alternating in the launch order, non-deterministic only, and lpt_over_heads: every head's longest key
    tile first, deterministic its shortest): dK / dV bytes equal to the kernel without them,
    and dQ too when deterministic. A sequence long enough for the 132-CTA grid to hold many key tiles, 1000 tokens
    (the persistent grid), GQA 2."""
    g = _gen()
    q, k, v = _inputs((2, 1000, 4, 128), (2, 1000, 2, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=causal, backend="sdpa_flash")

    def launch(on):
        return _run(q, k, v, dout, out, lse, softmax_scale=128**-0.5, causal=causal, deterministic=deterministic,
                    **{knob: on})

    _assert_same_grads(launch(False), launch(True), deterministic, knob)


@pytest.mark.parametrize("group", [0, 3])
def test_grouped_over_heads_order_gives_the_same_bits(group):
    """lpt_over_heads within groups of (batch, kv head) pairs (lpt_group; 3 of 4 pairs: a smaller last group), the
    default of many-wave causal launches: dK / dV bytes equal to the head-major order's, dQ rounding apart."""
    g = _gen()
    q, k, v = _inputs((2, 1000, 4, 128), (2, 1000, 2, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=True, backend="sdpa_flash")

    def launch(**order):
        return _run(q, k, v, dout, out, lse, softmax_scale=128**-0.5, causal=True, interleave_lengths=False, **order)

    _assert_same_grads(launch(lpt_over_heads=False), launch(lpt_over_heads=True, lpt_group=group), False,
                       f"lpt_group={group}")


@pytest.mark.parametrize("seqlen", [1000, 4096], ids=["persistent", "per-tile"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ticket_forms_give_the_same_bits(causal, seqlen):
    """The deterministic dQ tickets' other forms (the poll spinning instead of sleeping; an explicit fence before
    red.release): dq, dk and dv bytes equal to the default form's, and run to run."""
    g = _gen()
    q, k, v = _inputs((1, seqlen, 4, 128), (1, seqlen, 2, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=causal, backend="sdpa_flash")

    def launch(**forms):
        return _run(q, k, v, dout, out, lse, softmax_scale=128**-0.5, causal=causal, deterministic=True, **forms)

    want = launch()
    spin, fenced = dict(ticket_sleep_ns=0), dict(release_fence=True)
    for forms in (spin, spin, fenced):
        _assert_same_grads(want, launch(**forms), True, forms)


@pytest.mark.parametrize("options", [{}, {"window_left": 300}], ids=["causal", "window"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("packed", [False, True])
def test_clean_tiles_give_the_same_bits(packed, d, options):
    """Masked steps on query tiles the preprocess found clean skip the sanitizer (clean_tiles, the default): dq, dk
    and dv bytes equal to the form that sanitizes every masked step (deterministic, so dQ's order is fixed too),
    with one q row of one head NaN so that its tile (and only it) still takes the sanitizer."""
    g = _gen()
    q, k, v, kw, fwd_kw = _causal_case(g, packed, d, heads_kv=2)
    kw.update(options)
    if options:
        fwd_kw.update(window=(options["window_left"], 0))
    q[..., 37, 1, :] = float("nan")  # row 37 of head 1 (of every batch): its tile is not clean
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)

    def launch(**forms):
        bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=t.dtype) for t in (q, k, v)]
        backward(dout, q, k, v, out, lse, *bufs, deterministic=True, **kw, **forms)
        torch.cuda.synchronize()
        return bufs

    want = launch(clean_tiles=False)
    for got in (launch(), launch()):
        for name, a, c in zip(("dq", "dk", "dv"), want, got):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), f"{name} differs with clean_tiles"
    assert torch.isfinite(want[1]).any() and torch.isnan(want[0]).any()  # the NaN row reached its own dq only


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_shared_queries_equal_per_call_backward(deterministic, packed):
    """Backward work lists on the same queries with a shared query side (worklist.share_queries: one preprocess,
    one dQ convert) against the same lists call by call: dK / dV are the same launches (bytes equal), dQ differs
    only by the rounding of one fp32 sum instead of per-call sums. Items not on whole query tiles (rows 100..400)
    take the per-call path inside the shared run. Deterministic: shared runs are bitwise reproducible."""
    from fa4dist.kernels.worklist import WorkItem, attention_backward_items, share_queries

    torch.manual_seed(5)
    s, h, hkv, d = 1000, 4, 2, 128
    shape = (s, h, d) if packed else (1, s, h, d)
    kv_shape = (s, hkv, d) if packed else (1, s, hkv, d)
    q, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    items = [WorkItem(0, 512, 0, 512, causal=True), WorkItem(512, 488, 0, 1000, 512, 0, causal=True),
             WorkItem(100, 300, 600, 300, 100, 0, causal=False), WorkItem(0, 512, 512, 488, 0, 512, causal=False),
             WorkItem(512, 488, 0, 512, 512, 0, causal=True, window=(255, -1))]
    out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    lse_shape = (h, s) if packed else (1, h, s)
    lse = torch.randn(lse_shape, device="cuda", dtype=torch.float32) + 8

    def run(share):
        grads = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v)]
        shared = share_queries(dout, q, out, lse, deterministic=deterministic) if share else None
        assert (shared is not None) == share
        attention_backward_items(dout, q, k, v, out, lse, items[:3], *grads, deterministic=deterministic,
                                 shared=shared)
        attention_backward_items(dout, q, k, v, out, lse, items[3:], *grads, deterministic=deterministic,
                                 shared=shared)
        if shared is not None:
            shared.finish(grads[0])
        return grads

    plain, shared = run(False), run(True)
    assert torch.equal(plain[1], shared[1]) and torch.equal(plain[2], shared[2])
    assert rel_error(shared[0], plain[0]) < 1e-6
    if deterministic:
        again = run(True)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(shared, again))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_one_gradient_variants_equal_the_full_backward(packed, d):
    """accumulate with dq only, or dk and dv only (the cp_invariant engine's passes): the kernel variant without
    the other GEMMs adds the same bytes as the full deterministic backward, and leaves no trace of the others."""
    g = _gen()
    q, k, v, kw, fwd_kw = _causal_case(g, packed, d, heads_kv=2)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)
    init = [torch.randn(t.shape, device="cuda", dtype=torch.float32, generator=g) for t in (q, k, v)]
    full = _run(q, k, v, dout, out, lse, accumulate=True, init=init, deterministic=True, **kw)
    dq = init[0].clone()
    backward(dout, q, k, v, out, lse, dq, None, None, deterministic=True, accumulate=True, **kw)
    dk, dv = init[1].clone(), init[2].clone()
    backward(dout, q, k, v, out, lse, None, dk, dv, deterministic=True, accumulate=True, **kw)
    torch.cuda.synchronize()
    for got, want in ((dq, full[0]), (dk, full[1]), (dv, full[2])):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("packed,d,options", [(False, 64, {}), (False, 128, {}), (True, 64, {}), (True, 128, {}),
                                               (True, 96, {}),
                                               (False, 128, {"softcap": 30.0, "window_left": 700})],
                         ids=["dense-d64", "dense-d128", "packed-d64", "packed-d128", "packed-d96",
                              "dense-d128-softcap-window"])
def test_fixed_point_dq(packed, d, options):
    """The int64 fixed-point dQ (dq_scale=, cp_invariant's one pass): its dq is the fp32 dq's value to fp32
    accuracy; keys split over launches on 128-key tile boundaries give the same int64 bytes as one launch, in any
    launch order; its dk/dv are the bytes of the deterministic dk/dv-only variant; reruns repeat the bytes."""
    from fa4dist.kernels import fixed_point

    g = _gen()
    q, k, v, kw, fwd_kw = _causal_case(g, packed, d, heads_kv=4)
    kw.update(options)
    if options:  # the contract's window=(left, 0) is the kernels' window_left on the causal diagonal
        fwd_kw.update(softcap=options["softcap"], window=(options["window_left"], 0))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), d ** -0.5)
    zeros = [torch.zeros(t.shape, device="cuda", dtype=torch.float32) for t in (q, k, v)]
    want = _run(q, k, v, dout, out, lse, accumulate=True, init=zeros, deterministic=True, **kw)

    def fixed_run():
        dq = torch.full(q.shape, 0, dtype=torch.int64, device="cuda")
        dk, dv = (torch.zeros(t.shape, device="cuda", dtype=torch.float32) for t in (k, v))
        backward(dout, q, k, v, out, lse, dq, dk, dv, accumulate=True, dq_scale=scale, deterministic=True, **kw)
        torch.cuda.synchronize()
        return dq, dk, dv

    dq_int, dk, dv = fixed_run()
    assert int(dq_int.abs().max()) < 2**62
    got = fixed_point.from_fixed(dq_int, scale)
    assert torch.isfinite(got).all()
    # the same sums converted by the convert kernel into an fp32 dq of zeros: from_fixed's bits
    dq_float = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    backward(dout, q, k, v, out, lse, dq_float, *(torch.zeros(t.shape, device="cuda", dtype=torch.float32)
                                                  for t in (k, v)),
             accumulate=True, dq_scale=scale, deterministic=True, **kw)
    torch.cuda.synchronize()
    assert torch.equal(dq_float.view(torch.int32), got.view(torch.int32))
    # the written form (accumulate=False, one device's calls) into poisoned buffers: dq is those sums rounded to
    # the buffer's dtype once, dk / dv the bytes added into zeros (then rounded, for bf16 buffers)
    for dtype in (torch.bfloat16, torch.float32):
        written = [torch.full(t.shape, float("nan"), dtype=dtype, device="cuda") for t in (q, k, v)]
        backward(dout, q, k, v, out, lse, *written, dq_scale=scale, deterministic=True, **kw)
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), written, (got, dk, dv)):
            assert torch.equal(a.view(torch.uint8), b.to(dtype).view(torch.uint8)), (name, dtype)
    # same bf16 dS, same fp32 tile products: only the sum's rounding differs (fp32 order vs exact)
    assert rel_error(got, want[0]) < 1e-5
    dk_only, dv_only = (torch.zeros(t.shape, device="cuda", dtype=torch.float32) for t in (k, v))
    backward(dout, q, k, v, out, lse, None, dk_only, dv_only, accumulate=True, deterministic=True, **kw)
    torch.cuda.synchronize()
    for a, b in ((dk, dk_only), (dv, dv_only)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    again = fixed_run()
    for a, b in zip((dq_int, dk, dv), again):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    if not packed:
        # keys [640, 1700) then [0, 640): the same integers
        split = torch.zeros_like(dq_int)
        for lo, hi in ((640, 1700), (0, 640)):
            dk_s, dv_s = (torch.zeros(t[:, lo:hi].shape, device="cuda", dtype=torch.float32) for t in (k, v))
            backward(dout, q, k[:, lo:hi], v[:, lo:hi], out, lse, split, dk_s, dv_s, accumulate=True,
                     dq_scale=scale, causal=True, q_offset=200, k_offset=lo, **options)
        torch.cuda.synchronize()
        assert torch.equal(split, dq_int)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("case", ["dense", "dense-full", "packed"])
def test_fixed_point_dq_forms_give_the_same_bits(case, d):
    """fixed_scales_early (the rows' scales loaded at the start of the step) only moves work: the int64 dq and the
    dk / dv bytes equal the kernel's without it, rerun after rerun. Dense 1700 keys, causal or not; packed segments
    of 300 / 700 / 777 keys."""
    from fa4dist.kernels import fixed_point

    g = _gen()
    q, k, v, kw, fwd_kw = _causal_case(g, case == "packed", d, heads_kv=4)
    if case == "dense-full":
        kw, fwd_kw = dict(causal=False), dict(causal=False)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), d ** -0.5)

    def run(**forms):
        dq = torch.zeros(q.shape, dtype=torch.int64, device="cuda")
        dk, dv = (torch.zeros(t.shape, device="cuda", dtype=torch.float32) for t in (k, v))
        backward(dout, q, k, v, out, lse, dq, dk, dv, accumulate=True, dq_scale=scale, deterministic=True, **kw,
                 **forms)
        torch.cuda.synchronize()
        return dq, dk, dv

    want = run(fixed_scales_early=False)
    for forms in ({}, {}):
        for name, a, b in zip(("dq", "dk", "dv"), want, run(**forms)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (name, forms)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_deterministic_gqa_backward_on_expanded_heads(packed, d):
    """det_dq="expanded": K / V copied per query head, the ticketed backward, each group's dK / dV summed in head
    order. dq is the GQA ticketed backward's bytes (the same tiles added in the same order), dk / dv its values to
    fp32 rounding (another association of the group's sum); reruns give the same bytes, fresh and accumulating."""
    g = _gen()
    total = 4096 + 300
    if packed:
        cu = torch.tensor([0, 1000, 1001, total], dtype=torch.int32, device="cuda")
        q, k, v = _inputs((total, 8, d), (total, 2, d), torch.bfloat16, g)
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total - 1001, max_seqlen_k=total - 1001)
        fwd_kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = _inputs((1, total, 8, d), (1, total, 2, d), torch.bfloat16, g)
        kw = fwd_kw = dict(causal=True)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)
    init = [torch.randn(t.shape, device="cuda", dtype=torch.float32, generator=g) for t in (q, k, v)]
    for accumulate in (False, True):
        extra = dict(accumulate=True, init=init) if accumulate else {}
        runs = [_run(q, k, v, dout, out, lse, deterministic=True, det_dq="expanded", **extra, **kw) for _ in range(2)]
        tickets = _run(q, k, v, dout, out, lse, deterministic=True, det_dq="tickets", **extra, **kw)
        _assert_same_grads(runs[0], runs[1], True, f"expanded rerun, accumulate={accumulate}")
        assert torch.equal(runs[0][0].view(torch.uint8), tickets[0].view(torch.uint8)), "dq"
        for name, a, b in zip(("dk", "dv"), runs[0][1:], tickets[1:]):
            assert rel_error(a.double(), b.double()) < (1e-2 if not accumulate else 1e-5), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_nondeterministic_gqa_backward_of_few_kv_tiles_on_expanded_heads(packed, causal):
    """A non-deterministic GQA backward whose (key tile, kv head) CTAs would leave most SMs idle runs on K / V
    expanded per query head (backward.nondeterministic_gqa_form, gqa_form="auto"): every gradient written, dk / dv
    the explicit expanded form's bytes (per-head sums in registers, then the group's in head order), and all three
    the GQA kernel's values to fp32 rounding, fresh and accumulating."""
    g = _gen()
    total = 2048 + 100
    if packed:
        cu = torch.tensor([0, 700, total], dtype=torch.int32, device="cuda")
        q, k, v = _inputs((total, 8, 128), (total, 1, 128), torch.bfloat16, g)
        kw = dict(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total - 700,
                  max_seqlen_k=total - 700)
        fwd_kw = dict(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = _inputs((1, total, 8, 128), (1, total, 1, 128), torch.bfloat16, g)
        kw = fwd_kw = dict(causal=causal)
    from fa4dist.kernels.cute import backward as cbwd
    from fa4dist.kernels.cute import host as chost

    tiles = cbwd._kv_tiles(k, kw.get("cu_seqlens_k"))
    assert cbwd.nondeterministic_gqa_form(8, tiles, chost.sm_count()) == "expanded"
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)
    init = [torch.randn(t.shape, device="cuda", dtype=torch.float32, generator=g) for t in (q, k, v)]
    for accumulate in (False, True):
        extra = dict(accumulate=True, init=init) if accumulate else {}
        auto = _run(q, k, v, dout, out, lse, **extra, **kw)
        expanded = _run(q, k, v, dout, out, lse, gqa_form="expanded", **extra, **kw)
        gqa = _run(q, k, v, dout, out, lse, gqa_form="gqa", **extra, **kw)
        _assert_same_grads(expanded, auto, False, f"gqa_form auto against expanded, accumulate={accumulate}")
        for name, a, b in zip(("dq", "dk", "dv"), auto, gqa):
            assert rel_error(a.double(), b.double()) < (1e-2 if not accumulate else 1e-5), name


SPLIT_KEYS_CASES = [
    # (b, sq, sk, h, hk, d, q_offset): dense causal backwards of one wave or less on 132 SMs (q_offset None:
    # non-causal, with a partial last wave)
    (1, 4096, 4096, 5, 5, 128, None),  # 160 key tiles: the 28 after the first wave in quarters
    (2, 1500, 1600, 6, 6, 96, None),  # padding rows, a cut last key tile
    (1, 3000, 3100, 9, 3, 64, None),  # GQA (on the expanded heads or the GQA kernel, as the call takes it)
    (1, 4096, 4096, 4, 4, 128, 0),  # 128 key tiles: the longest of every head in parts
    (1, 4000, 4050, 2, 2, 128, 0),  # padding rows, the last key tile cut, keys past the queries' reach
    (1, 4096, 4096, 3, 3, 64, 0),  # 128-row query tiles
    (1, 3072, 4096, 3, 3, 128, 1024),  # bottom-right diagonal
    (2, 3000, 3000, 2, 2, 96, -200),  # the first 200 queries see no key
    (1, 4096, 4096, 4, 1, 128, 0),  # MQA (on the expanded heads or the GQA kernel, as the call takes it)
    (2, 3000, 3000, 2, 2, 128, (0, -700)),  # one offset per sequence (the plan takes diagonal 0)
]


@pytest.mark.parametrize("case", SPLIT_KEYS_CASES, ids=[str(c) for c in SPLIT_KEYS_CASES])
def test_split_key_tiles(case):
    """A backward of few waves runs the key tiles that make its tail as parts over their query tiles (causal the
    longest, claimed first; non-causal the last partial wave's, claimed last: backward.split_keys_variant,
    dense_split_keys_plan), the last part to arrive summing their dK / dV in part order: every gradient against
    the fp64 oracle (buffers poisoned), dK / dV the same bytes run to run and the unsplit launch's bytes outside
    the split key tiles, dQ the unsplit one's to fp32 rounding, and NaN in a V row NaN in the same gradients'
    elements as unsplit."""
    from fa4dist.kernels.cute import backward as cbwd

    b, sq, sk, h, hk, d, q_off = case
    causal = q_off is not None
    plan_diag = q_off if isinstance(q_off, int) else 0
    if isinstance(q_off, tuple):  # per sequence: a tensor for the kernel
        q_off = torch.tensor(q_off, dtype=torch.int32, device="cuda")
    g = _gen()
    q, k, v = _inputs((b, sq, h, d), (b, sk, hk, d), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = dict(causal=causal, q_offset=0 if q_off is None else q_off)
    out64, lse64, ref = _reference(q, k, v, dout, **mask)
    out, lse = out64.to(torch.bfloat16), lse64.float()
    _, main_cfg, _ = cbwd.make_configs(torch.bfloat16, d, causal=causal, varlen=False, seg_offsets=False,
                                       accumulate=False, deterministic=False, dq_dtype=torch.bfloat16,
                                       dkv_dtype=torch.bfloat16, o_dtype=torch.bfloat16, do_dtype=torch.bfloat16,
                                       max_seqlen_k=sk)
    split_cfg = cbwd.split_keys_variant(main_cfg)
    edge, parts = cbwd.dense_split_keys_plan(split_cfg, q.shape, k.shape, plan_diag)
    if parts == 1 and hk == h:
        pytest.skip("no split on this GPU's SMs")
    got = _run(q, k, v, dout, out, lse, **mask)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        _check(a, r, torch.bfloat16, name)
    again = _run(q, k, v, dout, out, lse, **mask)
    plain = _run(q, k, v, dout, out, lse, split_keys=False, **mask)
    n_k = -(-sk // 128)
    split_keys = torch.zeros(b, n_k * 128, hk, dtype=torch.bool)  # the split key tiles' rows
    if causal:  # the first edge tiles, key tile 0 of every (batch, kv head) first
        split_keys[:, : edge // (b * hk) * 128] = True
    else:  # the tiles from edge on, key tiles fastest within a (batch, kv head)
        for t in range(edge, b * hk * n_k):
            hb, n = divmod(t, n_k)
            split_keys[hb // hk, n * 128:(n + 1) * 128, hb % hk] = True
    split_keys = split_keys[:, :sk].cuda()
    for name, a, r, p in zip(("dk", "dv"), got[1:], again[1:], plain[1:]):
        assert torch.equal(a.view(torch.int16), r.view(torch.int16)), f"{name} differs run to run"
        if hk == h:  # (GQA may run on expanded heads, with their own plan, and sum them)
            assert torch.equal(a[~split_keys].view(torch.int16), p[~split_keys].view(torch.int16)), \
                f"{name} outside the split key tiles differs from the unsplit launch"
        assert rel_error(a.double(), p.double()) < 1e-2, name
    assert rel_error(got[0].double(), plain[0].double()) < 1e-2
    v_bad = v.clone()
    v_bad[:, sk // 2, 0] = float("nan")  # seen by the queries from sk // 2 - q_off on (non-causal: by all)
    nan_got = _run(q, k, v_bad, dout, out, lse, **mask)
    nan_plain = _run(q, k, v_bad, dout, out, lse, split_keys=False, **mask)
    for name, a, p in zip(("dq", "dk", "dv"), nan_got, nan_plain):
        assert torch.equal(torch.isnan(a), torch.isnan(p)), f"{name}: NaN pattern differs from the unsplit launch"


def test_long_causal_deterministic_gqa_backward_takes_expanded_heads():
    """deterministic=True alone (det_dq="auto") on a causal GQA call of 16k keys at hdim 128 is the expanded form's
    bytes (backward.deterministic_gqa_form; test_cute_bwd_compile.py has the rule)."""
    g = _gen()
    q, k, v = _inputs((1, 16384, 4, 128), (1, 16384, 1, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, causal=True, backend="cute")
    auto = _run(q, k, v, dout, out, lse, deterministic=True, causal=True)
    expanded = _run(q, k, v, dout, out, lse, deterministic=True, causal=True, det_dq="expanded")
    _assert_same_grads(expanded, auto, True, "det_dq auto against expanded")


def test_gqa_copies_past_32_bit_indexing_run_the_gqa_kernel():
    """A deterministic causal GQA backward of long keys takes K / V copied per query head: 16k queries against 256k
    keys of 8 heads, 64 query heads, hdim 128 is 2^31 elements of copies, past the kernels' 32-bit indexing, though
    every given tensor is within it. It runs the GQA kernel as it is: the tickets' bytes, near the
    non-deterministic backward's."""
    g = _gen()
    q, k, v = _inputs((1, 16384, 64, 128), (1, 262144, 8, 128), torch.bfloat16, g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = dict(causal=True, q_offset=262144 - 16384)
    out, lse = attention_forward(q, k, v, backend="cute", **kw)
    auto = _run(q, k, v, dout, out, lse, deterministic=True, **kw)
    tickets = _run(q, k, v, dout, out, lse, deterministic=True, det_dq="tickets", **kw)
    _assert_same_grads(tickets, auto, True, "det_dq auto against tickets past 32 bits")
    free = _run(q, k, v, dout, out, lse, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), auto, free):
        assert rel_error(a.double(), b.double()) < 1e-2, name


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_deterministic_gqa_backward_takes_the_fixed_point_dq(packed):
    """A deterministic backward on the int64 dQ (no tickets; `det_dq="fixed"`, measured slower than the other
    forms, twentieth session) converts it once: reruns give the same bytes, dk/dv are the ticketed
    backward's bytes (the same query order), and dq agrees with the ticketed fp32 sum to fp32 accuracy."""
    g = _gen()
    total = 16384 + 300
    if packed:
        cu = torch.tensor([0, 5000, 5001, total], dtype=torch.int32, device="cuda")
        q, k, v = _inputs((total, 8, 64), (total, 2, 64), torch.bfloat16, g)
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total - 5001,
                  max_seqlen_k=total - 5001)
        fwd_kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = _inputs((1, total, 8, 64), (1, total, 2, 64), torch.bfloat16, g)
        kw = fwd_kw = dict(causal=True)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attention_forward(q, k, v, backend="cute", **fwd_kw)
    zeros = [torch.zeros(t.shape, device="cuda", dtype=torch.float32) for t in (q, k, v)]
    fixed = _run(q, k, v, dout, out, lse, accumulate=True, init=zeros, deterministic=True, det_dq="fixed", **kw)
    again = _run(q, k, v, dout, out, lse, accumulate=True, init=zeros, deterministic=True, det_dq="fixed", **kw)
    tickets = _run(q, k, v, dout, out, lse, accumulate=True, init=zeros, deterministic=True, det_dq="tickets",
                   **kw)
    for a, b in zip(fixed, again):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(fixed[1:], tickets[1:]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert rel_error(fixed[0], tickets[0]) < 1e-5
    # a fresh bf16 dq (the convert's TMA store) is the fp32 one rounded
    fresh = _run(q, k, v, dout, out, lse, deterministic=True, det_dq="fixed", **kw)
    assert torch.equal(fresh[0], fixed[0].to(torch.bfloat16))
