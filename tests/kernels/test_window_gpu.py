"""Sliding windows on the GPU: the cute kernels (window band in the kernels) and torch's flash op through the sdpa
backends (band blocks, windowed packed calls) against the fp64 oracle in bf16, the split-key merge, sinks (merged by
the contract), garbage outside the window, the deterministic backward's bytes, and the calls that must fall back to
the reference (softcap; cuDNN has no window)."""

import logging

import pytest
import torch

from fa4dist.kernels import attention_backward, attention_forward, available_backends, select_backend
from fa4dist.kernels.merge import merge_sink_
from fa4dist.kernels.problem import validate_inputs
from oracle import REL_TOL, naive_attention, rel_error

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16

DENSE = [
    # (batch, sq, sk, hq, hkv, d, causal, window, q_offset, k_offset)
    (2, 1024, 1024, 8, 8, 128, True, (255, -1), 0, 0),  # Mistral/Gemma-style causal window
    (1, 1000, 1000, 8, 2, 64, False, (100, 37), 0, 0),  # two-sided, GQA
    (1, 257, 513, 4, 4, 128, True, (127, -1), 256, 0),  # unaligned block: the window cuts both ends
    (1, 300, 700, 8, 1, 64, False, (50, 20), 400, 0),  # rows above and below the band see nothing (MQA)
    (2, 512, 128, 4, 4, 128, False, (-1, 3), 0, 300),  # right-only window, more rows than keys
    (1, 64, 64, 4, 4, 64, True, (10, -1), 0, 500),  # nothing visible at all
    (1, 4096, 4096, 4, 4, 128, True, (1000, -1), 0, 0),  # plain blocks between the two masked bands
    (1, 3000, 3100, 4, 2, 64, True, (700, -1), 100, 0),  # same at hdim 64, GQA, shifted diagonal
    (1, 1024, 1024, 4, 4, 128, True, (0, -1), 0, 0),  # each query sees only itself
    # windows wide enough (left >= tile_m + tile_n - 2) that the causal band and the window's band never share a
    # block, the key tile at the sequence end cut by both: hdim 128 and 64, shifted diagonals
    (1, 1500, 1700, 4, 4, 128, True, (300, -1), 200, 0),
    (1, 1300, 1237, 4, 2, 64, True, (318, -1), 0, 57),
]


def _tensors(shape_q, shape_k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, device="cuda", dtype=BF16, generator=g) for s in (shape_q, shape_k, shape_k))


def _oracle(q, k, v, dout, **kw):
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    cpu_kw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    sinks = cpu_kw.pop("sinks", None)
    sinks = sinks.double().requires_grad_() if sinks is not None else None
    out, lse = naive_attention(*leaves, sinks=sinks, **cpu_kw)
    out.backward(dout.cpu().double())
    return out.detach(), lse.detach(), [t.grad for t in leaves] + ([sinks.grad] if sinks is not None else [])


def _check(backend, q, k, v, **kw):
    dout = torch.randn_like(q)
    ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, **kw)
    out = torch.full(ref_out.shape, float("nan"), device="cuda", dtype=BF16)  # poisoned: every element written
    lse = torch.full(ref_lse.shape, float("nan"), device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, out=out, lse=lse, backend=backend, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out.cpu(), ref_out) < REL_TOL[BF16] or ref_out.norm() == 0
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)
    grads = attention_backward(dout, q, k, v, out, lse, backend=backend, **kw)
    for got, want in zip(grads, ref_grads):
        if ref_out.norm() == 0:  # no visible pair: exact zeros
            assert torch.equal(got.cpu().double(), want)
        elif want.norm() == 0:
            # zero by cancellation (a query that sees only itself: P = 1, dS = P (dP - dPsum) = 0 up to fp32
            # rounding of dPsum), not by masking: a tolerance of fp32 rounding on O(1) gradients
            assert got.abs().max().item() < 1e-5
        else:
            assert rel_error(got.cpu(), want) < 2 * REL_TOL[BF16]


def _need(backend):
    if backend not in available_backends("cuda"):
        pytest.skip(f"backend {backend} is not available here")


@pytest.mark.parametrize("case", DENSE, ids=[f"{c[6] and 'causal' or 'full'}-w{c[7]}-{c[1]}x{c[2]}" for c in DENSE])
@pytest.mark.parametrize("backend", ["cute", "sdpa", "sdpa_flash"])
def test_dense_windows(backend, case, caplog):
    _need(backend)
    b, sq, sk, hq, hkv, d, causal, window, q_off, k_off = case
    q, k, v = _tensors((b, sq, hq, d), (b, sk, hkv, d))
    kw = dict(causal=causal, window=window, q_offset=q_off, k_offset=k_off)
    problem = validate_inputs(q, k, v, **kw)
    assert select_backend(backend, problem, "forward").name == backend  # no fallback: the op computes it
    with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
        _check(backend, q, k, v, **kw)
    assert "using the reference backend" not in caplog.text


