"""`fa4dist.attention`: the kernel contract wrapped as a differentiable function for single-GPU use."""

from __future__ import annotations

from typing import Optional

import torch

from . import invariant, reference, torch_ops
from .api import backward_problem, forward_problem, lse_pass
from .checkpointing import outside_selective_checkpoint
from .merge import merge_sink_, with_sink
from .problem import EAGER_ONLY, check_bool, check_optional_bool, validate_inputs


def _differentiable_grads(dout, q, k, v, sinks, mask_kwargs, dlse=None):
    """dq, dk, dv (and dsinks) as differentiable functions of (dout, q, k, v, sinks): the reference forward
    recomputed under autograd and differentiated with ``create_graph=True`` (the fast backward treats the saved
    out/lse as constants, which is right for one derivative and wrong for two), of a loss whose gradients are
    ``dout`` for out and ``dlse`` for lse (either None: that output unused).  Reference speed: meant for checks and
    small models."""
    problem = validate_inputs(q, k, v, sinks=sinks, **mask_kwargs)
    inputs = (q, k, v, sinks)
    with torch.enable_grad(), reference.no_autocast(q.device):
        out, lse = reference.forward(problem, q, k, v)
        if sinks is not None:
            out, lse = with_sink(out, lse, sinks)
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        # (an output that depends on no input wanted is left out: the lse when only v requires grad; autograd.grad
        # raised 'element 1 of tensors does not require grad' for it, and its gradient there is zero)
        seeded = [(t, g.to(t.dtype)) for t, g in ((out, dout), (lse, dlse)) if g is not None and t.requires_grad]
        if not out.requires_grad or not seeded:  # no row sees a key (and no sinks): out is constant zeros, lse -inf
            return tuple(torch.zeros_like(t) if t is not None and t.requires_grad else None for t in inputs)
        results, seeds = zip(*seeded)
        grads = torch.autograd.grad(results, wanted, seeds, create_graph=True, allow_unused=True)
        grads = iter(torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in inputs)


_NO_TRANSFORMS = ("{call} does not support {what}: its kernels have a backward only (no batching rule, no forward-mode "
                  "derivative, and a backward that reads its saved tensors outside the transform). Differentiate with "
                  "torch.autograd (loss.backward() or torch.autograd.grad), and fold a vmapped dimension into the "
                  "batch")


