"""Fixed-point dq: sums of dq in int64, exact and independent of their order (cp_invariant's one-pass backward).

A row's dq is a sum over key tiles of contributions, and fp32 addition is not associative: its bits depend on the
order of the terms, which a ring splits over members and steps.  Here every contribution c (one query tile against
one canonical tile of ``KEY_TILE`` keys, computed the same way in every layout) becomes the integer trunc(c * 2^s),
with one power of two 2^s per (row, head) fixed before the backward starts from layout-free quantities.  Integers
then add exactly in any order: the kernel's bulk adds, several launches, a sum over ranks.  The result is
``dq = sum * 2^-s``, rounded once.

**The scale.**  With P summing to at most 1 over a row, |dP_ij| = |dO_i . V_j| <= d m_i Vmax and
|D_i| = |dO_i . O_i| <= d m_i Omax_i, where m_i = max |dO_i|, Omax_i = max |O_i| and Kmax, Vmax bound the finite
|K|, |V| of the head over the keys the row sees, each rounded up to a power of two (:func:`visible_key_bounds`; a
soft-cap's derivative is at most 1), so

    |dq_i| <= softmax_scale * Kmax * d * m_i * (Vmax + Omax_i) =: bound_i,

and so is the sum of |contribution| over the tiles (each tile's share of P is part of the same 1).  With
bound_i < 2^e_i, s_i = 61 - e_i keeps |sum| below 2^62 (room for the rounding of 16-bit dS and of the tiles'
fp32 sums) and resolves 2^-61 of the bound: far finer than fp32 for any row whose dq is not ~2^30 times smaller
than its bound.  Other sequences of a batch, other documents, keys after a causal row (padding) and keys before
a window do not enter its bound.  fp64 inputs get 53-bit
accuracy only where |dq| is within ~2^8 of the bound, so a row whose keys hold one far larger than the rest (or
whose dq is small against its bound) keeps 2^-61 of the bound, not fp64's relative precision (a V token 1e9 times
the rest costs ~1e-8 absolute in rows of |dq| ~1).  s_i is clamped to [-126, 126], so that 2^s_i is a normal fp32:
a row whose bound is below 2^-65 (|dO| below ~1e-20 against unit K and V) resolves only 2^-126 absolute, so its dq
loses bits from there down (1e-3 relative at |dO| ~1e-35 in fp32, 0 at subnormal dO), where the other modes keep
fp32's.  All inputs of the bound are maxima and exponents (exact in any order and layout), the geometry is global
and the arithmetic elementwise fp64, so every layout computes the same scales.  Non-finite values spread as in fp32
sums: a masked bad key or value contributes nothing (the kernels select it away, and the maxima skip it), a row that
sees one has a non-finite out, and a row whose bound is not finite (a non-finite dO or out row), or is 2^187 or
more (past what the clamped scale keeps in int64), gets a NaN scale, so its dq comes out NaN; a row that sees no key
gets a finite scale whatever its dO holds, so its dq is 0, as in the other modes.

The caller must pass the forward's own out and lse (the bound relies on P summing to at most 1).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

KEY_TILE = 128  # canonical key tile: every backend's dq contribution covers one such tile (cute: TILE_N)
FRACTION_HEADROOM = 61  # |sum| < 2^(61 + 1): one spare bit for rounding, and int64's sign bit
_MIN_EXP, _MAX_EXP = -126, 126


def absmax(t: torch.Tensor, dim=None) -> torch.Tensor:
    """max |t| over ``dim`` (all dims for None) in fp64: the infinity norm, one fused pass, exact in any order;
    NaN propagates; 0 over no elements.  Over the last dim of a 16-bit CUDA tensor: our row kernel
    (:func:`_row_kernel`), the same values."""
    t = t.detach()
    if t.numel() == 0:
        return t.abs().sum(dim=dim).double()  # zeros of the reduced shape
    if dim in (-1, t.dim() - 1):
        rows = _row_kernel(t, finite_only=False)
        if rows is not None:
            return rows.double()
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=dim).double()


def head_absmax(t: torch.Tensor) -> torch.Tensor:
    """max |t| per head (fp64) over every token (and batch) and the head dim of (..., heads, d) keys or values,
    *finite* entries only: a masked bad key contributes nothing (the kernels select it away), and a row that sees
    one has a non-finite out, which makes its own scale NaN.  A 16-bit CUDA tensor: each (token, head) vector's
    finite maximum by our row kernel, then the heads' maxima of those; otherwise a copy without the non-finite
    entries, then one reduction (torch's fastest form on the H200, bench/scale_maxima.py)."""
    t = t.detach()
    rows = _row_kernel(t, finite_only=True)
    if rows is not None:
        return absmax(rows, tuple(range(rows.dim() - 1)))
    finite = t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return absmax(finite, tuple(i for i in range(t.dim()) if i != t.dim() - 2))


def _row_kernel(t: torch.Tensor, finite_only: bool):
    """max |t| over the last dim by ``kernels/cute/row_absmax.py`` (torch reads such rows at ~0.9 TB/s), in t's
    dtype; None where it does not apply (not a 16-bit CUDA tensor it takes, or no CuTe DSL)."""
    if not (t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)):
        return None
    from .cute import host

    if not host.cutlass_importable():
        return None
    from .cute.row_absmax import row_absmax

    return row_absmax(t, finite_only)


