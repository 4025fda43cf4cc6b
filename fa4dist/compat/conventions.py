"""flash-attn's calling conventions translated to :func:`fa4dist.attention`'s: the one place both compatibility
modules (:mod:`fa4dist.compat.flash_attn`, :mod:`fa4dist.compat.flash_attn_cute`) call.

flash-attn aligns its causal mask and window to the bottom-right corner of the score matrix: query i of a
sequence with ``seqlen_q`` queries and ``seqlen_k`` keys sees key j iff
``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (``right = 0`` when causal).  fa4dist's
mask is by global position (``k_offset + j <= q_offset + i`` and the window around it), so the queries are placed
at ``q_offset = seqlen_k - seqlen_q`` (per sequence for packed input) and the keys at 0.
"""

from __future__ import annotations

import numbers
import operator
from typing import Optional

import torch

import fa4dist


def _not_asked(value) -> bool:
    """None, False, or a number equal to 0 (a Python, numpy or 0-dim tensor scalar): an option's default.  A tensor
    of one or more dimensions is an option's value whatever it holds (a (1, 1) block table of block 0 is a page)."""
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Number):
        return value == 0
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return bool(value.detach().cpu() == 0)
    return False


def refuse(call: str, **unsupported) -> None:
    """Raises for each flash-attn option given a value fa4dist does not compute (None, False or a zero: not
    asked)."""
    for name, value in unsupported.items():
        if _not_asked(value):
            continue
        raise NotImplementedError(f"{call}: {name}={_show(value)} is not supported by fa4dist (no dropout, ALiBi, "
                                  "paged or gathered KV, score or mask modifications); leave it at its default")


def _show(value) -> str:
    return f"a {type(value).__name__}" if isinstance(value, torch.Tensor) or callable(value) else repr(value)


def window_of(call: str, window_size, causal: bool, keys: Optional[int] = None) -> tuple[int, int]:
    """The contract's ``window`` of flash-attn's ``window_size`` (left, right): -1 or None unbounded; a side of at
    least ``keys`` unbounded too when given (flash-attn 2 does so, with the call's key count, before the causal
    mask); causal forces right = 0, as flash-attn does."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"{call}: window_size must be a pair (left, right), got {window_size!r}") from None
    sides = []
    for name, side in (("left", left), ("right", right)):
        if side is None:
            sides.append(-1)
            continue
        try:
            side = operator.index(side)
        except TypeError:
            raise TypeError(f"{call}: window_size's {name} side must be an int, -1 or None, got {side!r}") from None
        if side < -1:
            raise ValueError(f"{call}: window_size's {name} side must be >= -1 (-1: unbounded), got {side}")
        sides.append(-1 if keys is not None and side >= keys else side)
    return (sides[0], 0) if causal else (sides[0], sides[1])


def _lengths(name: str, cu: torch.Tensor) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor of sequence boundaries, got {_show(cu)}")
    values = cu.tolist()
    return [b - a for a, b in zip(values, values[1:])]


def _check_max(call: str, name: str, given, lengths: list[int]) -> None:
    """flash-attn sizes its grid from max_seqlen_*: a value below the longest sequence computed part of it."""
    if given is None:
        return
    longest = max(lengths, default=0)
    try:
        given = operator.index(given)
    except TypeError:
        raise TypeError(f"{call}: {name} must be an int or None, got {_show(given)}") from None
    if given < longest:
        raise ValueError(f"{call}: {name}={given} is shorter than the longest sequence ({longest} tokens)")


def attention(call: str, q, k, v, *, causal: bool, window_size, softcap, softmax_scale, deterministic,
              return_lse: bool, sinks: Optional[torch.Tensor] = None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, unbound_window_past_keys: bool = False):
    """(out, lse) of :func:`fa4dist.attention` under flash-attn's conventions (the lse differentiable when
    ``return_lse``).  ``unbound_window_past_keys``: flash-attn 2's rule, a window side of at least the key count
    (``max_seqlen_k``, else the longest key sequence, for packed input) is unbounded (:func:`window_of`)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if q.dim() != 4:
            raise ValueError(f"{call}: q must be (batch, seqlen, heads, head_dim), got shape {tuple(q.shape)}")
        if k.dim() != 4:
            raise ValueError(f"{call}: k must be (batch, seqlen_k, kv_heads, head_dim), got shape {tuple(k.shape)}")
        q_offset = k.shape[1] - q.shape[1]
        keys = k.shape[1]
    else:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError(f"{call}: give both cu_seqlens_q and cu_seqlens_k, or neither")
        len_q, len_k = _lengths("cu_seqlens_q", cu_seqlens_q), _lengths("cu_seqlens_k", cu_seqlens_k)
        if len(len_q) != len(len_k):
            raise ValueError(f"{call}: cu_seqlens_q holds {len(len_q)} sequences but cu_seqlens_k {len(len_k)}")
        _check_max(call, "max_seqlen_q", max_seqlen_q, len_q)
        _check_max(call, "max_seqlen_k", max_seqlen_k, len_k)
        q_offset = [b - a for a, b in zip(len_q, len_k)]
        keys = operator.index(max_seqlen_k) if max_seqlen_k is not None else max(len_k, default=0)
    window = window_of(call, window_size, bool(causal), keys if unbound_window_past_keys else None)
    out, lse = fa4dist.attention(
        q, k, v, causal=bool(causal), softmax_scale=softmax_scale, return_lse=True, window=window,
        softcap=float(softcap) if softcap else None, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, q_offset=q_offset, k_offset=0, deterministic=True if deterministic else None)
    return out, (lse if return_lse else lse.detach())
