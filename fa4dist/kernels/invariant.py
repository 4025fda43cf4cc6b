"""cp_invariant numerics: one definition of every result that does not depend on how ranks split the work.

The rule (for any backend, compared with itself):

- a query row's ``out`` and ``lse`` come from one contract call whose keys are *all* the keys of the row's
  document (sequence or packed segment), starting at the document's first key: the backend's key tiles then sit
  at the same document positions whatever the layout, and a row's result depends only on the row;
- keys are cut into canonical tiles of ``fixed_point.KEY_TILE`` keys counted from the document's first key.  A
  key's ``dk`` and ``dv`` come from a call over whole canonical tiles (the one holding the key, or a run of them)
  against *all* queries of its document, starting at the first: the query tiles a key sums, and their order,
  are the same in every layout;
- a row's ``dq`` is the sum, over the canonical key tiles it sees, of each tile's contribution, each computed in a
  call over whole tiles and added in int64 fixed point (:mod:`fa4dist.kernels.fixed_point`) with a per-row scale
  fixed from layout-free maxima: integer sums do not depend on their order, so any assignment of tiles to calls
  and ranks gives the same integers, converted once;
- out, dk and dv are computed into fp32 buffers (``accumulate`` into zeros) and rounded to the input dtype once;
- GQA: keys and values are expanded to one head per query head, so ``dk``/``dv`` exist per query head, and a
  key/value head's gradient is the sum over its query heads in ascending head order (never a sum over a subset
  first, which is what a Ulysses head split would otherwise do);
- sinks join each row's fp32 (out, lse) once, after its keys and before the rounding of out
  (:func:`fa4dist.kernels.merge.merge_sink_`: elementwise per row); their gradient is each row's term
  (:func:`fa4dist.kernels.merge.sink_grad_terms`) summed over *every* row of the sequence in int64 fixed point
  (:func:`sink_grad`), so the caller needs all rows of a head (the gather engine has them).

One device computes it with one forward call per document and one backward call per document (all its key tiles:
dq, dk and dv at once; each row's integer dq sums, all in that one call, converted straight into a float dq);
context parallelism gathers the other ranks' keys (forward) and queries (backward), makes the calls for its own
rows and for the canonical tiles its keys start, and sums the int64 dq over the ranks
(:mod:`fa4dist.context_parallel.gather`).  Backends must be row-independent and deterministic, and have the
fixed-point dq (the reference and the CuTe kernels do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from . import fixed_point
from .api import attention_backward
from .merge import sink_grad_terms
from .problem import accum_dtype, check_optional_bool, check_softmax_scale, lse_shape_of
from .worklist import WorkItem, attention_forward_items, lse_token_rows, token_rows, uncovered_ranges


ENV = "FA4DIST_CP_INVARIANT"


def enabled(cp_invariant: Optional[bool]) -> bool:
    """The mode asked for: the argument, or (None) the environment variable FA4DIST_CP_INVARIANT: on for 1, true
    or yes, off for 0, false, no, empty or unset (any case, spaces around ignored); anything else is refused."""
    if cp_invariant is None:
        value = os.environ.get(ENV, "0").strip().lower()
        if value not in ("", "0", "1", "false", "true", "no", "yes"):
            raise ValueError(f"{ENV} must be 1 (or true, yes: on) or 0 (or false, no, empty: off), got "
                             f"{os.environ[ENV]!r}")
        return value in ("1", "true", "yes")
    return check_optional_bool("cp_invariant", cp_invariant)


def expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(..., heads_kv, d) -> (..., heads_kv * group, d): query head h reads key/value head h // group."""
    return t if group == 1 else t.repeat_interleave(group, dim=-2)