@torch.compiler.disable(reason=EAGER_ONLY)  # eager calls only; nor is it a frame to compile after a graph break
def refuse_torch_func(call: str, *tensors) -> None:
    """Raises for inputs that a torch.func transform (grad, vjp, jacrev, vmap, jvp, ...) wraps, naming ``call``:
    torch's own error ('it must override the setup_context staticmethod') named neither the call nor the way out.
    The context-parallel module asks too, in its local checks (so that a rank alone under a transform fails every
    rank at once)."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    # (a non-tensor is left to the argument checks, which name it: torch's test raised on it, naming nothing)
    if wrapped is not None and any(isinstance(t, torch.Tensor) and wrapped(t) for t in tensors):
        raise RuntimeError(_NO_TRANSFORMS.format(call=call, what="torch.func transforms (grad, vjp, jacrev, vmap, "
                                                                 "jvp, ...)"))


def forward_ad_refusal(call: str):
    """A custom Function's ``jvp``: forward-mode AD (torch.autograd.forward_ad) of ``call`` refused by name (torch
    asked for a jvp function, naming neither the call nor the way out)."""

    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_TRANSFORMS.format(call=call, what="forward-mode AD (torch.autograd.forward_ad)"))

    return staticmethod(jvp)


class _InvariantAttentionFunction(torch.autograd.Function):
    """The single-device form of the cp_invariant numerics (fa4dist.kernels.invariant): the bits every context-
    parallel layout reproduces.  With ``lse_grad`` the lse is differentiable: its gradient is a second invariant
    backward (v = 0, :func:`fa4dist.kernels.api.lse_pass`), whose results are added to the first's in
    the inputs' dtypes, as the context-parallel engine adds them."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask_kwargs, backend, lse_grad):
        problem = validate_inputs(q, k, v, sinks=sinks, **mask_kwargs)
        if not problem.varlen and not problem.uniform_offsets:
            raise ValueError("cp_invariant=True needs one q_offset and one k_offset for a dense batch")
        items = invariant.single_device_items(problem)
        with outside_selective_checkpoint():  # one op to a checkpoint's policy (its kernels update in place)
            # no K/V expansion: a query head's row reads its key/value head either way (the same bits)
            out, lse = invariant.forward(q, k, v, items, softmax_scale=problem.softmax_scale,
                                         softcap=problem.softcap, backend=backend)
            if sinks is not None:  # once per row, in fp32, before out is rounded (as the context-parallel engine)
                merge_sink_(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.items, ctx.backend = items, backend
        ctx.scale, ctx.softcap = problem.softmax_scale, problem.softcap
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        else:  # the caller's copy (theirs to update in place): the saved one stays
            lse = lse.clone()
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None: its pass is skipped
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 7
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            raise RuntimeError("cp_invariant=True attention is differentiable once (create_graph=True is not "
                               "supported in this mode)")
        passes = [] if dout is None else [(dout.contiguous(), v, out)]
        if dlse is not None:
            passes.append(lse_pass(dlse.to(lse.dtype), out, v, q.dtype))
        grads = []
        with outside_selective_checkpoint():
            for d, vv, o in passes:
                dq, dk, dv = invariant.single_device_backward(d, q, k, vv, o, lse, ctx.items, softmax_scale=ctx.scale,
                                                              softcap=ctx.softcap, backend=ctx.backend)
                dsinks = None
                if sinks is not None and ctx.needs_input_grad[3]:
                    dsinks = invariant.sink_grad(d, o, lse, sinks).to(sinks.dtype)
                grads.append((dq, dk, dv, dsinks))
        dq, dk, dsinks = (add_in_order(g[i] for g in grads) for i in (0, 1, 3))
        dv = grads[0][2] if dout is not None else torch.zeros_like(v)  # (the lse does not depend on v)
        return dq, dk, dv, dsinks, None, None, None

    jvp = forward_ad_refusal("fa4dist.attention")


class _AttentionFunction(torch.autograd.Function):
    """out, and with ``lse_grad`` the lse, differentiable: a loss of both takes one backward pass (the lse's
    gradient joins the row sums: ``attention_backward(dlse=)``)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask_kwargs, backend, deterministic, lse_grad):
        # validated once for both passes (the per-call host time shows at short sequences)
        problem = validate_inputs(q, k, v, sinks=sinks, **mask_kwargs)
        with outside_selective_checkpoint():  # one op to a checkpoint's policy, as a fused kernel is
            out, lse = forward_problem(problem, q, k, v, sinks=sinks, backend=backend)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.problem, ctx.mask_kwargs, ctx.backend, ctx.deterministic = problem, mask_kwargs, backend, deterministic
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        else:  # the caller's lse, theirs to update in place (masked_fill_ of the -inf rows): the saved one stays
            lse = lse.clone()
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not zeros to read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:  # both gradients undefined (gradcheck asks): none
            return (None,) * 8
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that are themselves differentiable
            return (*_differentiable_grads(dout, q, k, v, sinks, ctx.mask_kwargs, dlse=dlse), None, None, None, None)
        dout = None if dout is None else dout.contiguous()  # (None: a loss of the lse alone)
        with outside_selective_checkpoint():
            grads = backward_problem(ctx.problem, dout, q, k, v, out, lse, sinks=sinks, backend=ctx.backend,
                                     deterministic=ctx.deterministic, dlse=dlse)
        dsinks = grads[3].to(sinks.dtype) if sinks is not None else None
        return grads[0], grads[1], grads[2], dsinks, None, None, None, None

    jvp = forward_ad_refusal("fa4dist.attention")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    q_offset=0,
    k_offset=0,
    deterministic: Optional[bool] = None,
    backend: str = "auto",
    cp_invariant: Optional[bool] = None,
):
    """Differentiable attention through the kernel contract (q, k, v as in `fa4dist.kernels`).

    ``window=(left, right)`` (flash-attn's window_size, -1 unbounded), ``softcap`` and ``sinks`` (a (heads_q,)
    tensor of learnable logits, which gets a gradient) as in :func:`fa4dist.kernels.attention_forward`.
    Returns out, or (out, lse) with ``return_lse=True``; the lse is differentiable (its gradient joins the same
    backward pass where the backend takes it, the reference and cute; one more pass through the contract on the
    others: ``attention_backward(dlse=)``).
    ``cp_invariant=True`` (default:
    the environment variable ``FA4DIST_CP_INVARIANT=1``) computes the numerics that context-parallel attention
    reproduces bit for bit at any cp size (:mod:`fa4dist.kernels.invariant`; deterministic, GQA gradients per query
    head summed in order)."""
    mask_kwargs = dict(
        causal=causal, window=window, softcap=softcap, softmax_scale=softmax_scale, q_offset=q_offset,
        k_offset=k_offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
    )
    check_optional_bool("deterministic", deterministic)  # checked now: the backward runs later
    check_bool("return_lse", return_lse)
    if not torch.compiler.is_compiling():
        refuse_torch_func("fa4dist.attention", q, k, v, sinks)
    if invariant.enabled(cp_invariant):
        out, lse = _invariant_attention(q, k, v, sinks, mask_kwargs, backend, return_lse)
    elif torch.compiler.is_compiling():  # traced by torch.compile: the same calls as torch custom ops
        out, lse = torch_ops.compiled_attention(q, k, v, sinks, mask_kwargs, backend, deterministic,
                                                lse_grad=return_lse)
    else:
        out, lse = _AttentionFunction.apply(q, k, v, sinks, mask_kwargs, backend, deterministic, return_lse)
    return (out, lse) if return_lse else out


@torch.compiler.disable(reason=EAGER_ONLY)  # its engine is not an op
def _invariant_attention(q, k, v, sinks, mask_kwargs, backend, return_lse):
    return _InvariantAttentionFunction.apply(q, k, v, sinks, mask_kwargs, backend, return_lse)


def add_in_order(grads):
    """One input's gradients from the backward's passes added in pass order, in their dtype, as autograd adds the
    gradients of two uses (None where there are none)."""
    total = None
    for g in grads:
        if g is not None:
            total = g if total is None else total + g
    return total
