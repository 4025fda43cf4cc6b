"""Non-finite inputs for fused kernels that would leak them through masked pairs.

Inside a tile that the causal mask cuts, a fused kernel multiplies a masked probability (exactly 0) by the value,
key, query or output gradient of the masked pair; ``0 x NaN`` is NaN, so padding garbage at a future position
poisons rows that never see it, and the pattern depends on how a sequence is split.  The contract says a masked
pair contributes nothing (see :mod:`fa4dist.kernels.reference`, which computes it exactly).

For a kernel that cannot be changed (torch's fused ops), this module applies the rule around the call, for the
aligned causal blocks (query i sees keys 0..i of its segment) where masked pairs share tiles with visible ones:

- *clean*: every non-finite token vector (a query, key, value, output or output-gradient row) is replaced by zeros,
  so the kernel's masked products are ``0 x 0``;
- *poison*: every result that depends on a non-finite input through a visible pair is set to NaN afterwards: an
  output row (and its lse when a key or the query itself was bad) that sees a bad key or value, a key's dk/dv when a
  bad query row sees it.

On finite input the cleaned tensors equal the originals, so results are bitwise unchanged; the cost is one pass
over the inputs.  Layouts: dense ``(batch, seqlen, heads, d)`` with lse ``(batch, heads, seqlen)``, or packed
``(tokens, heads, d)`` with lse ``(heads, tokens)`` and ``cu_seqlens`` (square segments, diagonal i == j).
"""

from __future__ import annotations

from typing import Optional

import torch


def _bad_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """(..., tokens, heads) True where any of the tensors' head vectors holds a non-finite entry."""
    bad = None
    for t in tensors:
        b = ~torch.isfinite(t).all(-1)
        bad = b if bad is None else bad | b
    return bad


def _clean(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _segment_scan(flags: torch.Tensor, cu: Optional[torch.Tensor], reverse: bool) -> torch.Tensor:
    """For flags (..., tokens, heads): whether any flag is set at or before (``reverse``: at or after) each token
    within its segment (a whole sequence for the dense layout, a ``cu_seqlens`` segment for packed)."""
    dim = flags.dim() - 2
    x = flags.flip(dim) if reverse else flags
    counts = x.to(torch.int64).cumsum(dim)
    if cu is not None:
        n = flags.shape[dim]
        cu = cu.to(device=flags.device, dtype=torch.int64)
        bounds = cu.flip(0).neg() + n if reverse else cu  # segment starts in the (possibly flipped) order
        bounds = bounds.sort().values
        start = bounds[torch.searchsorted(bounds, torch.arange(n, device=flags.device), right=True) - 1]
        before = counts.index_select(dim, (start - 1).clamp_min(0)) * (start > 0).view(-1, 1)
        counts = counts - before
    seen = counts > 0
    return seen.flip(dim) if reverse else seen


def _to_query_heads(flags: torch.Tensor, heads_q: int) -> torch.Tensor:
    return flags.repeat_interleave(heads_q // flags.shape[-1], dim=-1)


def _to_kv_heads(flags: torch.Tensor, heads_kv: int) -> torch.Tensor:
    return flags.unflatten(-1, (heads_kv, flags.shape[-1] // heads_kv)).any(-1)


def _lse_layout(flags: torch.Tensor) -> torch.Tensor:
    """(..., tokens, heads) -> the lse layout (..., heads, tokens)."""
    return flags.transpose(-1, -2)


NAN = float("nan")


def guarded_causal_forward(kernel, q, k, v, cu_seqlens=None):
    """``kernel(q, k, v) -> (out, lse)`` for an aligned causal block, with the clean/poison rule."""
    bad_k, bad_v, bad_q = _bad_rows(k), _bad_rows(v), _bad_rows(q)
    out, lse = kernel(q, _clean(k, bad_k), _clean(v, bad_v))
    sees_bad_k = _to_query_heads(_segment_scan(bad_k, cu_seqlens, reverse=False), q.shape[-2])
    sees_bad_v = _to_query_heads(_segment_scan(bad_v, cu_seqlens, reverse=False), q.shape[-2])
    lse_bad = sees_bad_k | bad_q
    out = torch.where((lse_bad | sees_bad_v).unsqueeze(-1), torch.full((), NAN, dtype=out.dtype, device=out.device),
                      out)
    lse = torch.where(_lse_layout(lse_bad), torch.full((), NAN, dtype=lse.dtype, device=lse.device), lse)
    return out, lse


def guarded_causal_backward(kernel, dout, q, k, v, out, lse, cu_seqlens=None):
    """``kernel(dout, q, k, v, out, lse) -> (dq, dk, dv)`` for an aligned causal block, with the clean/poison
    rule (a row is bad if its query, output, output gradient or lse is not finite)."""
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    bad_row = _bad_rows(q, dout, out) | ~torch.isfinite(_lse_layout(lse))
    bad_key = _bad_rows(k, v)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    dq, dk, dv = kernel(_clean(dout, bad_row), _clean(q, bad_row), _clean(k, bad_key), _clean(v, bad_key),
                        _clean(out, bad_row), torch.where(_lse_layout(bad_row), zero, lse))
    row_poisoned = bad_row | _to_query_heads(_segment_scan(bad_key, cu_seqlens, reverse=False), heads_q)
    key_poisoned = bad_key | _to_kv_heads(_segment_scan(bad_row, cu_seqlens, reverse=True), heads_kv)

    def poison(g, flags):
        return torch.where(flags.unsqueeze(-1), torch.full((), NAN, dtype=g.dtype, device=g.device), g)

    return poison(dq, row_poisoned), poison(dk, key_poisoned), poison(dv, key_poisoned)
