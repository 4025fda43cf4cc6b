"""Merging partial attention results: the one implementation of the log-sum-exp combine.

A partial result over a subset of the keys is ``(out_i, lse_i)`` with ``out_i`` already normalized over that
subset.  Over the union, ``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i``.  All math is
in fp32 (fp64 for fp64 inputs).  A side whose ``lse`` is ``-inf`` saw no key and contributes nothing; when every
side is ``-inf`` the merged result is ``out = 0, lse = -inf``, never NaN.

Layouts follow the kernel contract: out (..., seqlen, heads, head_dim) with lse (..., heads, seqlen); that is
(batch, seqlen, heads, d) with (batch, heads, seqlen), or packed (total, heads, d) with (heads, total).

Attention sinks (one learnable logit ``sink_h`` per query head, GPT-OSS style) join every row's softmax
denominator once: the softmax runs over the row's visible keys plus a virtual key of score ``sink_h`` whose value is
zero.  That virtual key is one more partial result, ``(out = 0, lse = sink_h)`` for every row, and it must be
merged exactly once per row however the real keys are split (:func:`merge_sink_` / :func:`with_sink`); merged
twice it would count twice.  A sink of ``-inf`` weighs nothing (no sink); a ``+inf`` or NaN sink is a non-finite
score every row of its head sees, so those rows' softmax is undefined and their out and lse are NaN, rows that see
no real key included (what :func:`merge_partials` makes of the partial ``(0, sink_h)``).  The backward needs nothing
new for dq, dk, dv (the global lse already holds the sink); the sink's own gradient is
``dsink_h = -sum_rows exp(sink_h - lse) * rowsum(dout * out)`` over every row of head ``h``, again once per row
(:func:`sink_grad`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .fixed_point import power_of_two_below
from .problem import FLOAT_DTYPES, accum_dtype, check_buffer, check_sinks, check_written


def lse_as_out_layout(lse: torch.Tensor) -> torch.Tensor:
    """View of an lse (..., heads, seqlen) broadcastable against out (..., seqlen, heads, d)."""
    return lse.transpose(-1, -2).unsqueeze(-1)


def check_partial(name: str, out: torch.Tensor, lse: torch.Tensor, like_out: Optional[torch.Tensor] = None) -> None:
    """Raises a clear error unless (out, lse) is a partial result in the contract's layout (and shaped like
    ``like_out`` when given)."""
    for what, t in ((f"{name} out", out), (f"{name} lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if lse.device != out.device:
        raise ValueError(f"{name}: lse is on {lse.device} but its out is on {out.device}")
    if out.dim() < 3 or lse.dim() != out.dim() - 1:
        raise ValueError(
            f"{name}: out must be (..., seqlen, heads, head_dim) with lse (..., heads, seqlen), got out "
            f"{tuple(out.shape)} and lse {tuple(lse.shape)}"
        )
    expected = tuple(out.shape[:-3]) + (out.shape[-2], out.shape[-3])
    if tuple(lse.shape) != expected:
        raise ValueError(f"{name}: lse must have shape {expected} for out of shape {tuple(out.shape)}, got "
                         f"{tuple(lse.shape)}")
    if like_out is not None and out.shape != like_out.shape:
        raise ValueError(f"{name}: out has shape {tuple(out.shape)} but the other partial results have "
                         f"{tuple(like_out.shape)}")
    if like_out is not None and out.device != like_out.device:
        raise ValueError(f"{name}: out is on {out.device} but the other partial results are on {like_out.device}")


def _check_running(out: torch.Tensor, lse: torch.Tensor) -> None:
    """A running result merged into in place: a partial result in fp32 (fp64 for fp64 inputs), out and lse alike.
    The in-place merges also check it with :func:`~fa4dist.kernels.problem.check_written` against what they read
    (the block is read after out has been scaled in place)."""
    check_partial("the running result", out, lse)
    if out.dtype not in (torch.float32, torch.float64) or lse.dtype != out.dtype:
        raise TypeError(f"the running out/lse must both be float32 (or float64), got {out.dtype} and {lse.dtype}")


def _unseen(lse: torch.Tensor) -> torch.Tensor:
    """Rows of a partial result that saw no key (lse -inf), broadcastable against its out."""
    return lse_as_out_layout(torch.isneginf(lse))


def _merge_weights(lses: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Normalized weights exp(lse_i - lse) and the merged lse, stable and safe for -inf entries."""
    peak = lses[0]
    for lse in lses[1:]:
        peak = torch.maximum(peak, lse)
    # Rows where every side is -inf: shift by 0 so exp gives 0 instead of NaN.
    shift = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak)
    exps = [torch.exp(lse - shift) for lse in lses]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    # Rows no side saw get -inf, not log(0): the same value, but log's derivative there is inf, and a second
    # derivative through this merge (create_graph) would turn the rows' zero weights into NaN
    # (a NaN total keeps its NaN lse)
    unseen = total == 0
    merged = torch.where(unseen, torch.full_like(total, float("-inf")),
                         shift + torch.log(torch.where(unseen, torch.ones_like(total), total)))
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    return [e / safe_total for e in exps], merged


