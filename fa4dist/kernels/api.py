"""The kernel contract: `attention_forward` and `attention_backward`, the only entry points the rest of fa4dist
calls.  See the package docstring of :mod:`fa4dist.kernels` for the semantics."""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import fixed_point
from .merge import lse_as_out_layout, merge_into_, merge_sink_, sink_grad
from .problem import (EAGER_ONLY, AttentionProblem, Offset, accum_dtype, check_bool, check_buffer,
                      check_optional_bool, check_written, require_values, validate_inputs)
from .registry import check_backend, check_results, select_backend

Window = tuple[int, int]


def _accum_dtypes(problem: AttentionProblem) -> tuple[torch.dtype, ...]:
    return (accum_dtype(problem.dtype),)


def _fused_forward_with_sinks(impl, problem, q, k, v, sinks, out, lse, accumulate, acc_dtype):
    """A backend with ``fused_sinks`` puts the sinks into its epilogue's denominator when it writes a result.
    Otherwise (and always for an accumulate-merge) a fused-epilogue backend never sees them: it merges its block
    into the running result (then the sinks join it once), or writes the block in fp32, the sinks are merged and
    the result is rounded once."""
    if not accumulate and getattr(impl, "fused_sinks", False):
        return check_results(impl, "forward", impl.forward(problem, q, k, v, out=out, lse=lse, accumulate=False,
                                                           sinks=sinks),
                             dict(out=problem.out_shape(), lse=problem.lse_shape()), problem.device)
    if accumulate:
        impl.forward(problem, q, k, v, out=out, lse=lse, accumulate=True)
        merge_sink_(out, lse, sinks)
        return out, lse
    out32 = torch.empty(problem.out_shape(), dtype=acc_dtype, device=q.device)
    lse32 = lse if lse is not None else torch.empty(problem.lse_shape(), dtype=acc_dtype, device=q.device)
    impl.forward(problem, q, k, v, out=out32, lse=lse32, accumulate=False)
    merge_sink_(out32, lse32, sinks)
    if out is None:
        return out32.to(problem.dtype), lse32
    out.copy_(out32)
    return out, lse32


