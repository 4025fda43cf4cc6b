"""The fixed-point dq (fa4dist/kernels/fixed_point.py) and the canonical key calls of the cp_invariant backward
(fa4dist/kernels/invariant.key_calls), on the CPU with the reference backend."""

import random

import pytest
import torch

from fa4dist.kernels import attention_backward, attention_forward, fixed_point, invariant
from fa4dist.kernels.fixed_point import KEY_TILE
from fa4dist.kernels.mask import Mask


def _problem(seed, seqlen=300, heads=2, d=16, dtype=torch.float32, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, seqlen, heads, d, generator=g, dtype=dtype) for _ in range(4))
    # a few large entries: the bound must hold where the maxima sit far from the typical values
    k[0, 7, 0, 3] *= spread
    v[0, 11, 1, 5] *= spread
    dout[0, seqlen - 1, 0, 0] *= spread
    return q, k, v, dout


def _fixed_dq(q, k, v, dout, out, lse, scale, splits=None, **mask):
    """int64 dq of calls over keys [a, b) for consecutive tile-aligned bounds (one call by default)."""
    dq = torch.zeros(q.shape, dtype=torch.int64)
    bounds = splits or [0, k.shape[1]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        dk, dv = (torch.zeros(t[:, a:b].shape, dtype=invariant.accum_dtype(q.dtype)) for t in (k, v))
        attention_backward(dout, q, k[:, a:b], v[:, a:b], out, lse, dq=dq, dk=dk, dv=dv, accumulate=True,
                           dq_scale=scale, cp_invariant=True, backend="reference", k_offset=a, **mask)
    return dq


@pytest.mark.parametrize("spread", [1.0, 1e4], ids=["plain", "outliers"])
def test_fixed_point_dq_is_exact_up_to_its_resolution(spread):
    q, k, v, dout = _problem(1, spread=spread)
    mask = dict(causal=True, softcap=5.0)
    out, lse = attention_forward(q, k, v, backend="reference", cp_invariant=True, **mask)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    dq_int = _fixed_dq(q, k, v, dout, out, lse, scale, **mask)
    assert int(dq_int.abs().max()) < 2**62  # the bound leaves int64 room
    got = fixed_point.from_fixed(dq_int, scale, torch.float64)
    # the same tile contributions in fp64: the fixed-point sum is off by at most one unit per tile and row
    want = attention_backward(dout.double(), q.double(), k.double(), v.double(), out.double(), lse.double(),
                              backend="reference", cp_invariant=True, **mask)[0]
    fp32_sum = attention_backward(dout, q, k, v, out, lse, backend="reference", cp_invariant=True, **mask)[0]
    err_fixed = (got - want).abs().max().item()
    err_fp32 = (fp32_sum.double() - want).abs().max().item()
    assert err_fixed <= err_fp32 + 1e-6 * want.abs().max().item()


def test_fixed_point_sums_do_not_depend_on_the_split():
    q, k, v, dout = _problem(2, seqlen=5 * KEY_TILE + 17)
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=True)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    one = _fixed_dq(q, k, v, dout, out, lse, scale, causal=True)
    n = k.shape[1]
    for bounds in ([0, KEY_TILE, n], [0, 3 * KEY_TILE, 4 * KEY_TILE, n], [0, 2 * KEY_TILE, 5 * KEY_TILE, n]):
        assert torch.equal(_fixed_dq(q, k, v, dout, out, lse, scale, bounds, causal=True), one)


def test_non_finite_rows_come_out_nan():
    q, k, v, dout = _problem(3)
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=True)
    dout[0, 50, 1, 2] = float("nan")
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    assert torch.isnan(scale[0, 1, 50]) and torch.isfinite(scale[0, 0, 50]) and torch.isfinite(scale[0, 1, 49])
    dq = fixed_point.from_fixed(_fixed_dq(q, k, v, dout, out, lse, scale, causal=True), scale)
    assert torch.isnan(dq[0, 50, 1]).all()
    assert torch.isfinite(dq[0, :50]).all() and torch.isfinite(dq[0, 51:]).all() and torch.isfinite(dq[0, 50, 0]).all()


def test_a_bound_beyond_the_scales_range_gives_nan_not_a_wrapped_integer():
    """Bounds of 2^187 and up (values past fp32's range, fp64 inputs) would overflow int64 at the smallest fp32
    scale: such rows get NaN scales and NaN dq, never a finite wrong number."""
    import fa4dist

    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, 4, 1, 4, dtype=torch.float64, generator=gen) * f for f in (1e-20, 1e20, 1e20, 1e20))
    assert torch.isnan(fixed_point.power_of_two_scale(torch.tensor([2.0**187, float("inf")], dtype=torch.float64))
                       ).all()
    assert fixed_point.power_of_two_scale(torch.tensor([2.0**186], dtype=torch.float64)).item() == 2.0**-126
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fa4dist.attention(*leaves, cp_invariant=True).backward(g)
    assert torch.isnan(leaves[0].grad).all()


