"""Non-finite inputs for fused kernels that would leak them through masked pairs.

Inside a tile that the mask cuts, a fused kernel multiplies a masked probability (exactly 0) by the value, key,
query or output gradient of the masked pair; ``0 x NaN`` is NaN, so padding garbage at a future (or out-of-window)
position poisons rows that never see it, and the pattern depends on how a sequence is split.  The contract says a
masked pair contributes nothing (see :mod:`fa4dist.kernels.reference`, which computes it exactly).

For a kernel that cannot be changed (torch's fused ops), this module applies the rule around the call, for blocks
whose mask is a band in local indices: row ``i`` sees keys ``j`` with ``lo <= j - i <= hi`` (None: unbounded) of
its segment.  An aligned causal block (``lo = None, hi = 0``) is one; a sliding-window block is another.

- *clean*: every non-finite token vector (a query, key, value, output or output-gradient row) is replaced by zeros,
  so the kernel's masked products are ``0 x 0``;
- *poison*: every result that depends on a non-finite input through a visible pair is set to NaN afterwards: an
  output row (and its lse when a key or the query itself was bad) that sees a bad key or value, a key's dk/dv when a
  bad query row sees it (dv: a row whose query, lse or output gradient is bad; it does not read out or v).

On finite input the cleaned tensors equal the originals, so results are bitwise unchanged; the cost is one pass
over the inputs.  Layouts: dense ``(batch, seqlen, heads, d)`` with lse ``(batch, heads, seqlen)`` (any q and k
lengths, the band on local indices), or packed ``(tokens, heads, d)`` with lse ``(heads, tokens)`` and one
``cu_seqlens`` for q and k (square segments, the band on indices within each segment).
"""

from __future__ import annotations

from typing import Optional

import torch


def _bad_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """(..., tokens, heads) True where any of the tensors' head vectors holds a non-finite entry: one reduction
    per tensor (the max |x| of each vector, which NaN and inf both make non-finite), no full-size temporary."""
    bad = None
    for t in tensors:
        b = ~torch.isfinite(torch.linalg.vector_norm(t, ord=float("inf"), dim=-1))
        bad = b if bad is None else bad | b
    return bad