def merge_into_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merges a block's (block_out, block_lse) into the running fp32 (out, lse), in place.

    Three passes over ``out``: scale, clear the rows that had seen no key (whatever they held, NaN included), add
    the weighted block.  As in :func:`merge_partials`, the block's rows whose ``block_lse`` is -inf (no key) add
    nothing, whatever ``block_out`` holds there (NaN included).  Not differentiable (:func:`merge_partials` is): a
    block that requires grad records no graph into the running buffers."""
    _check_running(out, lse)
    check_partial("the block", block_out, block_lse, like_out=out)
    check_written({"out": out, "lse": lse}, {"block_out": block_out, "block_lse": block_lse})
    block_out, block_lse = block_out.detach(), block_lse.detach()  # (a graph here broke the next in-place merge)
    (w_run, w_blk), merged = _merge_weights([lse, block_lse.to(lse.dtype)])
    # rows that saw no key (lse -inf) are cleared; a row that saw keys keeps a NaN it holds even where its weight
    # underflows to 0 (a row that sees a non-finite value is NaN however its keys are split)
    out.mul_(lse_as_out_layout(w_run)).masked_fill_(_unseen(lse), 0.0)
    out.addcmul_(block_out.masked_fill(_unseen(block_lse), 0.0), lse_as_out_layout(w_blk))
    lse.copy_(merged)


def _listed(name: str, partials) -> list:
    """The partials of merge_partials as a list: a list, a tuple, a generator, a tensor stacked along dim 0."""
    try:
        return list(partials)
    except TypeError:
        raise TypeError(f"merge_partials: {name} must be an iterable of tensors, got {type(partials).__name__}") \
            from None


def merge_partials(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N-way merge in the fixed order given (so the result is bitwise reproducible for a fixed order). A partial whose
    lse is -inf contributes nothing, whatever its out holds there.

    Returns (out, lse) in fp32 (fp64 when any partial is fp64: the order of the partials does not change the
    precision); writes into ``out`` when given (of the partials' shape and device, in that dtype)."""
    outs, lses = _listed("outs", outs), _listed("lses", lses)
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_partials needs as many outs as lses (at least one), got {len(outs)} and {len(lses)}")
    for i, (o, lse) in enumerate(zip(outs, lses)):
        check_partial(f"merge_partials: partial {i}", o, lse, like_out=outs[0])
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != outs[0].shape):
        raise ValueError(f"merge_partials: out must be a tensor of shape {tuple(outs[0].shape)}, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    dtype = torch.float64 if any(accum_dtype(o.dtype) == torch.float64 for o in outs) else torch.float32
    check_buffer("merge_partials: out", out, tuple(outs[0].shape), outs[0].device, (dtype,))
    # out may be one of the partials (it is written once, after every read), not a broadcast view
    check_written({"merge_partials: out": out}, {})
    weights, merged = _merge_weights([lse.to(dtype) for lse in lses])
    # a side whose lse is -inf (it saw no key) contributes nothing, whatever its out holds (NaN included); a side
    # that saw keys keeps its NaN even where its weight underflows to 0
    sides = [(o.masked_fill(_unseen(lse), 0.0), lse_as_out_layout(w)) for o, lse, w in zip(outs, lses, weights)]
    acc = sides[0][0].to(dtype) * sides[0][1]
    for o, w in sides[1:]:
        acc.addcmul_(o, w)
    if out is not None:
        out.copy_(acc)
        acc = out
    return acc, merged


def _sink_lse(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The virtual key block's lse, broadcast like ``lse`` (..., heads, seqlen): ``sinks[h]`` on every row."""
    check_sinks(sinks, lse.shape[-2], lse.device)
    return sinks.to(lse.dtype).view(-1, 1).expand(lse.shape)


def _sink_weights(lse: torch.Tensor, sinks: torch.Tensor):
    """(the running result's weight, rows whose sink term is undefined (broadcastable against out), merged lse).
    The sink's value is 0, so its term ``w_sink * 0`` is not added, but a NaN weight (a +inf or NaN sink, or a NaN
    lse) must still make the row NaN, as it does in :func:`merge_partials`."""
    (w_run, w_sink), merged = _merge_weights([lse, _sink_lse(lse, sinks)])
    return w_run, lse_as_out_layout(torch.isnan(w_sink)), merged


def merge_sink_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Merges the sinks' virtual key block into the running fp32 (out, lse), in place (once per row!).  Not
    differentiable (:func:`with_sink` is): learnable sinks (a Parameter) record no graph into the running buffers,
    which the next in-place merge into them then refused as buffers that require grad."""
    _check_running(out, lse)
    check_written({"out": out, "lse": lse}, {"sinks": sinks})
    sinks = sinks.detach() if isinstance(sinks, torch.Tensor) else sinks
    w_run, undefined, merged = _sink_weights(lse, sinks)
    out.mul_(lse_as_out_layout(w_run)).masked_fill_(_unseen(lse), 0.0).masked_fill_(undefined, float("nan"))
    lse.copy_(merged)


def with_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place (and differentiable) :func:`merge_sink_`: returns the (out, lse) of the keys plus the sink."""
    check_partial("the result", out, lse)
    w_run, undefined, merged = _sink_weights(lse, sinks)
    scaled = out * lse_as_out_layout(w_run)
    scaled = torch.where(_unseen(lse), torch.zeros((), dtype=scaled.dtype, device=scaled.device), scaled)
    return torch.where(undefined, torch.full((), float("nan"), dtype=scaled.dtype, device=scaled.device),
                       scaled), merged


def sink_grad_terms(dout: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                    dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's term of the sinks' gradient, ``exp(sink - lse) * rowsum(dout * out)`` (..., heads, seqlen) like
    ``lse``, in fp32 (fp64 for fp64 inputs), given the rows' *global* out and lse (sink included); 0 for a row whose
    lse is ``-inf`` (no key, no sink).  The gradient is minus their sum over the rows (:func:`sink_grad`).  Each
    term is a function of its own row: the row sum runs over one contiguous last axis.  ``dlse`` (lse's layout):
    the lse's gradient, whose share ``exp(sink - lse) * dlse`` (d lse / d sink) each term loses.  ``dout=None``:
    out unused (a loss of the lse alone), its terms zero."""
    check_partial("the result", out, lse)
    check_buffer("sink_grad: dout", dout, tuple(out.shape), out.device, FLOAT_DTYPES)  # (None: passes)
    check_buffer("sink_grad: dlse", dlse, tuple(lse.shape), lse.device, FLOAT_DTYPES)  # (None: passes)
    acc = accum_dtype(out.dtype)
    lse = lse.to(acc)
    sink = _sink_lse(lse, sinks)
    seen = ~torch.isneginf(lse)
    zero = torch.zeros((), dtype=acc, device=lse.device)
    share = torch.exp(sink - torch.where(seen, lse, zero))  # the sink's share of the row's softmax
    terms = torch.zeros_like(share) if dout is None else _out_terms(dout, out, share)
    if dlse is not None:
        terms = terms - share * dlse.to(acc)
    return torch.where(seen, terms, zero)


def _out_terms(dout: torch.Tensor, out: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """:func:`sink_grad_terms`' out terms, ``share * rowsum(dout * out)`` in share's layout and dtype."""
    acc = share.dtype
    # rowsum(dout * out) overflows near the top of the range (64 x 1e37) where the term, times the sink's small share,
    # need not: each row of dout and of out is brought below 1 by a power of two first and the sum brought back after
    # the share, which is exact (the same bits) wherever the scaled values stay normal, with no data-dependent branch
    # (no host sync on the backward's path).  A row with a non-finite dout or out stays non-finite.
    on_device = _row_dot_kernel(dout, out)
    if on_device is not None:  # the same sums in one read of the bf16 rows (cute/row_dot.py; bf16 out: fp32 sums)
        delta, f_dout, f_out = (t.transpose(-1, -2) for t in on_device)
    else:
        dout_s, out_s = (_power_of_two_below_rows(t.to(acc)) for t in (dout, out))
        product = dout_s[0] * out_s[0]
        if product.stride(-1) != 1:  # (a strided axis is summed in another order)
            product = product.contiguous()
        delta = product.sum(-1).transpose(-1, -2)  # (..., heads, seqlen) like lse, times both rows' factors
        f_dout, f_out = dout_s[1], out_s[1]
    # one factor after the other (each a normal number, their product need not be), the larger first: the value
    # shrinks before it grows
    return share * delta / torch.maximum(f_dout, f_out) / torch.minimum(f_dout, f_out)


def _row_dot_kernel(dout: torch.Tensor, out: torch.Tensor):
    """(scaled row sums of dout * out, dout's row factors, out's), each (..., seqlen, heads), by
    ``kernels/cute/row_dot.py`` (the torch form reads and writes fp32 copies ~14 times: +5% on a forward+backward);
    None where it does not apply (not bf16 CUDA rows it takes, or no CuTe DSL). The choice depends on the
    device, dtypes and row length only, never the layout: a row's term has the same bits in every layout."""
    if not (dout.is_cuda and dout.dtype == out.dtype == torch.bfloat16):
        return None
    from .cute import host

    if not host.cutlass_importable():
        return None
    from .cute.row_dot import row_dot_scaled

    return row_dot_scaled(dout, out)


def _power_of_two_below_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t with each row (last axis) times a power of two that brings its largest |entry| below 1, the factors in
    lse's layout (..., heads, seqlen))."""
    factor = power_of_two_below(t.abs().amax(-1, keepdim=True))
    return t * factor, factor.squeeze(-1).transpose(-1, -2)


def sink_grad(dout: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
              dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of the sinks (heads,) from these rows, given their *global* out and lse (sink included), in
    fp32 (fp64 for fp64 inputs): ``-sum_rows exp(sink - lse) * (rowsum(dout * out) - dlse)`` (``dlse``: the lse's
    gradient, if any; ``dout=None``: out unused).  A row whose lse is ``-inf`` (no key, no sink) contributes
    nothing."""
    per_row = sink_grad_terms(dout, out, lse, sinks, dlse)
    # over every dim but the heads' (reshape(-1, ...) cannot infer its size when there are no rows)
    return -per_row.sum(dim=[d for d in range(per_row.dim()) if d != per_row.dim() - 2])