def test_a_masked_bad_key_stays_masked():
    """A NaN key reaches only the rows that see it (as in fp32 sums): causal rows before it keep finite scales and
    finite dq, rows after it come out NaN."""
    q, k, v, dout = _problem(6)
    k[0, 250, 1, 4] = float("nan")
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=True)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    assert torch.isfinite(scale[0, 1, :250]).all() and torch.isnan(scale[0, 1, 250:]).all()
    dq = fixed_point.from_fixed(_fixed_dq(q, k, v, dout, out, lse, scale, causal=True), scale)
    assert torch.isfinite(dq[0, :250]).all() and torch.isfinite(dq[0, :, 0]).all()
    assert torch.isnan(dq[0, 250:, 1]).all()


def test_scales_are_powers_of_two_in_lse_layout():
    q, k, v, dout = _problem(4)
    out, _ = attention_forward(q, k, v, causal=True, backend="reference")
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    assert scale.shape == (1, 2, 300) and scale.dtype == torch.float32
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)
    packed = fixed_point.dq_scale(dout[0], out[0], fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    assert torch.equal(packed, scale[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_float_dq_takes_the_converted_sums(dtype):
    """dq_scale with a float dq of zeros (one call over every key, as one device makes it): from_fixed of the
    int64 route's sums, bit for bit."""
    q, k, v, dout = (t.to(dtype) for t in _problem(7, seqlen=3 * KEY_TILE + 5))
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=True)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    want = fixed_point.from_fixed(_fixed_dq(q, k, v, dout, out, lse, scale, causal=True), scale, dtype)
    dq = torch.zeros(q.shape, dtype=dtype)
    dk, dv = (torch.zeros(t.shape, dtype=dtype) for t in (k, v))
    attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, accumulate=True, dq_scale=scale,
                       cp_invariant=True, backend="reference", causal=True)
    assert torch.equal(dq.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("given", [False, True], ids=["returned", "buffers"])
def test_the_written_form_gives_the_accumulating_forms_bits(dtype, given):
    """accumulate=False with dq_scale (one device's calls): dq is the converted sums rounded to q's dtype once, and
    dk / dv are what adding into zeros gives, then rounded; keys past the last query see no row (zero gradients,
    where a written -0 would differ from 0 + -0)."""
    q, k, v, dout = (t.to(dtype) for t in _problem(11, seqlen=2 * KEY_TILE + 9))
    q, dout = q[:, :KEY_TILE + 3], dout[:, :KEY_TILE + 3]
    out, lse = attention_forward(q, k, v, causal=True, backend="reference", cp_invariant=True)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v), 0.25)
    acc = invariant.accum_dtype(dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc) for t in (q, k, v))
    attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, accumulate=True, dq_scale=scale,
                       cp_invariant=True, backend="reference", causal=True)
    want = [t.to(dtype) for t in (dq, dk, dv)]
    bufs = {}
    if given:
        bufs = {name: torch.full(t.shape, float("nan"), dtype=dtype) for name, t in zip(("dq", "dk", "dv"), (q, k, v))}
    got = attention_backward(dout, q, k, v, out, lse, dq_scale=scale, cp_invariant=True, backend="reference",
                             causal=True, **bufs)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(want[1][:, -5:], torch.zeros_like(want[1][:, -5:]))  # the unseen keys


def test_contract_refuses_a_fixed_point_dq_it_cannot_honour():
    q, k, v, dout = _problem(5, seqlen=64)
    out, lse = attention_forward(q, k, v, causal=True, backend="reference")
    scale = torch.ones(lse.shape)
    dq = torch.zeros(q.shape, dtype=torch.int64)
    with pytest.raises(ValueError, match="cp_invariant=True"):
        attention_backward(dout, q, k, v, out, lse, dq=dq, accumulate=True, dq_scale=scale, causal=True)
    with pytest.raises((TypeError, ValueError), match="dq"):
        attention_backward(dout, q, k, v, out, lse, dq=dq.to(torch.bfloat16), accumulate=True, dq_scale=scale,
                           causal=True, cp_invariant=True)
    dk, dv = (torch.zeros(t.shape) for t in (k, v))
    with pytest.raises(ValueError, match="dq buffer"):
        attention_backward(dout, q, k, v, out, lse, dk=dk, dv=dv, accumulate=True, dq_scale=scale, causal=True,
                           cp_invariant=True)
    with pytest.raises((TypeError, ValueError), match="dq_scale"):
        attention_backward(dout, q, k, v, out, lse, dq=dq, accumulate=True, dq_scale=scale[..., :10], causal=True,
                           cp_invariant=True)
    with pytest.raises((TypeError, ValueError), match="dq"):  # int64 sums are added, never written
        attention_backward(dout, q, k, v, out, lse, dq=dq, dq_scale=scale, causal=True, cp_invariant=True)