def _clean(t: torch.Tensor) -> torch.Tensor:
    """Every non-finite entry zeroed (one vectorised pass). Zeroing the entries rather than the rows they sit in
    gives the same results: the masked products are 0 x finite either way, and everything a bad row reaches
    through a visible pair is poisoned afterwards."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def _band_any(flags: torch.Tensor, n_out: int, lo: Optional[int], hi: Optional[int],
              cu: Optional[torch.Tensor]) -> torch.Tensor:
    """For flags (..., m, heads) along the token dim: (..., n_out, heads), entry i True if any flag is set at an
    index j with ``lo <= j - i <= hi`` (None: unbounded) in i's segment (``cu``, shared by both sides: n_out == m;
    else the whole range [0, m))."""
    m, device = flags.shape[-2], flags.device
    if cu is None and (lo is None or hi is None) and m > 0:
        # a half-open band (causal, and the rows that see a key under it): only the first / last flag matters
        idx = torch.arange(n_out, device=device).view(-1, 1)
        pos = torch.arange(m, device=device).view(-1, 1)
        if lo is None:  # keys [0, i + hi]: some flag at j <= i + hi
            first = torch.where(flags, pos, m).amin(-2, keepdim=True)
            hit = first < m  # (first == m: no flag)
            if hi is not None:
                hit = hit & (first <= idx + hi)
        else:  # keys [i + lo, m): some flag at j >= i + lo
            last = torch.where(flags, pos, -1).amax(-2, keepdim=True)
            hit = (last >= 0) & (last >= idx + lo)
        return hit.expand(*flags.shape[:-2], n_out, flags.shape[-1])
    # the prefix count runs along the last, contiguous dim: torch's scan over an outer dim took 2.9 ms for 16k
    # tokens x 16 heads on the H200 (2026-12-01), the innermost scan is a few microseconds
    tokens_last = flags.transpose(-1, -2).to(torch.int32).contiguous()
    zero = tokens_last.new_zeros(*tokens_last.shape[:-1], 1)  # (not a slice of it: there may be no token)
    counts = torch.cat([zero, tokens_last.cumsum(-1, dtype=torch.int32)], -1)  # counts[j] = flags set before j
    idx = torch.arange(n_out, device=device)
    if cu is None:
        seg_lo, seg_hi = torch.zeros_like(idx), torch.full_like(idx, m)
    else:
        cu = cu.to(device=device, dtype=torch.int64)
        seg = torch.searchsorted(cu, idx, right=True) - 1
        seg_lo, seg_hi = cu[seg], cu[seg + 1]
    start = seg_lo if lo is None else torch.minimum(torch.maximum(idx + lo, seg_lo), seg_hi)
    end = seg_hi if hi is None else torch.minimum(torch.maximum(idx + hi + 1, seg_lo), seg_hi)
    end = torch.maximum(end, start)
    return ((counts.index_select(-1, end) - counts.index_select(-1, start)) > 0).transpose(-1, -2)


def _seen_by(lo: Optional[int], hi: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """The band of rows that see key j (row - key), from the band of keys row i sees (key - row)."""
    return (None if hi is None else -hi), (None if lo is None else -lo)


def _to_query_heads(flags: torch.Tensor, heads_q: int) -> torch.Tensor:
    return flags.repeat_interleave(heads_q // flags.shape[-1], dim=-1)


def _to_kv_heads(flags: torch.Tensor, heads_kv: int) -> torch.Tensor:
    return flags.unflatten(-1, (heads_kv, flags.shape[-1] // heads_kv)).any(-1)


def _lse_layout(flags: torch.Tensor) -> torch.Tensor:
    """(..., tokens, heads) -> the lse layout (..., heads, tokens)."""
    return flags.transpose(-1, -2)


NAN = float("nan")


def guarded_forward(kernel, q, k, v, lo: Optional[int] = None, hi: Optional[int] = 0, cu_seqlens=None):
    """``kernel(q, k, v) -> (out, lse)`` for a block whose row i sees keys ``lo <= j - i <= hi`` (every row at
    least one), with the clean/poison rule."""
    bad_k, bad_v, bad_q = _bad_rows(k), _bad_rows(v), _bad_rows(q)
    out, lse = kernel(q, _clean(k), _clean(v))
    n, heads_q = q.shape[-3], q.shape[-2]
    # keys and values in one band query (each op costs host time: at short sequences the guard is host-bound)
    sees_bad_k, sees_bad_v = _to_query_heads(_band_any(torch.stack((bad_k, bad_v)), n, lo, hi, cu_seqlens),
                                             heads_q).unbind(0)
    lse_bad = sees_bad_k | bad_q
    out = out.masked_fill((lse_bad | sees_bad_v).unsqueeze(-1), NAN)
    lse = lse.masked_fill(_lse_layout(lse_bad), NAN)
    return out, lse


def guarded_backward(kernel, dout, q, k, v, out, lse, lo: Optional[int] = None, hi: Optional[int] = 0,
                     cu_seqlens=None):
    """``kernel(dout, q, k, v, out, lse) -> (dq, dk, dv)`` for a block whose row i sees keys ``lo <= j - i <= hi``,
    with the clean/poison rule (a row is bad if its query, output, output gradient or lse is not finite)."""
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    n, m = q.shape[-3], k.shape[-3]
    # dv_j = sum_i P_ij dout_i reads neither v_j nor out_i (only dq and dk go through dP = dout v^T and
    # rowsum(dout * out)): those leave dv finite, as in the reference
    bad_p_row = _bad_rows(q, dout) | ~torch.isfinite(_lse_layout(lse))  # rows whose P or dout is not finite
    bad_row = bad_p_row | _bad_rows(out)
    bad_k = _bad_rows(k)
    bad_key = bad_k | _bad_rows(v)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    dq, dk, dv = kernel(_clean(dout), _clean(q), _clean(k), _clean(v), _clean(out),
                        torch.where(_lse_layout(bad_row), zero, lse))
    row_poisoned = bad_row | _to_query_heads(_band_any(bad_key, n, lo, hi, cu_seqlens), heads_q)
    seen_by_bad, seen_by_bad_p = _to_kv_heads(
        _band_any(torch.stack((bad_row, bad_p_row)), m, *_seen_by(lo, hi), cu_seqlens), heads_kv).unbind(0)

    def poison(g, flags):
        return g.masked_fill(flags.unsqueeze(-1), NAN)

    return poison(dq, row_poisoned), poison(dk, bad_key | seen_by_bad), poison(dv, bad_k | seen_by_bad_p)


def guarded_causal_forward(kernel, q, k, v, cu_seqlens=None):
    """:func:`guarded_forward` for an aligned causal block (query i sees keys 0..i of its segment)."""
    return guarded_forward(kernel, q, k, v, None, 0, cu_seqlens)


def guarded_causal_backward(kernel, dout, q, k, v, out, lse, cu_seqlens=None):
    """:func:`guarded_backward` for an aligned causal block."""
    return guarded_backward(kernel, dout, q, k, v, out, lse, None, 0, cu_seqlens)