# the exponent of a key vector with no non-zero finite entry: 2^_NO_KEY is 0 in fp64 (and below any real key's)
_NO_KEY = -(1 << 20)


def key_exponents(t: torch.Tensor) -> torch.Tensor:
    """int64 (..., tokens, heads) of keys or values (..., tokens, heads, d): E with every finite |entry| of the
    (token, head) vector below 2^E (frexp's exponent of its finite max, exact), ``_NO_KEY`` for a vector with no
    non-zero finite entry."""
    t = t.detach()
    rows = _row_kernel(t, finite_only=True)
    if rows is None:
        finite = t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        rows = torch.linalg.vector_norm(finite, ord=float("inf"), dim=-1)
    rows = rows.double()
    return torch.where(rows > 0, torch.frexp(rows).exponent.long(), torch.full_like(rows, _NO_KEY, dtype=torch.long))


def visible_key_bounds(tensors, items, q_rows: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per query row and key/value head, a power of two above every finite |entry| of each of ``tensors`` (keys and
    values, (..., tokens, heads, d), dense (b, s, h, d) or packed (t, h, d), their token and head counts alike)
    over the keys the row sees, as fp64 (..., q_rows, heads) (0 where none is non-zero); and whether each row sees a
    key at all, bool (q_rows,).  ``items``: the calls of a whole problem, each row in at most one (``WorkItem``-like:
    q/k starts and lengths, offsets, causal, window), their key ranges disjoint and in ascending order, as one
    device's items and the gather engine's documents are.

    A row's bound so depends on the keys it sees alone: not on other sequences of a batch or other documents of a
    packed row, nor on padding after a causal row or keys before a window.  Exponents and maxima are exact and the
    geometry global (positions in Python integers: offsets and windows up to 2^62), so every layout computes the
    same bounds."""
    from .mask import Mask

    # (n, ..., heads, tokens): the scans run along the contiguous last dim (an outer-dim cummax is ~50x slower)
    exps = torch.stack([key_exponents(t) for t in tensors]).movedim(-2, -1).contiguous()
    device, n_keys = exps.device, exps.shape[-1]
    items = [it for it in items if it.q_len > 0]
    bounds = torch.full((*exps.shape[:-1], q_rows), _NO_KEY, dtype=torch.long, device=device)
    sees = torch.zeros(q_rows, dtype=torch.bool, device=device)
    one = torch.ones((), dtype=torch.float64, device=device)
    if items and n_keys:
        segment = torch.zeros(n_keys, dtype=torch.long)
        inside = torch.zeros(n_keys, dtype=torch.bool)
        for number, it in enumerate(items, start=1):
            segment[it.k_start:it.k_start + it.k_len] = number
            inside[it.k_start:it.k_start + it.k_len] = True
        # each row's visible keys, [first, last] within its item's: query i at q_offset + i sees the keys j with
        # lo <= k_offset + j - (q_offset + i) <= hi; the band edges clamped in Python integers to what can matter
        # for the item's rows and keys (offsets and windows reach 2^62: their sums would wrap in int64)
        lengths = torch.tensor([it.q_len for it in items])
        item_of = torch.repeat_interleave(torch.arange(len(items)), lengths)
        local = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)

        def per_item(values):
            return torch.tensor(values, dtype=torch.long)[item_of]

        bands = [Mask.canonical(it.causal, tuple(it.window)) for it in items]
        top, bottom = [], []  # the last / first visible key of each item's row 0 (row i: + i)
        for it, band in zip(items, bands):
            diagonal = it.q_offset - it.k_offset
            top.append(it.k_len if band.hi is None else max(-it.q_len - 1, min(it.k_len, diagonal + band.hi)))
            bottom.append(-it.q_len if band.lo is None else max(-it.q_len, min(it.k_len, diagonal + band.lo)))
        last = torch.minimum(per_item(top) + local, per_item([it.k_len for it in items]) - 1)
        first = torch.maximum(per_item(bottom) + local, torch.zeros_like(local))
        visible = (first <= last) & (last >= 0)
        rows = per_item([it.q_start for it in items]) + local
        start = per_item([it.k_start for it in items])
        lo_key, hi_key = (torch.where(visible, start + edge, 0) for edge in (first, last))
        windowed = any(band.lo is not None for band in bands)
        span = int((hi_key - lo_key).max()) + 1
        high, inside, visible, rows, lo_key, hi_key = _to_device(
            (segment.cummax(0).values << 32, inside, visible, rows, lo_key, hi_key), device)
        low = torch.where(inside, exps - _NO_KEY, 0)  # >= 0; 0 outside every item
        if windowed:  # ranges that start past their item's first key: a max over [lo_key, hi_key] per row
            picked = _range_max(low, lo_key, hi_key, span)
        else:  # the running max from each item's first key: one cummax over segments kept apart by their number in
            # the high bits (a later item's values are all above an earlier one's)
            picked = ((low + high).cummax(-1).values - high).index_select(-1, hi_key)
        bounds.index_copy_(-1, rows, torch.where(visible, picked + _NO_KEY, _NO_KEY))
        sees[rows] = visible
    return list(torch.ldexp(one, bounds.double()).movedim(-1, -2).unbind(0)), sees


def _range_max(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, span: int) -> torch.Tensor:
    """max of values[..., lo_r : hi_r + 1] for each r, (..., R) (lo <= hi, ranges at most ``span`` long): a sparse
    table of maxima over 2^k keys, each range the max of the two blocks of its largest 2^k that cover it."""
    levels = [values]
    for k in range(1, max(1, span).bit_length()):
        prev, step = levels[-1], 1 << (k - 1)
        level = prev.clone()
        level[..., :-step] = torch.maximum(prev[..., :-step], prev[..., step:])
        levels.append(level)
    table = torch.stack(levels, dim=-2)  # (..., levels, tokens)
    length = hi - lo + 1
    k = torch.floor(torch.log2(length.double())).long()  # exact for lengths below 2^52
    return torch.maximum(table[..., k, lo], table[..., k, hi - torch.bitwise_left_shift(torch.ones_like(k), k) + 1])


def _to_device(parts, device) -> tuple:
    """1-D host tensors (int64 or bool) on ``device`` in one pinned, asynchronous copy: a plain copy would wait for
    the GPU's queued work (the backward's) and leave it idle while the host goes on."""
    if device.type != "cuda":
        return tuple(parts)
    flat = torch.cat([p.long() for p in parts])
    pinned = torch.empty(flat.shape, dtype=torch.long, pin_memory=True)
    pinned.copy_(flat)
    on_device = pinned.to(device, non_blocking=True).split([p.numel() for p in parts])
    return tuple(d.bool() if p.dtype == torch.bool else d for d, p in zip(on_device, parts))


def dq_scale(dout: torch.Tensor, out: torch.Tensor, k_absmax: torch.Tensor, v_absmax: torch.Tensor,
             softmax_scale: float, sees_key: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows' scales 2^s (fp32, lse's layout: (b, h, s) for dense (b, s, h, d) input, (h, t) for packed
    (t, h, d)); ``k_absmax`` / ``v_absmax``: bounds of the keys and values each query head reads, per head
    (:func:`head_absmax`) or per row and head (:func:`visible_key_bounds`, in dout's (..., tokens, heads)
    layout); ``sees_key`` (tokens,): rows that see no key get a finite scale whatever their dO holds (their dq
    is 0, as the other modes give)."""
    head_dim = dout.shape[-1]
    m = absmax(dout, -1)  # (..., heads)
    o_max = absmax(out, -1)
    bound = (float(softmax_scale) * head_dim) * k_absmax.to(m.device) * m * (v_absmax.to(m.device) + o_max)
    if sees_key is not None:
        bound = torch.where(sees_key.to(m.device).view(-1, 1), bound, 0.0)
    scale = power_of_two_scale(bound)
    return (scale.movedim(-1, 0) if dout.dim() == 3 else scale.movedim(-1, 1)).contiguous()


