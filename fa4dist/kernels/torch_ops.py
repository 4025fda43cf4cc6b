"""`fa4dist.attention` as torch custom ops, so that torch.compile traces a model through it without a graph break.

Under torch.compile (``torch.compiler.is_compiling()``), :func:`fa4dist.kernels.autograd.attention` calls
``torch.ops.fa4dist.attention_fwd`` instead of its autograd.Function; the op's autograd formula calls
``torch.ops.fa4dist.attention_bwd``. Both run exactly what the eager path runs (``api.forward_problem`` /
``api.backward_problem`` on the same validated problem), so compiled and eager calls give the same bytes; what
the ops add is a shape-only ("fake") implementation that lets dynamo and inductor trace around them, including
``fullgraph=True``. Eager calls keep the autograd.Function: a custom op's dispatch costs host time that shows at
short sequences.

Not through the ops (each is excluded from tracing with ``torch.compiler.disable``, so a compiled model runs it
eagerly behind one graph break): ``cp_invariant=True``, the contract's in-place entry points (``out=``,
``accumulate=``, work lists) and context-parallel attention (collectives and plans). Second derivatives
(``create_graph=True``) are not available under torch.compile; eager calls have them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .api import backward_problem, forward_problem
from .problem import _offsets, accum_dtype, check_layout, lse_shape_of, validate_inputs

def _offset_arg(name: str, value, count):
    """An offset as the ops take it, checked as the eager call checks it: ([the int], None) for one int, which is
    every sequence's (so the batch size or the number of packed segments is not read: it stays symbolic under
    ``dynamic=True`` / ``mark_dynamic``, and packed batches with other document counts reuse the graph); (its
    per-sequence ints, None) for a sequence, checked against ``count()`` (which fixes that count in the graph); or
    ([], the tensor) for a tensor of offsets (its values are read when the op runs)."""
    if isinstance(value, torch.Tensor):
        return [], value
    if isinstance(value, int) and not isinstance(value, bool):
        return list(_offsets(name, value, 1)), None
    return list(_offsets(name, value, count())), None


def _offset_value(values: list[int], tensor: Optional[torch.Tensor]):
    """The offset argument of the eager call: the tensor, one int (a one-entry list: every sequence's), or the
    per-sequence ints."""
    if tensor is not None:
        return tensor
    return values[0] if len(values) == 1 else values


def _problem(q, k, v, sinks, causal, window, softcap, softmax_scale, q_offsets, q_offset_t, k_offsets, k_offset_t,
             cu_seqlens_q, cu_seqlens_k):
    return validate_inputs(
        q, k, v, sinks=sinks, causal=causal, window=tuple(window), softcap=softcap, softmax_scale=softmax_scale,
        q_offset=_offset_value(q_offsets, q_offset_t), k_offset=_offset_value(k_offsets, k_offset_t),
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
    )


@torch.library.custom_op("fa4dist::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], causal: bool,
    window: list[int], softcap: Optional[float], softmax_scale: Optional[float], q_offsets: list[int],
    q_offset_t: Optional[torch.Tensor], k_offsets: list[int], k_offset_t: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], backend: str,
    deterministic: Optional[bool], lse_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); ``deterministic`` is the backward's option, carried to it; ``lse_grad``: lse is a
    differentiable output (``return_lse=True``)."""
    problem = _problem(q, k, v, sinks, causal, window, softcap, softmax_scale, q_offsets, q_offset_t, k_offsets,
                       k_offset_t, cu_seqlens_q, cu_seqlens_k)
    out, lse = forward_problem(problem, q, k, v, sinks=sinks, backend=backend)
    return out.contiguous(), lse.contiguous()


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, sinks, causal, window, softcap, softmax_scale, q_offsets, q_offset_t, k_offsets,
                        k_offset_t, cu_seqlens_q, cu_seqlens_k, backend, deterministic, lse_grad):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(lse_shape_of(q.shape), dtype=accum_dtype(q.dtype))