def sum_group(grad: torch.Tensor, group: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(..., heads_kv * group, d) per query head -> (..., heads_kv, d): the group's heads added in ascending order,
    in grad's dtype; ``dtype``: the sum rounded to it once, by the last addition (one pass less, the same bits as
    rounding the sum after)."""
    dtype = dtype or grad.dtype
    if group == 1:
        return grad.to(dtype)
    parts = grad.unflatten(-2, (-1, group))
    if group == 2:
        return torch.add(parts[..., 0, :], parts[..., 1, :], out=torch.empty_like(parts[..., 0, :], dtype=dtype))
    total = torch.add(parts[..., 0, :], parts[..., 1, :])
    for g in range(2, group - 1):
        total += parts[..., g, :]
    # computed in grad's dtype, written in dtype: the rounding of the finished sum
    return torch.add(total, parts[..., group - 1, :], out=torch.empty_like(total, dtype=dtype))


def forward(q, k, v, items: list[WorkItem], *, softmax_scale=None, softcap=None, backend="auto"):
    """(out fp32, lse) of the rows the items cover (every row by exactly one item); K/V per key/value head (GQA) or
    expanded per query head: a row reads the same values either way, and the backends give the same bits."""
    acc = accum_dtype(q.dtype)
    n_rows = q.shape[0 if q.dim() == 3 else 1]
    if uncovered_ranges(_written_rows(items)[0], 0, n_rows):  # rows no call writes hold (0, -inf)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full(lse_shape_of(q.shape), float("-inf"), dtype=acc, device=q.device)
    else:  # every row is written (fresh), none merged: no fill needed
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = torch.empty(lse_shape_of(q.shape), dtype=acc, device=q.device)
    attention_forward_items(q, k, v, items, out, lse, softmax_scale=softmax_scale, softcap=softcap, fresh=True,
                            backend=backend, cp_invariant=True)
    return out, lse


def sink_grad(dout, out, lse, sinks) -> torch.Tensor:
    """The sinks' gradient (heads,) over *all* rows of the sequence: ``-sum_rows`` of
    :func:`~fa4dist.kernels.merge.sink_grad_terms`, summed per head in int64 fixed point (each term times one power
    of two per head, 2^(61 - e) with ``rows * max|term| < 2^e``, truncated; :mod:`fa4dist.kernels.fixed_point`),
    negated and converted once, in fp32 (fp64 for fp64 inputs).  Integer sums do not depend on their order, so the
    bits depend only on the terms, never on the tensors' shapes (a Ulysses member's subset of heads) or the threads
    that add them.  A head with a non-finite term gets NaN."""
    terms = sink_grad_terms(dout, out, lse, sinks)  # (..., heads, seqlen)
    heads = terms.shape[-2]
    per_head = terms.movedim(-2, 0).reshape(heads, -1)
    bound = fixed_point.absmax(per_head, -1) * per_head.shape[1]
    scale = fixed_point.power_of_two_scale(bound).unsqueeze(-1)  # (heads, 1), NaN where the bound is not finite
    total = -fixed_point.to_fixed(per_head, scale).sum(-1)  # (negated as an integer: a zero sum is +0)
    return total * (1.0 / scale.squeeze(-1).double()).to(terms.dtype)  # the integer rounded once to the dtype


@dataclass(frozen=True)
class KeyCall:
    """One contract call of the invariant backward: all queries of a document against whole canonical key tiles.
    ``dq``: the call adds its tiles' fixed-point dq (False: the first tile starts in another caller's keys, which
    adds its dq; this call is for dk/dv).  Keys ``[keep, keep + keep_len)`` of the call are the caller's: their
    dk/dv go to rows ``[dest, dest + keep_len)`` of its buffers."""

    item: WorkItem
    dq: bool
    keep: int
    keep_len: int
    dest: int


def key_calls(q_start: int, q_len: int, k_start: int, k_len: int, pos: int, n: int, dest: int, *, causal: bool,
              window=(-1, -1)) -> list[KeyCall]:
    """The calls for a caller's keys at positions ``[pos, pos + n)`` of one document: its queries are rows
    ``[q_start, q_start + q_len)`` of q and its keys rows ``[k_start, k_start + k_len)`` of k (first of each at
    position 0); the keys' dk/dv go to rows ``[dest, dest + n)``.  At most two calls: the head of a tile that
    starts before ``pos`` (dk/dv only), then every tile that starts in ``[pos, pos + n)``, through the end of the
    last one (its keys past ``pos + n`` are another caller's: their dk/dv are computed and dropped)."""
    tile = fixed_point.KEY_TILE
    end = pos + n
    first = pos - pos % tile
    calls = []

    def item(lo, hi):
        return WorkItem(q_start, q_len, k_start + lo, hi - lo, 0, lo, causal=causal, window=window)

    if first < pos:
        tile_end = min(first + tile, k_len)
        calls.append(KeyCall(item(first, tile_end), False, pos - first, min(end, tile_end) - pos, dest))
        first += tile
    if first < end:
        stop = min(-(-end // tile) * tile, k_len)
        calls.append(KeyCall(item(first, stop), True, 0, end - first, dest + first - pos))
    return calls


def backward(dout, q, k, v, out, lse, calls: list[KeyCall], dq_fixed: torch.Tensor, dq_scale: torch.Tensor, dk,
             dv, *, softmax_scale=None, softcap=None, backend="auto"):
    """Adds the calls' int64 dq into ``dq_fixed`` (q's rows; ``dq_scale`` from :func:`fixed_point.dq_scale`) and
    writes the calls' kept dk/dv into the fp32 ``dk``/``dv`` (zeros; keys already expanded).  Packed
    ``(t, h, d)`` or dense ``(b, s, h, d)`` tensors (then every call applies to every batch element).
    ``dq_fixed`` may instead be a float dq of zeros when every row's keys are in one call (one device's calls):
    each call's integer sums are then converted once and added, the bits of the int64 route."""
    packed = q.dim() == 3
    seq_dim = 0 if packed else 1
    for call in calls:
        it = call.item
        if it.q_len == 0 or it.k_len == 0:
            continue
        qs, ks = (it.q_start, it.q_len), (it.k_start, it.k_len)
        rows = [token_rows(t, seq_dim, *qs, packed) for t in (dout, q, out)]
        keys = [token_rows(t, seq_dim, *ks, packed) for t in (k, v)]
        kept = [token_rows(t, seq_dim, call.dest, call.keep_len, packed) for t in (dk, dv)]
        whole = call.keep == 0 and call.keep_len == it.k_len
        grads = kept if whole else [torch.zeros(t.shape, dtype=dk.dtype, device=t.device) for t in keys]
        attention_backward(
            rows[0], rows[1], keys[0], keys[1], rows[2], lse_token_rows(lse, packed, *qs),
            softmax_scale=softmax_scale, softcap=softcap, deterministic=True, accumulate=True, backend=backend,
            cp_invariant=True, dq=token_rows(dq_fixed, seq_dim, *qs, packed) if call.dq else None,
            dq_scale=lse_token_rows(dq_scale, packed, *qs) if call.dq else None, dk=grads[0], dv=grads[1],
            **it.mask_kwargs(),
        )
        if not whole:
            for dst, src in zip(kept, grads):
                dst.copy_(src.narrow(1, call.keep, call.keep_len))


def single_device_backward(dout, q, k, v, out, lse, items: list[WorkItem], *, softmax_scale=None, softcap=None,
                           backend="auto"):
    """(dq, dk, dv) of one device in the inputs' dtypes (GQA: dk / dv summed over each key / value head's query
    heads): one call per item (a document's queries against all its keys, from :func:`single_device_items`).

    Each row's keys and each key's queries are in its item's one call, so the calls *write* their gradients
    (``accumulate=False``): the integer dq sums converted straight into q's dtype, dk / dv as the accumulating form
    adds them into zeros.  That is the bits of the context-parallel route (int64 dq, fp32 dk / dv buffers) without
    its buffers, zero fills and fp32 round trips."""
    group = q.shape[-2] // k.shape[-2]
    packed = q.dim() == 3
    seq_dim = 0 if packed else 1
    # the bounds of the heads as they are (a query head's expanded copy has the same entries), then the expansion
    (k_max, v_max), sees = fixed_point.visible_key_bounds((k, v), items, q.shape[seq_dim])
    k_max, v_max = (t.repeat_interleave(group, dim=-1) for t in (k_max, v_max))
    k, v = expand_kv(k, group), expand_kv(v, group)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    dq_scale = fixed_point.dq_scale(dout, out, k_max, v_max, scale, sees)
    # GQA: dk / dv per query head in fp32 (summed over the group below, then rounded once), else in k's dtype
    grad_dtype = k.dtype if group == 1 else accum_dtype(q.dtype)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (k, v))
    q_rows, k_rows = _written_rows(items)
    for a, b in uncovered_ranges(q_rows, 0, q.shape[seq_dim]):
        token_rows(dq, seq_dim, a, b - a, packed).zero_()
    for a, b in uncovered_ranges(k_rows, 0, k.shape[seq_dim]):
        for t in (dk, dv):
            token_rows(t, seq_dim, a, b - a, packed).zero_()
    for it in items:
        if it.q_len == 0 or it.k_len == 0:
            continue
        qs, ks = (it.q_start, it.q_len), (it.k_start, it.k_len)
        rows = [token_rows(t, seq_dim, *qs, packed) for t in (dout, q, out, dq)]
        keys = [token_rows(t, seq_dim, *ks, packed) for t in (k, v, dk, dv)]
        attention_backward(
            rows[0], rows[1], keys[0], keys[1], rows[2], lse_token_rows(lse, packed, *qs),
            softmax_scale=softmax_scale, softcap=softcap, deterministic=True, backend=backend, cp_invariant=True,
            dq=rows[3], dq_scale=lse_token_rows(dq_scale, packed, *qs), dk=keys[2], dv=keys[3], **it.mask_kwargs(),
        )
    if group > 1:
        dk, dv = (sum_group(g, group, k.dtype) for g in (dk, dv))
    return dq, dk, dv


def _written_rows(items: list[WorkItem]) -> tuple[list, list]:
    """The query and key row ranges the items' calls write (calls with no rows or no keys are skipped)."""
    live = [it for it in items if it.q_len > 0 and it.k_len > 0]
    return ([(it.q_start, it.q_start + it.q_len) for it in live], [(it.k_start, it.k_start + it.k_len) for it in live])


def single_device_items(problem) -> list[WorkItem]:
    """One item per sequence (dense) or segment (packed): all its queries against all its keys."""
    mask = dict(causal=problem.mask.causal, window=problem.mask.window)
    if not problem.varlen:
        if problem.batch == 0:
            return []
        return [WorkItem(0, problem.seqlen_q, 0, problem.seqlen_k, problem.q_offsets[0], problem.k_offsets[0], **mask)]
    return [WorkItem(qs, ql, ks, kl, qo, ko, **mask) for _, qs, ql, ks, kl, qo, ko in problem.segments()]
