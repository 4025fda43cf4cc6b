"""`fa4dist.attention`: the kernel contract wrapped as a differentiable function for single-GPU use."""

from __future__ import annotations

from typing import Optional

import torch

from . import invariant, reference
from .api import attention_backward, attention_forward
from .problem import validate_inputs


def _differentiable_grads(dout, q, k, v, mask_kwargs):
    """dq, dk, dv as differentiable functions of (dout, q, k, v): the reference forward recomputed under autograd
    and differentiated with ``create_graph=True`` (the fast backward treats the saved out/lse as constants, which
    is right for one derivative and wrong for two).  Reference speed: meant for checks and small models."""
    problem = validate_inputs(q, k, v, **mask_kwargs)
    with torch.enable_grad():
        out, _ = reference.forward(problem, q, k, v)
        wanted = [t for t in (q, k, v) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dout.to(out.dtype), create_graph=True, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in (q, k, v))


class _InvariantAttentionFunction(torch.autograd.Function):
    """The single-device form of the cp_invariant numerics (fa4dist.kernels.invariant): the bits every context-
    parallel layout reproduces."""

    @staticmethod
    def forward(ctx, q, k, v, mask_kwargs, backend):
        problem = validate_inputs(q, k, v, **mask_kwargs)
        if not problem.varlen and not problem.uniform_offsets:
            raise ValueError("cp_invariant=True needs one q_offset and one k_offset for a dense batch")
        group = problem.heads_q // problem.heads_kv
        items = invariant.single_device_items(problem)
        k_e, v_e = invariant.expand_kv(k, group), invariant.expand_kv(v, group)
        out, lse = invariant.forward(q, k_e, v_e, items, softmax_scale=problem.softmax_scale, backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.items, ctx.group, ctx.scale, ctx.backend = items, group, problem.softmax_scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            raise RuntimeError("cp_invariant=True attention is differentiable once (create_graph=True is not "
                               "supported in this mode)")
        k_e, v_e = invariant.expand_kv(k, ctx.group), invariant.expand_kv(v, ctx.group)
        dq, dk, dv = invariant.backward(dout.contiguous(), q, k_e, v_e, out, lse, ctx.items, softmax_scale=ctx.scale,
                                        backend=ctx.backend)
        dk, dv = (invariant.sum_group(g, ctx.group) for g in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


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
        if torch.is_grad_enabled():  # create_graph=True: gradients that are themselves differentiable
            return (*_differentiable_grads(dout, q, k, v, ctx.mask_kwargs), None, None, None)
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
    cp_invariant: Optional[bool] = None,
):
    """Differentiable attention through the kernel contract (q, k, v as in `fa4dist.kernels`).

    Returns out, or (out, lse) with ``return_lse=True`` (lse carries no gradient).  ``cp_invariant=True`` (default:
    the environment variable ``FA4DIST_CP_INVARIANT=1``) computes the numerics that context-parallel attention
    reproduces bit for bit at any cp size (:mod:`fa4dist.kernels.invariant`; deterministic, GQA gradients per query
    head summed in order)."""
    mask_kwargs = dict(
        causal=causal, softmax_scale=softmax_scale, q_offset=q_offset, k_offset=k_offset,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
    )
    if invariant.enabled(cp_invariant):
        out, lse = _InvariantAttentionFunction.apply(q, k, v, mask_kwargs, backend)
        return (out, lse) if return_lse else out
    out, lse = _AttentionFunction.apply(q, k, v, mask_kwargs, backend, deterministic)
    return (out, lse) if return_lse else out
