"""`fa4dist.attention`: the kernel contract wrapped as a differentiable function for single-GPU use."""

from __future__ import annotations

from typing import Optional

import torch

from .api import attention_backward, attention_forward


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask_kwargs, backend, deterministic):
        out, lse = attention_forward(q, k, v, backend=backend, **mask_kwargs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask_kwargs, ctx.backend, ctx.deterministic = mask_kwargs, backend, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(
            dout.contiguous(), q, k, v, out, lse, backend=ctx.backend, deterministic=ctx.deterministic,
            **ctx.mask_kwargs,
        )
        return dq, dk, dv, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    q_offset=0,
    k_offset=0,
    deterministic: Optional[bool] = None,
    backend: str = "auto",
):
    """Differentiable attention through the kernel contract (q, k, v as in `fa4dist.kernels`).

    Returns out, or (out, lse) with ``return_lse=True`` (lse carries no gradient)."""
    mask_kwargs = dict(
        causal=causal, softmax_scale=softmax_scale, q_offset=q_offset, k_offset=k_offset,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
    )
    out, lse = _AttentionFunction.apply(q, k, v, mask_kwargs, backend, deterministic)
    return (out, lse) if return_lse else out
