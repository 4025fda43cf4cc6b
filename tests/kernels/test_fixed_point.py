"""The fixed-point dq (fa4dist/kernels/fixed_point.py) and the canonical key calls of the cp_invariant backward
(fa4dist/kernels/invariant.key_calls), on the CPU with the reference backend."""

import random

import pytest
import torch

from fa4dist.kernels import attention_backward, attention_forward, fixed_point, invariant
from fa4dist.kernels.fixed_point import KEY_TILE


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