@pytest.mark.parametrize("backend", ["cute", "sdpa_flash"])
@pytest.mark.parametrize("causal, window", [(True, (63, -1)), (False, (20, 20)), (True, (200, -1)), (True, (333, -1))])
def test_packed_windows(backend, causal, window):
    _need(backend)
    cu = torch.tensor([0, 300, 301, 700, 1000], dtype=torch.int32, device="cuda")
    q, k, v = _tensors((1000, 8, 64), (1000, 2, 64))
    offsets = [0, 5, 100, 0]  # per-document positions, the same for q and k (square, aligned segments)
    _check(backend, q, k, v, causal=causal, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=offsets,
           k_offset=offsets)


def test_cute_windowed_packed_with_per_segment_offsets():
    """Documents whose query and key offsets differ (a ring step's view): the kernels' per-segment diagonals."""
    _need("cute")
    cu_q = torch.tensor([0, 300, 301, 700, 1000], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 500, 501, 900, 1400], dtype=torch.int32, device="cuda")
    q, _, _ = _tensors((1000, 8, 128), (1, 1, 1), seed=3)
    _, k, v = _tensors((1, 1, 1), (1400, 2, 128), seed=4)
    _check("cute", q, k, v, causal=True, window=(150, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
           q_offset=[200, 7, 450, 600], k_offset=[0, 0, 300, 100])


@pytest.mark.parametrize("d", [64, 128])
def test_cute_windowed_deterministic_backward_is_bitwise_reproducible(d):
    _need("cute")
    q, k, v = _tensors((2, 2048, 8, d), (2, 2048, 2, d), seed=5)
    kw = dict(causal=True, window=(700, -1), backend="cute")
    out, lse = attention_forward(q, k, v, **kw)
    dout = torch.randn_like(q)
    first = attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    for _ in range(3):
        again = attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
        for a, b in zip(first, again):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    plain = attention_backward(dout, q, k, v, out, lse, **kw)
    for a, b in zip(first, plain):
        assert rel_error(a, b) < 1e-2


@pytest.mark.parametrize("backend", ["cute", "sdpa"])
def test_split_keys_with_a_window_and_sinks_merge_to_the_full_result(backend):
    _need(backend)
    q, k, v = _tensors((1, 2048, 8, 128), (1, 2048, 8, 128), seed=1)
    sinks = torch.randn(8, device="cuda", dtype=torch.float32)
    kw = dict(causal=True, window=(511, -1), backend=backend)
    full_out, full_lse = attention_forward(q, k, v, sinks=sinks, **kw)
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full((1, 8, 2048), float("-inf"), device="cuda")
    for i, (a, b) in enumerate([(0, 700), (700, 1300), (1300, 2048)]):
        attention_forward(q, k[:, a:b], v[:, a:b], k_offset=a, out=out, lse=lse, accumulate=True,
                          sinks=sinks if i == 1 else None, **kw)
    assert rel_error(out, full_out.float()) < 1e-2
    torch.testing.assert_close(lse, full_lse, atol=2e-3, rtol=1e-3)
    dout = torch.randn_like(q)
    ref = _oracle(q, k, v, dout, causal=True, window=(511, -1), sinks=sinks)
    *_, dsinks = attention_backward(dout, q, k, v, full_out, full_lse, sinks=sinks, **kw)
    assert rel_error(dsinks.cpu(), ref[2][3]) < 2e-2


def test_softcap_and_cudnn_windows_fall_back_with_a_log(caplog):
    q, k, v = _tensors((1, 256, 4, 64), (1, 256, 4, 64))
    with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
        _check("sdpa", q, k, v, causal=True, softcap=30.0)
    assert "no softcap" in caplog.text
    if "sdpa_cudnn" in available_backends("cuda"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fa4dist.kernels"):
            _check("sdpa_cudnn", q, k, v, causal=True, window=(31, -1))
        assert "no sliding window" in caplog.text


@pytest.mark.parametrize("backend", ["cute", "sdpa_flash"])
def test_garbage_outside_the_window_does_not_leak(backend):
    _need(backend)
    q, k, v = _tensors((1, 1000, 4, 64), (1, 1000, 4, 64), seed=2)
    kw = dict(causal=True, window=(99, -1))
    clean_out, _ = attention_forward(q, k, v, backend=backend, **kw)
    p = 500  # rows 500..599 see key 500
    k[:, p, 1] = float("nan")
    v[:, p + 1, 2] = float("inf")
    out, lse = attention_forward(q, k, v, backend=backend, **kw)
    want, _ = attention_forward(q.cpu(), k.cpu(), v.cpu(), backend="reference", **kw)
    bad = ~torch.isfinite(want).all(-1)
    assert torch.equal(~torch.isfinite(out.cpu()).all(-1), bad)
    assert bad[:, :p].sum() == 0 and bad[:, 601:].sum() == 0 and bad[:, p:p + 100].any()
    torch.testing.assert_close(out[~bad.cuda()], clean_out[~bad.cuda()], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["cute", "sdpa_flash"])
@pytest.mark.parametrize("causal, window", [(True, (99, -1)), (False, (60, 40))])
def test_a_row_whose_window_starts_between_two_bad_values_sees_the_later_one(backend, causal, window):
    """Two non-finite value rows in one key tile (keys 128..255 of the kernels): a row's visible keys there are an
    interval, so a row that sees only the later bad key must still be NaN (not only the rows seeing the first)."""
    _need(backend)
    q, k, v = _tensors((1, 1000, 4, 64), (1, 1000, 4, 64), seed=6)
    kw = dict(causal=causal, window=window)
    v[:, 130, 1] = float("nan")
    v[:, 200, 1] = float("inf")
    out, _ = attention_forward(q, k, v, backend=backend, **kw)
    want, _ = attention_forward(q.cpu(), k.cpu(), v.cpu(), backend="reference", **kw)
    bad = ~torch.isfinite(want).all(-1)
    assert torch.equal(~torch.isfinite(out.cpu()).all(-1), bad)
    left = window[0]
    assert bad[0, 200 + left - 10, 1]  # its window starts past key 130 and holds key 200
    assert not bad[0, 200 + left + 1, 1] and bad[0, 130, 1]  # past both / sees the first
    assert bad[:, :, [0, 2, 3]].sum() == 0


@pytest.mark.parametrize("case", [
    # (batch, sq, sk, hq, hkv, d, causal, window, softcap)
    (1, 1024, 1024, 8, 2, 128, True, (-1, -1), 30.0),
    (2, 700, 900, 4, 4, 64, False, (-1, -1), 5.0),
    (1, 2048, 2048, 4, 4, 128, True, (511, -1), 50.0),  # Gemma 2: a window and the cap
])
def test_cute_softcap_kernels(case):
    """The softcap kernels (the hardware tanh in the score path, its derivative recovered from P in the backward)
    against the fp64 oracle."""
    _need("cute")
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = _tensors((b, sq, hq, d), (b, sk, hkv, d), seed=7)
    kw = dict(causal=causal, window=window, softcap=softcap)
    assert select_backend("cute", validate_inputs(q, k, v, **kw), "backward").name == "cute"
    _check("cute", q, k, v, **kw)
    out, lse = attention_forward(q, k, v, backend="cute", **kw)
    dout = torch.randn_like(q)
    first = attention_backward(dout, q, k, v, out, lse, backend="cute", deterministic=True, **kw)
    again = attention_backward(dout, q, k, v, out, lse, backend="cute", deterministic=True, **kw)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(first, again))



@pytest.mark.parametrize("case", [
    # (batch, sq, sk, hq, hkv, causal, window, softcap, sinks)
    (1, 1500, 1500, 8, 4, True, (511, -1), 50.0, False),  # Gemma 2: a window and the cap
    (2, 700, 900, 4, 1, False, (-1, -1), None, True),  # sinks, MQA
])
def test_cute_forward_at_hdim_256(case):
    """hdim 256 (Gemma 2 / 3): the cute forward with a window, the cap or sinks against the fp64 oracle; "auto"
    takes the backward elsewhere (the cute backward has no hdim 256), from the cute forward's out and lse."""
    _need("cute")
    b, sq, sk, hq, hkv, causal, window, softcap, with_sinks = case
    q, k, v = _tensors((b, sq, hq, 256), (b, sk, hkv, 256), seed=5)
    kw = dict(causal=causal, window=window, softcap=softcap)
    if with_sinks:
        kw["sinks"] = torch.randn(hq, device="cuda", dtype=torch.float32)
    problem = validate_inputs(q, k, v, **{n: x for n, x in kw.items() if n != "sinks"})
    assert select_backend("auto", problem, "forward").name == "cute"
    assert select_backend("auto", problem, "backward").name != "cute"
    _check("auto", q, k, v, **kw)


@pytest.mark.parametrize("case", [
    # (batch, sq, sk, hq, hkv, d, causal, window, softcap, q_scale, q_offset, sinks)
    (1, 1024, 1024, 8, 2, 128, True, (-1, -1), 50.0, 8.0, 0, False),  # saturated: P spans e^-80 .. e^20
    (1, 1000, 1200, 4, 4, 64, False, (-1, -1), 51.0, 8.0, 0, False),  # past the range: the running max
    (1, 1024, 1536, 4, 4, 128, True, (255, -1), 20.0, 1.0, -300, True),  # sinks; rows that see no key
])
def test_cute_softcap_fixed_row_max(case):
    """Capped scores are bounded, so the bf16 forward replaces the running row max by a constant
    (cute/softmax.softcap_fixed_row_max): against the fp64 oracle, and against the running-max kernel."""
    _need("cute")
    from fa4dist.kernels.cute import forward as cute_forward

    b, sq, sk, hq, hkv, d, causal, window, softcap, q_scale, q_offset, with_sinks = case
    q, k, v = _tensors((b, sq, hq, d), (b, sk, hkv, d), seed=13)
    q = (q.float() * q_scale).to(BF16)
    kw = dict(causal=causal, window=window, softcap=softcap, q_offset=q_offset)
    if with_sinks:
        kw["sinks"] = torch.randn(hq, device="cuda", dtype=torch.float32) * 3
    _check("cute", q, k, v, **kw)
    fixed_out, fixed_lse = attention_forward(q, k, v, backend="cute", **kw)
    try:
        cute_forward.set_override(softcap_fixed_max=False)
        running_out, running_lse = attention_forward(q, k, v, backend="cute", **kw)
    finally:
        cute_forward.set_override()
    assert rel_error(fixed_out.float(), running_out.float()) < REL_TOL[BF16]
    finite = torch.isfinite(running_lse)
    assert torch.equal(torch.isfinite(fixed_lse), finite)
    torch.testing.assert_close(fixed_lse[finite], running_lse[finite], atol=1e-4, rtol=1e-5)

@pytest.mark.parametrize("case", [
    # (batch, sq, sk, hq, hkv, d, causal, window, q_offset)
    (2, 1024, 1024, 8, 2, 128, True, (-1, -1), 0),  # the TMA-store epilogue
    (1, 700, 900, 4, 4, 64, False, (-1, -1), 0),
    (1, 1024, 1536, 4, 4, 128, True, (255, -1), -300),  # rows 0..299 see no key: (0, sink)
])
def test_cute_sinks_in_the_forward_epilogue(case):
    """The sinks join the denominator in the cute forward's epilogue (no fp32 round trip): against the fp64
    oracle, and against the contract's merge of the same kernel's fp32 block (kernels/merge.merge_sink_), there
    with one head's sink at -inf (no sink: its rows that see no key keep lse = -inf)."""
    _need("cute")
    b, sq, sk, hq, hkv, d, causal, window, q_offset = case
    q, k, v = _tensors((b, sq, hq, d), (b, sk, hkv, d), seed=11)
    sinks = torch.randn(hq, device="cuda", dtype=torch.float32) * 3
    kw = dict(causal=causal, window=window, q_offset=q_offset, sinks=sinks)
    _check("cute", q, k, v, **kw)
    sinks[-1] = float("-inf")  # (the oracle's own gradient of a -inf sink is NaN: compared with the merge only)
    fused_out, fused_lse = attention_forward(q, k, v, backend="cute", **kw)
    block_out = torch.empty(fused_out.shape, dtype=torch.float32, device="cuda")
    block_lse = torch.empty(fused_lse.shape, dtype=torch.float32, device="cuda")
    attention_forward(q, k, v, out=block_out, lse=block_lse, backend="cute", **{**kw, "sinks": None})
    merge_sink_(block_out, block_lse, sinks)
    assert rel_error(fused_out.float(), block_out) < REL_TOL[BF16]
    torch.testing.assert_close(fused_lse, block_lse, atol=1e-5, rtol=1e-5)
    if q_offset < 0:
        unseen = fused_lse[..., :-q_offset]
        assert torch.equal(unseen[:, :-1], sinks[:-1].view(1, -1, 1).expand_as(unseen[:, :-1]))
        assert torch.isneginf(unseen[:, -1]).all() and not fused_out[:, :-q_offset].any()


@pytest.mark.parametrize("case", [
    # (batch, sq, sk, hq, hkv, d, causal, window, q_offset)
    (2, 1024, 1024, 8, 2, 128, True, (-1, -1), 0),  # the TMA-store epilogue
    (1, 700, 900, 4, 4, 64, False, (-1, -1), 0),
    (1, 1024, 1536, 4, 4, 128, True, (255, -1), -300),  # rows 0..299 see no key
])
def test_cute_non_finite_sinks_make_their_heads_rows_nan(case):
    """A +inf or NaN sink is a non-finite score every row of its head sees: the cute epilogue gives those rows
    out = lse = NaN, rows that see no key included, as the contract's merge does (kernels/merge.merge_sink_, what
    the reference backend runs); a -inf sink is no sink; the other heads keep their values."""
    _need("cute")
    b, sq, sk, hq, hkv, d, causal, window, q_offset = case
    q, k, v = _tensors((b, sq, hq, d), (b, sk, hkv, d), seed=13)
    sinks = torch.randn(hq, device="cuda", dtype=torch.float32)
    sinks[0], sinks[1], sinks[2] = float("inf"), float("nan"), float("-inf")
    kw = dict(causal=causal, window=window, q_offset=q_offset, sinks=sinks)
    out = torch.full(q.shape, 7.0, device="cuda", dtype=q.dtype)  # poisoned: every row must be written
    lse = torch.full((b, hq, sq), 7.0, device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, out=out, lse=lse, backend="cute", **kw)
    ref_out, ref_lse = attention_forward(q, k, v, backend="reference", **kw)
    for h in (0, 1):
        assert torch.isnan(out[:, :, h]).all() and torch.isnan(lse[:, h]).all(), f"head {h} (sink {sinks[h]})"
        assert torch.isnan(ref_out[:, :, h]).all() and torch.isnan(ref_lse[:, h]).all()
    finite = slice(2, None)
    assert rel_error(out[:, :, finite].float(), ref_out[:, :, finite].float()) < REL_TOL[BF16]
    torch.testing.assert_close(lse[:, finite], ref_lse[:, finite], atol=1e-4, rtol=1e-5)


def _seen_nan_under_a_dominant_sink(backend, device):
    """Rows that see a NaN value in a visible key while their sink's logit (200) outweighs their keys' (near 0):
    the keys' weight underflows to exactly 0 in fp32, yet a row that saw the NaN must stay NaN (as one call without
    a sink gives it, and as the reference's merge keeps it), and the rows before it 0 (the sink takes everything),
    with lse = the sink's.  Through the fused-sink epilogue (one call) and through an accumulating call (the
    contract merges the sinks afterwards)."""
    g = torch.Generator(device=device).manual_seed(17)
    b, s, hq, hkv, d, p = 1, 256, 4, 2, 128, 100
    q = (torch.randn(b, s, hq, d, device=device, generator=g) * 0.01).to(BF16)  # scores near 0
    k, v = (torch.randn(b, s, hkv, d, device=device, generator=g).to(BF16) for _ in range(2))
    v[:, p, :, 0] = float("nan")  # key p: rows p.. see it (causal), in channel 0 of every head
    sinks = torch.full((hq,), 200.0, device=device, dtype=torch.float32)
    kw = dict(causal=True, sinks=sinks, backend=backend)
    fused_out, fused_lse = attention_forward(q, k, v, **kw)
    acc_out = torch.zeros(b, s, hq, d, device=device, dtype=torch.float32)
    acc_lse = torch.full((b, hq, s), float("-inf"), device=device, dtype=torch.float32)
    attention_forward(q, k, v, out=acc_out, lse=acc_lse, accumulate=True, **kw)
    for name, out, lse in (("fused", fused_out, fused_lse), ("accumulated", acc_out, acc_lse)):
        seen = out[:, p:].float()
        assert (~torch.isfinite(seen).flatten(-1)).any(-1).all(), f"{name}: a row that saw the NaN value is finite"
        assert torch.isnan(seen[..., 0]).all(), f"{name}: NaN lost in the channel that holds it"
        before = out[:, :p].float()
        assert torch.isfinite(before).all() and before.abs().max().item() < 1e-30, name  # the sink takes all
        torch.testing.assert_close(lse, torch.full_like(lse, 200.0), atol=1e-3, rtol=0)


def test_cute_keeps_a_seen_nan_when_a_sink_dominates_the_row():
    _need("cute")
    _seen_nan_under_a_dominant_sink("cute", "cuda")