def power_of_two_below(x: torch.Tensor) -> torch.Tensor:
    """2^-e with x = m 2^e, m in [0.5, 1) (x >= 0): x times it is in [0.5, 1); the exponent clamped so that the
    factor stays a normal number of x's dtype (1 for x = 0).  Scaling by it is exact wherever the scaled values
    stay normal, so sums formed on the scaled values have the bits of the unscaled ones, times it."""
    exponent = torch.frexp(x).exponent
    low = int(math.log2(torch.finfo(x.dtype).tiny))  # -126 for float32
    return torch.ldexp(torch.ones_like(x), -exponent.clamp(low + 1, -low))


def power_of_two_scale(bound: torch.Tensor) -> torch.Tensor:
    """2^(61 - e) for ``bound < 2^e`` (fp64 bounds of sums of |terms|), clamped to [2^-126, 2^126] so that it is a
    normal fp32 (fp32 result); NaN where the bound is not finite, or too large for the clamped scale to keep the
    sums in int64 (2^187 and up, values beyond fp32's range): such a row's dq comes out NaN, never a wrapped
    integer.  Terms times it then sum below 2^62 in int64."""
    exponent = torch.frexp(bound).exponent  # bound < 2^exponent (0 -> 0)
    shift = (FRACTION_HEADROOM - exponent).clamp(_MIN_EXP, _MAX_EXP)
    scale = torch.ldexp(torch.ones_like(bound), shift.to(bound.dtype)).float()
    fits = torch.isfinite(bound) & (exponent <= FRACTION_HEADROOM - _MIN_EXP)
    return torch.where(fits, scale, torch.full_like(scale, float("nan")))