@torch.library.custom_op("fa4dist::attention_bwd", mutates_args=())
def attention_bwd(
    dout: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
    out: torch.Tensor, lse: torch.Tensor, causal: bool, window: list[int], softcap: Optional[float],
    softmax_scale: Optional[float], q_offsets: list[int], q_offset_t: Optional[torch.Tensor], k_offsets: list[int],
    k_offset_t: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    backend: str, deterministic: Optional[bool], dlse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is an empty tensor when there are no sinks (an op returns tensors only);
    ``dlse``: the lse's gradient (``attention_backward(dlse=)``), or None; ``dout`` None with it: a loss of the lse
    alone."""
    problem = _problem(q, k, v, sinks, causal, window, softcap, softmax_scale, q_offsets, q_offset_t, k_offsets,
                       k_offset_t, cu_seqlens_q, cu_seqlens_k)
    dout, dlse = (None if t is None else t.contiguous() for t in (dout, dlse))
    grads = backward_problem(problem, dout, q, k, v, out, lse, sinks=sinks, backend=backend,
                             deterministic=deterministic, dlse=dlse)
    dsinks = grads[3].to(sinks.dtype) if sinks is not None else q.new_empty((0,))
    return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), dsinks


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, sinks, out, lse, causal, window, softcap, softmax_scale, q_offsets,
                        q_offset_t, k_offsets, k_offset_t, cu_seqlens_q, cu_seqlens_k, backend, deterministic,
                        dlse=None):
    dsinks = torch.empty_like(sinks, memory_format=torch.contiguous_format) if sinks is not None \
        else q.new_empty((0,))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dsinks)


# attention_fwd's arguments: q, k, v, sinks, then the mask's ten (which attention_bwd takes again), backend,
# deterministic and lse_grad
_MASK_ARGS = slice(4, 14)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks = inputs[:4]
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse)
    ctx.mask_args, ctx.backend, ctx.deterministic, ctx.lse_grad = inputs[_MASK_ARGS], *inputs[14:17]
    if not ctx.lse_grad:  # (return_lse=False: no tangent of it to trace, no second backward pass)
        ctx.mark_non_differentiable(lse)
    # an output the loss does not use: None, not zeros (a zero dlse cost the sdpa backends a second backward pass)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dlse = dlse if ctx.lse_grad else None  # (the lse's gradient joins the same pass: attention_backward(dlse=))
    if dout is None and dlse is None:  # both gradients undefined: none
        return (None,) * 17
    dq, dk, dv, dsinks = attention_bwd(dout, q, k, v, sinks, out, lse, *ctx.mask_args, ctx.backend,
                                       ctx.deterministic, dlse)
    return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * 13


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_second_derivative(ctx, *grads):
    """attention_bwd's derivative: none. Reached where the ops run eagerly under a create_graph=True backward (the
    "eager" backend; aot_autograd's refuse double backward themselves); torch's own message named no fa4dist call."""
    raise RuntimeError("fa4dist.attention under torch.compile is differentiable once (its backward op has no "
                       "derivative): compute second derivatives with the eager call, outside torch.compile, which "
                       "supports create_graph=True")


attention_bwd.register_autograd(_no_second_derivative, setup_context=lambda ctx, inputs, output: None)


def check_traceable_scalars(mask_kwargs: dict) -> None:
    """``softcap``, ``softmax_scale``, the ``window``'s sides and the offsets at trace time: dynamo traces a numpy
    scalar as a 0-d array whose value it does not know, so the checks cannot read it (eager calls take numpy's
    scalars; under torch.compile without ``fullgraph=True`` the call breaks the graph and runs eagerly). A Python
    float whose value changed between calls arrives as a SymFloat, which the checks and the ops take as it is."""
    for name in ("softcap", "softmax_scale"):
        if isinstance(mask_kwargs[name], (np.generic, np.ndarray)):
            raise TypeError(f"{name}: under torch.compile pass a Python float (dynamo traces a numpy scalar as an "
                            f"array whose value it does not know), e.g. float({name})")
    for name in ("window", "q_offset", "k_offset"):
        value = mask_kwargs[name]
        entries = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(x, (np.generic, np.ndarray)) for x in entries):
            raise TypeError(f"{name}: under torch.compile pass Python ints (dynamo traces a numpy scalar as an "
                            f"array whose value it does not know), e.g. int(x) for each")


def compiled_attention(q, k, v, sinks, mask_kwargs: dict, backend: str, deterministic: Optional[bool],
                       lse_grad: bool = False):
    """(out, lse) through the ops: what :func:`fa4dist.attention` runs while torch.compile traces it. The checks
    that read no tensor's values run here, at trace time, as the eager call runs them; the rest when the op runs."""
    check_traceable_scalars(mask_kwargs)
    cu_q = mask_kwargs["cu_seqlens_q"]
    check_layout(q, k, v, sinks=sinks, cu_seqlens_q=cu_q, cu_seqlens_k=mask_kwargs["cu_seqlens_k"],
                 **{n: mask_kwargs[n] for n in ("causal", "window", "softcap", "softmax_scale")})

    def count():  # sequences or packed segments, for offsets given per sequence
        return int(q.shape[0] if cu_q is None else cu_q.shape[0] - 1)

    q_offsets, q_offset_t = _offset_arg("q_offset", mask_kwargs["q_offset"], count)
    k_offsets, k_offset_t = _offset_arg("k_offset", mask_kwargs["k_offset"], count)
    window = mask_kwargs["window"]
    window = [-1, -1] if window is None else list(window)
    out, lse = attention_fwd(
        q, k, v, sinks, mask_kwargs["causal"], window, mask_kwargs["softcap"], mask_kwargs["softmax_scale"],
        q_offsets, q_offset_t, k_offsets, k_offset_t, mask_kwargs["cu_seqlens_q"], mask_kwargs["cu_seqlens_k"],
        backend, deterministic, lse_grad)
    # a differentiable lse is the caller's to update in place (as the eager call's): the op saved its own
    return out, lse.clone() if lse_grad else lse
