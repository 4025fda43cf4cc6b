"""The kernel contract: `attention_forward` and `attention_backward`, the only entry points the rest of fa4dist
calls.  See the package docstring of :mod:`fa4dist.kernels` for the semantics."""

from __future__ import annotations

from typing import Optional

import torch

from .merge import merge_into_
from .problem import AttentionProblem, Offset, check_buffer, validate_inputs
from .registry import select_backend


def _accum_dtypes(problem: AttentionProblem) -> tuple[torch.dtype, ...]:
    return (torch.float64,) if problem.dtype == torch.float64 else (torch.float32,)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    q_offset: Offset = 0,
    k_offset: Offset = 0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    backend: str = "auto",
    cp_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block against a key block whose mask is given by global offsets.

    Returns ``(out, lse)``: out shaped like q (with v's head dim), lse (batch, heads, seqlen_q) or packed
    (heads, total_q), fp32 natural log (fp64 for fp64 inputs).  With ``accumulate=True``, ``out`` and ``lse`` must
    be given as the running fp32 result; the block is merged into them in place and they are returned.
    """
    problem = validate_inputs(
        q, k, v, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset, k_offset=k_offset,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, cp_invariant=cp_invariant,
    )
    acc = _accum_dtypes(problem)
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running out and lse to merge into (pass out= and lse=)")
    check_buffer("out", out, problem.out_shape(), problem.device, acc if accumulate else (problem.dtype,) + acc)
    check_buffer("lse", lse, problem.lse_shape(), problem.device, acc)
    impl = select_backend(backend, problem, "forward")
    if impl.fused_epilogue:
        return impl.forward(problem, q, k, v, out=out, lse=lse, accumulate=accumulate)
    block_out, block_lse = impl.forward(problem, q, k, v)
    if accumulate:
        merge_into_(out, lse, block_out, block_lse)
        return out, lse
    if out is None:
        out = block_out.to(problem.dtype)
    else:
        out.copy_(block_out)
    if lse is None:
        lse = block_lse.to(acc[0])
    else:
        lse.copy_(block_lse)
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    q_offset: Offset = 0,
    k_offset: Offset = 0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    deterministic: Optional[bool] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    backend: str = "auto",
    cp_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *global* out and lse (those of the whole key range, as a ring has them).

    Returns ``(dq, dk, dv)`` in q's dtype, or written into the given buffers; with ``accumulate=True`` the block's
    gradients are added to the given fp32 buffers.  ``deterministic=None`` follows
    ``torch.are_deterministic_algorithms_enabled()``.
    """
    problem = validate_inputs(
        q, k, v, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset, k_offset=k_offset,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, cp_invariant=cp_invariant,
    )
    acc = _accum_dtypes(problem)
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if t is None:
            raise ValueError(f"attention_backward needs {name} (the global forward result and its gradient)")
    check_buffer("dout", dout, problem.out_shape(), problem.device, (problem.dtype,) + acc)
    check_buffer("out", out, problem.out_shape(), problem.device, (problem.dtype,) + acc)
    check_buffer("lse", lse, problem.lse_shape(), problem.device, acc)
    grads = {"dq": dq, "dk": dk, "dv": dv}
    if accumulate and any(g is None for g in grads.values()):
        raise ValueError("accumulate=True needs the fp32 dq, dk and dv buffers to add into")
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        check_buffer(name, buf, tuple(like.shape), problem.device, acc if accumulate else (problem.dtype,) + acc)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    impl = select_backend(backend, problem, "backward")
    if impl.fused_epilogue:
        return impl.backward(
            problem, dout, q, k, v, out, lse, deterministic, dq=dq, dk=dk, dv=dv, accumulate=accumulate
        )
    block = impl.backward(problem, dout, q, k, v, out, lse, deterministic)
    result = []
    for buf, g in zip((dq, dk, dv), block):
        if buf is None:
            result.append(g.to(problem.dtype))
        elif accumulate:
            result.append(buf.add_(g))
        else:
            result.append(buf.copy_(g))
    return tuple(result)