@pytest.mark.parametrize("seed", range(20))
def test_key_calls_cover_every_key_once_and_every_tile_dq_once(seed):
    rng = random.Random(seed)
    doc_len = rng.randint(1, 6 * KEY_TILE)
    cuts = sorted(rng.sample(range(1, doc_len), min(rng.randint(0, 7), doc_len - 1))) if doc_len > 1 else []
    bounds = [0] + cuts + [doc_len]
    kept = [0] * doc_len
    dq_tiles = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        dest = 1000 + a  # the caller's local rows of these keys
        for call in invariant.key_calls(0, doc_len, 0, doc_len, a, b - a, dest, causal=True):
            it = call.item
            assert it.k_start % KEY_TILE == 0 and it.k_offset == it.k_start  # canonical start
            assert (it.k_start + it.k_len) % KEY_TILE == 0 or it.k_start + it.k_len == doc_len  # canonical end
            assert (it.q_start, it.q_len) == (0, doc_len)
            for j in range(call.keep_len):
                key = it.k_start + call.keep + j
                assert a <= key < b and call.dest + j == 1000 + key
                kept[key] += 1
            if call.dq:
                dq_tiles += range(it.k_start // KEY_TILE, -(-(it.k_start + it.k_len) // KEY_TILE))
                assert a <= it.k_start < b  # a caller adds the dq of the tiles that start in its keys
    assert kept == [1] * doc_len
    assert sorted(dq_tiles) == list(range(-(-doc_len // KEY_TILE)))


def _brute_bounds(t, items, q_rows):
    """Per row and head: 2^E above the largest finite |entry| over the keys the row sees (0 where all are zero), by
    the mask's rule on Python-integer positions, and whether the row sees any key."""
    finite = t.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(-1)  # (..., keys, heads)
    bounds = torch.zeros(*finite.shape[:-2], q_rows, finite.shape[-1], dtype=torch.float64)
    sees = torch.zeros(q_rows, dtype=torch.bool)
    for it in items:
        band = Mask.canonical(it.causal, it.window)
        for i in range(it.q_len):
            p = it.q_offset + i
            seen = [j for j in range(it.k_len) if (band.lo is None or it.k_offset + j - p >= band.lo)
                    and (band.hi is None or it.k_offset + j - p <= band.hi)]
            if not seen:
                continue
            sees[it.q_start + i] = True
            keys = finite[..., [it.k_start + j for j in seen], :].amax(-2)
            exponent = torch.frexp(keys).exponent.double()
            bounds.select(-2, it.q_start + i).copy_(torch.where(keys > 0, torch.ldexp(torch.ones(()), exponent), 0.0))
    return bounds, sees


@pytest.mark.parametrize("seed", range(8))
def test_visible_key_bounds_follow_each_rows_document_and_mask(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    window = rng.choice([(-1, -1), (-1, 0), (5, 0), (7, 3), (-1, 4), (2, 2)])
    causal = rng.random() < 0.5
    if rng.random() < 0.5:  # packed documents, a gap of keys no item covers between two of them, empty ones
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 4))]
        items, start = [], 0
        for n in lengths:
            items.append(invariant.WorkItem(start, n, start, n, 0, 0, causal=causal, window=window))
            start += n + rng.choice([0, 0, 3])
        t = torch.randn(start + 2, 3, 8, generator=g)
    else:  # a dense batch, the queries placed anywhere against the keys (offsets)
        seqlen_k = rng.randint(1, 60)
        seqlen_q = rng.randint(1, seqlen_k)
        items = [invariant.WorkItem(0, seqlen_q, 0, seqlen_k, seqlen_k - seqlen_q + rng.randint(-3, 3), 0,
                                    causal=causal, window=window)]
        t = torch.randn(2, seqlen_k, 3, 8, generator=g)
    t = t * torch.exp(4 * torch.randn(t.shape[:-1], generator=g)).unsqueeze(-1)  # maxima over many binades
    t.view(-1)[::17] = float("nan")
    t.view(-1)[::29] = 0.0
    rows = max(it.q_start + it.q_len for it in items) + 1  # one row no item covers
    (got, got_v), sees = fixed_point.visible_key_bounds((t, t * 3), items, rows)
    want, want_sees = _brute_bounds(t, items, rows)
    assert torch.equal(sees, want_sees)
    assert torch.equal(got, want)
    assert torch.equal(got_v, _brute_bounds(t * 3, items, rows)[0])


def test_visible_key_bounds_at_offsets_and_windows_near_the_limit():
    """Offsets and windows reach 2^62: their sums passed int64 (a causal row 2^61 past its keys saw none, a right
    window of 2^62 missed keys), and an empty last key segment indexed past the keys."""
    t = torch.randn(1, 6, 2, 4)
    cases = [
        invariant.WorkItem(0, 5, 0, 6, 2**61, 0, causal=True),
        invariant.WorkItem(0, 5, 0, 6, 2**61, 0),
        invariant.WorkItem(0, 5, 0, 6, -(2**62), 2**62 - 1, window=(-1, 2**62 - 1)),
        invariant.WorkItem(0, 5, 0, 6, 2**62 - 1, -(2**62), window=(2**62 - 1, -1)),
        invariant.WorkItem(0, 5, 0, 6, 2**62 - 1, -(2**62), causal=True, window=(3, 0)),
        invariant.WorkItem(0, 5, 0, 6, 3, 0, causal=True, window=(1, 0)),
    ]
    for item in cases:
        (got,), sees = fixed_point.visible_key_bounds((t,), [item], 5)
        want, want_sees = _brute_bounds(t, [item], 5)
        assert torch.equal(sees, want_sees), item
        assert torch.equal(got, want), item
    packed = torch.randn(3, 2, 4)
    items = [invariant.WorkItem(0, 2, 0, 3, 0, 0, causal=True), invariant.WorkItem(2, 3, 3, 0, 0, 0, causal=True)]
    (got,), sees = fixed_point.visible_key_bounds((packed,), items, 5)
    assert sees.tolist() == [True, True, False, False, False]
    assert torch.equal(got, _brute_bounds(packed, items, 5)[0])


def check_dq_ignores_keys_it_cannot_see(device="cpu", dtype=torch.float32, head_dim=16, backend="reference"):
    """cp_invariant dq of sequence 0 / document 0 / the first 80 rows: the same bytes with large finite K / V in the
    batch's other sequence, the next document, or the last 16 (causal padding) keys (the GPU test runs it too)."""
    import fa4dist

    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, 96, 2, head_dim, generator=g).to(device, dtype) for _ in range(4))

    def dq_of(q, k, v, dout, **kwargs):
        q = q.clone().requires_grad_(True)
        fa4dist.attention(q, k, v, causal=True, cp_invariant=True, backend=backend, **kwargs).backward(dout)
        return q.grad

    alone = dq_of(q[:1], k[:1], v[:1], dout[:1])
    loud_k, loud_v = k.clone(), v.clone()
    loud_k[1] *= 1e9
    loud_v[1] *= 1e9
    assert torch.equal(dq_of(q, loud_k, loud_v, dout)[:1], alone)  # a batch neighbour
    cu = torch.tensor([0, 96, 192], dtype=torch.int32, device=device)
    packed = [t.flatten(0, 1) for t in (q, loud_k, loud_v, dout)]
    assert torch.equal(dq_of(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu)[:96], alone[0])  # the next document
    padded_k, padded_v = k[:1].clone(), v[:1].clone()
    padded_k[:, 80:] = 1e12  # finite garbage in the last 16 keys, which rows 0..79 never see
    padded_v[:, 80:] = -1e12
    assert torch.equal(dq_of(q[:1], padded_k, padded_v, dout[:1])[:, :80], alone[:, :80])


def test_cp_invariant_dq_ignores_other_sequences_documents_and_padding_it_cannot_see():
    """A row's scale comes from the keys it sees up to its last one: large finite K / V in another sequence of the
    batch, another packed document or causal padding after it leave its dq's bits alone (they once shared one
    bound per head, and 1e9 there truncated every other row's dq to 0)."""
    check_dq_ignores_keys_it_cannot_see()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cp_invariant_keyless_rows_get_zero_dq_whatever_their_output_gradient(bad):
    """A row that sees no key has dq = 0 in every mode (its bound is 0 by the mask, not NaN from its dO)."""
    import fa4dist

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 12, 2, 8, generator=g) for _ in range(4))
    dout[0, :4] = bad  # rows 0..3 see no key: the queries sit before every key
    grads = []
    for invariant_mode in (False, True):
        leaf = q.clone().requires_grad_(True)
        fa4dist.attention(leaf, k, v, causal=True, q_offset=0, k_offset=4, cp_invariant=invariant_mode,
                          backend="reference").backward(dout)
        grads.append(leaf.grad)
    assert torch.equal(grads[1][0, :4], torch.zeros_like(grads[1][0, :4]))
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
