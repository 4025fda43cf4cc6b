"""fa4dist.kernels.sdpa on the CPU: the tensors its backends hand torch's fused ops (the ops themselves run on the
GPU: tests/kernels/test_backends_gpu.py)."""

import dataclasses

import pytest
import torch

from fa4dist.kernels import sdpa
from fa4dist.kernels.problem import validate_inputs


class _StrictOps:
    """Stands in for torch.ops.aten: refuses a strided head dim as torch's fused ops do (flash: "Input tensor must
    have contiguous last dimension"), and dout / out for the cuDNN backward other than compact (batch, seqlen,
    heads, dim), which it read with a cached graph's strides; returns zeros of the ops' shapes."""

    @staticmethod
    def _head_dims(*tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.stride(-1) != 1:
                raise RuntimeError("Input tensor must have contiguous last dimension")

    def _flash_attention_forward(self, q, k, v, *args, **kwargs):
        self._head_dims(q, k, v)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def _flash_attention_backward(self, dout, q, k, v, out, *args, **kwargs):
        self._head_dims(dout, q, k, v, out)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, *args, **kwargs):  # (batch, heads, seqlen, dim) views
        self._head_dims(q, k, v)
        return torch.zeros_like(q), torch.zeros(q.shape[:3] + (1,))

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, *args, **kwargs):
        self._head_dims(dout, q, k, v, out)
        for name, t in (("dout", dout), ("out", out)):
            if not t.transpose(1, 2).is_contiguous():
                raise AssertionError(f"the cuDNN backward got {name} of strides {t.stride()}")
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


heads_first = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731  (a head-major q's view)
dim_strided = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731


@pytest.mark.parametrize("backend", [sdpa.SdpaFlashBackend, sdpa.SdpaCudnnBackend])
@pytest.mark.parametrize("layout", [heads_first, dim_strided])
def test_the_ops_get_compact_head_dims_and_a_compact_dout_and_out(monkeypatch, backend, layout):
    """Before: a strided head dim reached the ops (their RuntimeError, or a crash of the process after cuDNN's),
    and a (batch, heads, seqlen, dim) dout or out reached the cuDNN backward as given (wrong gradients, silently,
    after a call with compact ones)."""
    monkeypatch.setattr(sdpa, "aten", _StrictOps())
    q, k, v, dout, out = (layout(torch.randn(2, 16, 4, 8, dtype=torch.bfloat16)) for _ in range(5))
    problem = validate_inputs(q, k, v)
    impl = backend()
    got_out, got_lse = impl.forward(problem, q, k, v)
    assert got_out.shape == (2, 16, 4, 8) and got_lse.shape == (2, 4, 16)
    grads = impl.backward(problem, dout, q, k, v, out, torch.zeros(2, 4, 16), False)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("causal", [False, True])
def test_a_negative_softmax_scale_is_refused_by_the_fused_ops(causal):
    """The contract takes any finite non-zero scale (the reference computes a negative one exactly), but torch's
    flash op masks the raw scores with -inf and scales them inside its exp2: -inf x a negative scale is +inf, so a
    masked pair weighs inf (and an unmasked row's max is its smallest scaled score).  Before: every sdpa backend
    said it supports such a call (NaN on the GPU); now each refuses it by name, as cute does, and "auto" moves on
    to the reference."""
    q, k, v = (torch.randn(2, 16, 4, 8, dtype=torch.bfloat16) for _ in range(3))
    problem = validate_inputs(q, k, v, causal=causal, softmax_scale=-0.125)
    on_gpu = dataclasses.replace(problem, device=torch.device("cuda"))
    flash, cudnn = sdpa.SdpaFlashBackend(), sdpa.SdpaCudnnBackend()
    for impl in (flash, cudnn, sdpa.SdpaBackend(cudnn, flash)):
        for direction in ("forward", "backward"):
            answer = impl.supports(on_gpu, direction)
            assert answer is not None and "softmax_scale" in answer.reason, (impl.name, direction, answer)
    assert flash.supports(dataclasses.replace(on_gpu, softmax_scale=0.125), "forward") is None
