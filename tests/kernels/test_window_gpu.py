"""Sliding windows on the GPU: torch's flash op through the sdpa backends (band blocks, windowed packed calls) against
the fp64 oracle in bf16, the split-key merge, sinks (merged by the contract), garbage outside the window, and the
calls that must fall back to the reference (softcap; cuDNN has no window)."""

import logging

import pytest
import torch

from fa4dist.kernels import attention_backward, attention_forward, available_backends, select_backend
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
        if want.norm() == 0:
            assert torch.equal(got.cpu().double(), want)
        else:
            assert rel_error(got.cpu(), want) < 2 * REL_TOL[BF16]


def _need(backend):
    if backend not in available_backends("cuda"):
        pytest.skip(f"backend {backend} is not available here")


@pytest.mark.parametrize("case", DENSE, ids=[f"{c[6] and 'causal' or 'full'}-w{c[7]}-{c[1]}x{c[2]}" for c in DENSE])
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_flash"])
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


@pytest.mark.parametrize("causal, window", [(True, (63, -1)), (False, (20, 20))])
def test_packed_windows(causal, window):
    _need("sdpa_flash")
    cu = torch.tensor([0, 300, 301, 700, 1000], dtype=torch.int32, device="cuda")
    q, k, v = _tensors((1000, 8, 64), (1000, 2, 64))
    offsets = [0, 5, 100, 0]  # per-document positions, the same for q and k (square, aligned segments)
    _check("sdpa_flash", q, k, v, causal=causal, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=offsets,
           k_offset=offsets)


def test_split_keys_with_a_window_and_sinks_merge_to_the_full_result():
    _need("sdpa")
    q, k, v = _tensors((1, 2048, 8, 128), (1, 2048, 8, 128), seed=1)
    sinks = torch.randn(8, device="cuda", dtype=torch.float32)
    kw = dict(causal=True, window=(511, -1), backend="sdpa")
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


def test_garbage_outside_the_window_does_not_leak():
    _need("sdpa_flash")
    q, k, v = _tensors((1, 1000, 4, 64), (1, 1000, 4, 64), seed=2)
    kw = dict(causal=True, window=(99, -1))
    clean_out, _ = attention_forward(q, k, v, backend="sdpa_flash", **kw)
    p = 500  # rows 500..599 see key 500
    k[:, p, 1] = float("nan")
    v[:, p + 1, 2] = float("inf")
    out, lse = attention_forward(q, k, v, backend="sdpa_flash", **kw)
    want, _ = attention_forward(q.cpu(), k.cpu(), v.cpu(), backend="reference", **kw)
    bad = ~torch.isfinite(want).all(-1)
    assert torch.equal(~torch.isfinite(out.cpu()).all(-1), bad)
    assert bad[:, :p].sum() == 0 and bad[:, 601:].sum() == 0 and bad[:, p:p + 100].any()
    torch.testing.assert_close(out[~bad.cuda()], clean_out[~bad.cuda()], rtol=0, atol=0)