@torch.compiler.disable(reason=EAGER_ONLY)
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: Window = (-1, -1),
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
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
    be given as the running fp32 result; the block is merged into them in place and they are returned.  Not
    differentiable: the results carry no autograd history, whatever the inputs require (:func:`fa4dist.attention`
    is the differentiable form).

    - ``window=(left, right)``: flash-attn's ``window_size`` on global positions: the query at position p sees keys
      at positions in ``[p - left, p + right]``, ``-1`` meaning unbounded on that side, intersected with ``causal``
      and the documents (so causal + ``(W - 1, 0)`` is a sliding window of W tokens, the query included).
    - ``softcap``: the scores are ``softcap * tanh(softmax_scale * q.k / softcap)`` (Gemma 2); None: no capping.
      Within float32's range for float16 / bfloat16 / float32 inputs (their scores are float32).
    - ``softmax_scale``: None is ``1 / sqrt(head_dim)``; else finite and non-zero, and within float32's range in
      magnitude for float16 / bfloat16 / float32 inputs.
    - ``sinks``: (heads_q,) float logits, one per query head, that join every row's softmax denominator (GPT-OSS):
      the result includes them.  A sink must enter each row once: when a row's keys are split over several calls,
      pass ``sinks`` to exactly one of them (see :mod:`fa4dist.kernels.merge`).  A ``-inf`` sink is no sink; a
      ``+inf`` or NaN one is a non-finite score: its head's rows get out = lse = NaN (as for a non-finite key).
    """
    problem = validate_inputs(
        q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks, softmax_scale=softmax_scale,
        q_offset=q_offset, k_offset=k_offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        cp_invariant=cp_invariant,
    )
    q, k, v, sinks = _outside_autograd(q, k, v, sinks)
    return forward_problem(problem, q, k, v, sinks=sinks, out=out, lse=lse, accumulate=accumulate, backend=backend)


def _outside_autograd(*tensors):
    """The contract's inputs as tensors without autograd history (views of the same memory; anything else as it
    came, for the checks to name): its results are plain tensors whatever the inputs require, as a fused kernel's
    are, so the reference's in-place merges never record a graph into the caller's running buffers, nor its
    results a partial one (over the sinks alone, say).  :func:`fa4dist.attention` is the differentiable form."""
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)


def forward_problem(problem: AttentionProblem, q, k, v, *, sinks=None, out=None, lse=None, accumulate=False,
                    backend: str = "auto"):
    """:func:`attention_forward` of a problem that :func:`~fa4dist.kernels.problem.validate_inputs` made of these
    very tensors and options (the autograd function validates once for its forward and backward)."""
    require_values(problem)
    acc = _accum_dtypes(problem)
    check_bool("accumulate", accumulate)
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running out and lse to merge into (pass out= and lse=)")
    check_buffer("out", out, problem.out_shape(), problem.device, acc if accumulate else (problem.dtype,) + acc)
    check_buffer("lse", lse, problem.lse_shape(), problem.device, acc)
    check_written({"out": out, "lse": lse}, {"q": q, "k": k, "v": v, "sinks": sinks})
    if problem.batch == 0:  # no sequence: empty results, no backend to run (but a wrong name is still an error)
        check_backend(backend, problem.device)
        return (out if out is not None else torch.empty(problem.out_shape(), dtype=problem.dtype, device=q.device),
                lse if lse is not None else torch.empty(problem.lse_shape(), dtype=acc[0], device=q.device))
    impl = select_backend(backend, problem, "forward")
    results = dict(out=problem.out_shape(), lse=problem.lse_shape())
    if impl.fused_epilogue:
        if sinks is not None:
            return _fused_forward_with_sinks(impl, problem, q, k, v, sinks, out, lse, accumulate, acc[0])
        return check_results(impl, "forward", impl.forward(problem, q, k, v, out=out, lse=lse, accumulate=accumulate),
                             results, problem.device)
    block_out, block_lse = check_results(impl, "forward", impl.forward(problem, q, k, v), results, problem.device)
    if sinks is not None:  # the sinks' virtual key block, merged once, in the accumulation dtype
        block_out, block_lse = block_out.to(acc[0]), block_lse.to(acc[0])
        merge_sink_(block_out, block_lse, sinks)
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


@torch.compiler.disable(reason=EAGER_ONLY)
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    window: Window = (-1, -1),
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    q_offset: Offset = 0,
    k_offset: Offset = 0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    deterministic: Optional[bool] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    dsinks: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    backend: str = "auto",
    cp_invariant: bool = False,
    dq_scale: Optional[torch.Tensor] = None,
    dlse: Optional[torch.Tensor] = None,
):
    """Gradients of one block given the *global* out and lse (those of the whole key range, as a ring has them).

    Returns ``(dq, dk, dv)`` in q's dtype, or written into the given buffers; with ``accumulate=True`` the block's
    gradients are added to the given fp32 buffers, and a gradient without a buffer (dq, or dk and dv together) is
    not computed (returned as None; the CuTe kernels then skip its GEMMs).  ``deterministic=None`` follows
    ``torch.are_deterministic_algorithms_enabled()``.  The mask arguments are the forward's.

    With ``sinks`` it returns ``(dq, dk, dv, dsinks)``, dsinks (heads_q,) in fp32 (fp64 for fp64 inputs), written
    or (``accumulate=True``) added into ``dsinks=`` when given.  dq, dk, dv do not depend on it (the global lse
    already holds the sinks); dsinks sums over these rows, so pass ``sinks`` to one call per row, as forward.

    ``dq_scale`` (with ``cp_invariant=True``): the fixed-point dq (:mod:`fa4dist.kernels.fixed_point`).  With
    ``accumulate=True``, dq is an int64 buffer of fixed-point sums: each canonical key tile's contribution (tiles
    of ``KEY_TILE`` keys from the block's first key) times its row's scale (fp32 powers of two in lse's layout,
    from :func:`~fa4dist.kernels.fixed_point.dq_scale`) is truncated and added.  The order of those integer adds
    does not matter, so any split of the keys over calls (on tile boundaries) sums to the same bits.  With a float
    dq (fp32; fp64 for fp64 inputs) instead, the call's integer sums are converted once
    (:func:`~fa4dist.kernels.fixed_point.from_fixed`, to fp32 / fp64) and added.  With ``accumulate=False`` the
    converted sums are written (into dq, or returned, rounded from fp32 / fp64 to dq's dtype), and dk / dv are
    written as the accumulating form adds them into zeros (a signed zero comes out +0).  So when one call covers
    every key its rows see and every query its keys see, its results are the int64 route's, bit for bit, with no
    int64 or fp32 buffers (one device's form).

    ``dlse`` (lse's shape, fp32; fp64 for fp64 inputs): the gradient of the global lse too, for a loss of out and
    lse.  d lse / d s = P, so it joins the row sums D = rowsum(dout * out) as D - dlse (dS = P (dP - D + dlse)),
    and the sinks' term likewise; dv does not depend on it.  Backends with ``lse_gradient`` (the reference, cute)
    take it in the same pass; for the others the contract runs one more backward (:func:`lse_backward_operands`).
    As the global out and lse, it is the whole row's: pass it to every block of the row.  ``dout=None`` with
    ``dlse``: a loss of the lse alone (dv is zero; the two-pass backends run the lse's pass only).
    """
    problem = validate_inputs(
        q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks, softmax_scale=softmax_scale,
        q_offset=q_offset, k_offset=k_offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        cp_invariant=cp_invariant,
    )
    dout, q, k, v, out, lse, sinks, dq_scale, dlse = _outside_autograd(dout, q, k, v, out, lse, sinks, dq_scale, dlse)
    return backward_problem(problem, dout, q, k, v, out, lse, sinks=sinks, deterministic=deterministic, dq=dq, dk=dk,
                            dv=dv, dsinks=dsinks, accumulate=accumulate, backend=backend, dq_scale=dq_scale,
                            dlse=dlse)


def backward_problem(problem: AttentionProblem, dout, q, k, v, out, lse, *, sinks=None, deterministic=None,
                     dq=None, dk=None, dv=None, dsinks=None, accumulate=False, backend: str = "auto",
                     dq_scale=None, dlse=None):
    """:func:`attention_backward` of a problem already validated from these tensors and options (as
    :func:`forward_problem`)."""
    require_values(problem)
    acc = _accum_dtypes(problem)
    check_bool("accumulate", accumulate)
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if t is None and not (name == "dout" and dlse is not None):  # (dout None, dlse: a loss of the lse alone)
            raise ValueError(f"attention_backward needs {name} (the global forward result and its gradient; dout "
                             "may be None with dlse=, for a loss of the lse alone)")
    check_buffer("dout", dout, problem.out_shape(), problem.device, (problem.dtype,) + acc)
    check_buffer("out", out, problem.out_shape(), problem.device, (problem.dtype,) + acc)
    check_buffer("lse", lse, problem.lse_shape(), problem.device, acc)
    if accumulate and (dk is None) != (dv is None):
        raise ValueError("accumulate=True adds into the given fp32 buffers: give dk and dv both, or neither (then "
                         "neither is computed)")
    if accumulate and dq is None and dk is None:
        raise ValueError("accumulate=True needs fp32 buffers to add into: dq, or dk and dv, or all three")
    if dq_scale is not None:
        if not problem.cp_invariant:
            raise ValueError("dq_scale= (the fixed-point dq) needs cp_invariant=True")
        if accumulate and dq is None:
            raise ValueError("dq_scale= with accumulate=True needs a dq buffer (int64 sums, or a float dq the "
                             "converted sums are added to)")
        if sinks is not None:
            raise ValueError("the fixed-point dq does not support sinks (pass sinks=None)")
        check_buffer("dq_scale", dq_scale, problem.lse_shape(), problem.device, (torch.float32,))
    if dlse is not None:
        if dq_scale is not None:
            raise ValueError("dlse= (the lse's gradient) is not supported with the fixed-point dq (dq_scale=)")
        check_buffer("dlse", dlse, problem.lse_shape(), problem.device, acc)
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        want = acc if accumulate else (problem.dtype,) + acc
        if name == "dq" and dq_scale is not None and accumulate:
            want = (torch.int64,) + acc  # written (accumulate=False): the converted sums, in q's dtype or acc
        check_buffer(name, buf, tuple(like.shape), problem.device, want)
    if dsinks is not None:
        if sinks is None:
            raise ValueError("dsinks= is the buffer of the sinks' gradient: pass sinks= too")
        check_buffer("dsinks", dsinks, (problem.heads_q,), problem.device, acc)
    check_written({"dq": dq, "dk": dk, "dv": dv, "dsinks": dsinks},
                  {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "sinks": sinks, "dq_scale": dq_scale,
                   "dlse": dlse})
    if check_optional_bool("deterministic", deterministic) is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if problem.batch == 0:  # no sequence: empty gradients (None where accumulate=True asked for none)
        check_backend(backend, problem.device)
        grads = tuple(buf if buf is not None or accumulate else torch.empty(like.shape, dtype=problem.dtype,
                                                                            device=like.device)
                      for buf, like in ((dq, q), (dk, k), (dv, v)))
        if sinks is None:
            return grads
        if dsinks is not None and not accumulate:  # written: the gradient of no row is zero
            dsinks.zero_()
        return (*grads, dsinks if dsinks is not None else torch.zeros(problem.heads_q, dtype=acc[0],
                                                                      device=sinks.device))
    impl = select_backend(backend, problem, "backward")
    fixed = {}
    if dq_scale is not None:
        if not getattr(impl, "fixed_point_dq", False):
            raise ValueError(f"backend {impl.name!r} has no fixed-point dq (dq_scale=); the reference and cute do")
        fixed = dict(dq_scale=dq_scale)
    lse_in_pass = dlse is not None and getattr(impl, "lse_gradient", False)
    out_pass = dout is not None or lse_in_pass  # (no pass of a zero dout where the lse's has its own)
    if dout is None:  # out unused: its gradient is zero (the one pass's, and the sinks')
        dout = torch.zeros(problem.out_shape(), dtype=problem.dtype, device=problem.device)
    if lse_in_pass:
        fixed = dict(dlse=dlse)
    elif dlse is not None and impl.fused_epilogue:
        raise ValueError(f"backend {impl.name!r} writes its gradients itself and takes no dlse= (lse_gradient); "
                         "the reference and cute do")
    grads = dict(dq=tuple(q.shape), dk=tuple(k.shape), dv=tuple(v.shape))
    if impl.fused_epilogue:  # (a gradient without a buffer under accumulate=True is not computed: None)
        skipped = tuple(n for n, buf in zip(grads, (dq, dk, dv)) if buf is None) if accumulate else ()
        result = check_results(impl, "backward", impl.backward(
            problem, dout, q, k, v, out, lse, deterministic, dq=dq, dk=dk, dv=dv, accumulate=accumulate, **fixed
        ), grads, problem.device, skipped)
    else:
        if out_pass:
            block = list(check_results(impl, "backward", impl.backward(problem, dout, q, k, v, out, lse,
                                                                       deterministic, **fixed), grads, problem.device))
        if dlse is not None and not lse_in_pass:  # the lse's share: one more backward, with v = 0 (dv: none)
            # (in q's dtype, not out's: a fused op takes dout and out in it, and the sdpa backends cast an fp32 out)
            dout_p, v_p, out_p = lse_pass(dlse, out, v, problem.dtype)
            lse_block = check_results(impl, "backward", impl.backward(problem, dout_p, q, k, v_p, out_p, lse,
                                                                      deterministic), grads, problem.device)
            if out_pass:
                block[0], block[1] = block[0] + lse_block[0], block[1] + lse_block[1]
            else:  # (this pass's dv is P^T dout', not the loss's: zero)
                block = [lse_block[0], lse_block[1], torch.zeros_like(lse_block[2])]
        if dq_scale is not None and (dq is None or dq.dtype != torch.int64):  # the integer sums, converted once
            block[0] = fixed_point.from_fixed(block[0], dq_scale, acc[0])
        if dq_scale is not None and not accumulate:
            # written as the accumulating form adds them into zeros (-0 + 0 = +0): the same bits either way
            block[1], block[2] = block[1] + 0.0, block[2] + 0.0
        result = []
        for buf, g in zip((dq, dk, dv), block):
            if buf is None and accumulate:
                result.append(None)  # not asked for
            elif buf is None:
                result.append(g.to(problem.dtype))
            elif accumulate:
                result.append(buf.add_(g))
            else:
                result.append(buf.copy_(g))
    if sinks is None:
        return tuple(result)
    ds = sink_grad(dout, out, lse, sinks, dlse)
    if dsinks is None:
        dsinks = ds
    elif accumulate:
        dsinks.add_(ds)
    else:
        dsinks.copy_(ds)
    return (*result, dsinks)


def lse_pass(dlse: torch.Tensor, out: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(dout', v', out'): the operands of a backward pass (of any engine: one call, a ring, the invariant one) whose
    dq, dk (and dsinks) are the lse's gradient ``dlse`` alone: v' = 0, so dP = 0 and dv' is not a gradient of
    anything (:func:`lse_backward_operands` for dout' and out')."""
    dout_p, out_p = lse_backward_operands(dlse, out, dtype)
    return dout_p, torch.zeros_like(v), out_p


def lse_backward_operands(dlse: torch.Tensor, out: torch.Tensor,
                          dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dout', out'), out's shape in ``dtype`` (default out's), that make the contract's backward compute the lse's
    gradient ``dlse``.

    d lse_i / d s_ij = P_ij, so ``dlse`` joins the backward's dS = P (dP - D), D = rowsum(dout * out), as D - dlse:
    with v = 0 (dP = 0) and rowsum(dout' * out') = -dlse the backward's dq, dk (and with sinks dsinks, whose term
    is exp(sink - lse) * -D) are the lse's.  out' carries -dlse over up to three columns of ``dtype`` (its value
    and the rounding errors left: a 16-bit out holds it to ~fp32 precision), each against the same power of two
    2^e of the row in dout' (the backward forms D in fp32, where these products are exact).  dlse is fp32 (the
    lse's dtype) and float16 spans far less: 2^e brings out' near 2^9, so its first column is a normal number of
    ``dtype``, from |dlse| ~ 4e-9 to ~2e9 (65504 x 2^15) for float16 (over all of fp32's range for bfloat16; 1e5
    came out NaN and 1e-6 a float16 subnormal that lost 2%).  2^e stays a normal number of ``dtype``.  The
    contract passes q's dtype: a backend may cast dout and out to it (the sdpa ones do), which took an fp32 out's
    operands out of float16's range (an fp32 2^-32 became 0) and rounded their one fp32 column to 16 bits."""
    dtype = out.dtype if dtype is None else dtype
    acc = accum_dtype(dtype)
    target = -lse_as_out_layout(dlse.to(acc))[..., 0]
    finfo = torch.finfo(dtype)
    exponent = (torch.frexp(target).exponent - 9).clamp(round(math.log2(finfo.tiny)), math.floor(math.log2(finfo.max)))
    unit = torch.ldexp(torch.ones_like(target), exponent)  # (exact: a power of two of the dtype's normal range)
    remainder = target / unit
    out_p, dout_p = (torch.zeros(out.shape, dtype=dtype, device=out.device) for _ in range(2))
    for column in range(min(3, out.shape[-1])):
        part = remainder.to(dtype)
        out_p[..., column] = part
        dout_p[..., column] = unit.to(dtype)
        # (an infinite dlse is its first column alone: inf - inf would make the row NaN)
        remainder = torch.where(torch.isfinite(part), remainder - part.to(remainder.dtype), 0)
    return dout_p, out_p