def _per_row(scale: torch.Tensor, packed: bool) -> torch.Tensor:
    """Scales in lse's layout -> (..., tokens, heads, 1), broadcasting against (..., tokens, heads, d)."""
    return (scale.movedim(0, -1) if packed else scale.movedim(1, -1)).unsqueeze(-1)


def to_fixed(contribution: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int64 trunc(contribution * 2^s), ``scale`` broadcasting against the contributions (what the kernels add;
    a NaN product adds 0, and the row's NaN scale makes its dq NaN in :func:`from_fixed`)."""
    scaled = contribution * scale.to(contribution.dtype)
    return torch.nan_to_num(scaled.trunc(), nan=0.0, posinf=0.0, neginf=0.0).to(torch.int64)


def from_fixed(dq_fixed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dq = sum * 2^-s in ``dtype``: the integer rounded once to ``dtype`` (to nearest), then scaled by a power of
    two (exact unless the result is subnormal); NaN rows where the scale is NaN."""
    if dq_fixed.dtype != torch.int64:
        raise TypeError(f"dq_fixed must be int64, got {dq_fixed.dtype}")
    inverse = (1.0 / _per_row(scale, dq_fixed.dim() == 3).double()).to(dtype)
    # one pass: the product's operands are cast to ``dtype`` (the integer rounded to nearest), as .to(dtype) would
    return dq_fixed * inverse
