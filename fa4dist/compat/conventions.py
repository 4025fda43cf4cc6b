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
from fa4dist.kernels.problem import check_cu_seqlens_values, check_layout


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
                                  "gathered KV, block sparsity, score or mask modifications); leave it at its default")


def _show(value) -> str:
    return f"a {type(value).__name__}" if isinstance(value, torch.Tensor) or callable(value) else repr(value)


# window_of's shift for a band that holds no key (flash-attn 4's sides summing below 0)
NO_KEYS = "no keys"


def window_of(call: str, window_size, causal: bool, flash_attn: int, keys: int) -> tuple[tuple[int, int], int]:
    """(the contract's ``window``, a shift of the queries' positions) of flash-attn's ``window_size`` (left, right)
    as flash-attn version ``flash_attn`` (2 or 4) computes it; ``keys``: the call's key count (``max_seqlen_k``,
    else the longest key sequence, for packed input).  ``causal`` forces right = 0 in both.

    - flash-attn 2 (its kernels, ``flash_api.cpp``): -1 (or None) is unbounded, and so is a side of at least
      ``keys``, before ``causal``; then a bounded left side with an unbounded right one makes the right side
      ``keys`` (it hides the last keys from the first rows of a non-causal call with more queries than keys).
    - flash-attn 4 (``flash_attn.cute``, 4.0.0b36's ``_resolve_causal_local_window``): two negative int sides
      mean no window, before ``causal``; otherwise None is unbounded and ints are taken literally, negative ones
      included (``(None, -1)``: the keys strictly before the diagonal).  A negative side becomes the contract's 0
      with the queries shifted by it (the band keeps its width); sides that sum below 0 leave an empty band:
      :data:`NO_KEYS` as the shift (every row sees no key, out 0 and lse -inf, or the sink's)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"{call}: window_size must be a pair (left, right), got {window_size!r}") from None
    sides = []
    for name, side in (("left", left), ("right", right)):
        if side is not None:
            try:
                side = operator.index(side)
            except TypeError:
                raise TypeError(f"{call}: window_size's {name} side must be an int or None, got {side!r}") from None
            if flash_attn == 2 and side < -1:
                raise ValueError(f"{call}: window_size's {name} side must be >= -1 (-1: unbounded), got {side}")
        sides.append(side)
    left, right = sides
    if flash_attn == 2:
        left, right = (-1 if s is None or s >= keys else s for s in (left, right))
        if causal:
            right = 0
        elif left >= 0 and right == -1:
            right = keys
        return (left, right), 0
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        return (0, 0), NO_KEYS
    if right is not None and right < 0:  # keys up to `right` before the diagonal: the diagonal moves by right
        return (-1 if left is None else left + right, 0), right
    if left is not None and left < 0:  # keys from `-left` after the diagonal on
        return (0, -1 if right is None else right + left), -left
    return (-1 if left is None else left, -1 if right is None else right), 0


def boundaries(name: str, cu: torch.Tensor) -> list[int]:
    """cu_seqlens' values, read once (a CUDA tensor's read waits for the device), and checked as flash-attn takes
    them: int32, from 0, non-decreasing (a caller may address rows with them before fa4dist's own checks run)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
        got = f"shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else _show(cu)
        raise TypeError(f"{name} must be a 1-D int32 tensor of sequence boundaries, got {got}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    values = cu.tolist()
    check_cu_seqlens_values(name, values)
    return values


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


def check_call(call: str, q, k, v, *, causal: bool, window_size, softcap, softmax_scale, flash_attn: int,
               keys: int) -> tuple[int, int]:
    """The checks :func:`attention` makes that read no tensor's values (the window's form, the softcap, shapes,
    dtypes, devices, heads, the scale), for a caller that must refuse a call before it changes anything (a KV
    cache's append): ``k`` / ``v`` may be empty stand-ins of the keys' batch, heads and head dim.  Returns the
    contract's window (:func:`window_of`)."""
    window, _ = window_of(call, window_size, bool(causal), flash_attn, keys)
    check_layout(q, k, v, causal=bool(causal), window=window, softcap=_softcap(softcap, flash_attn),
                 softmax_scale=softmax_scale)
    return window


def attention(call: str, q, k, v, *, causal: bool, window_size, softcap, softmax_scale, deterministic,
              return_lse: bool, sinks: Optional[torch.Tensor] = None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, flash_attn: int):
    """(out, lse) of :func:`fa4dist.attention` under flash-attn ``flash_attn``'s conventions (2 or 4: its window
    (:func:`window_of`) and softcap rules; the lse differentiable when ``return_lse``)."""
    pad = 0  # rows of a packed buffer past cu_seqlens_q[-1]
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if q.dim() != 4:
            raise ValueError(f"{call}: q must be (batch, seqlen, heads, head_dim), got shape {tuple(q.shape)}")
        if k.dim() != 4:
            raise ValueError(f"{call}: k must be (batch, seqlen_k, kv_heads, head_dim), got shape {tuple(k.shape)}")
        q_offset = k.shape[1] - q.shape[1]
        keys = k.shape[1] if max_seqlen_k is None else operator.index(max_seqlen_k)  # (a KV cache's length)
    else:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError(f"{call}: give both cu_seqlens_q and cu_seqlens_k, or neither")
        bounds_q, bounds_k = boundaries("cu_seqlens_q", cu_seqlens_q), boundaries("cu_seqlens_k", cu_seqlens_k)
        len_q, len_k = ([b - a for a, b in zip(x, x[1:])] for x in (bounds_q, bounds_k))
        if len(len_q) != len(len_k):
            raise ValueError(f"{call}: cu_seqlens_q holds {len(len_q)} sequences but cu_seqlens_k {len(len_k)}")
        _check_max(call, "max_seqlen_q", max_seqlen_q, len_q)
        _check_max(call, "max_seqlen_k", max_seqlen_k, len_k)
        q_offset = [b - a for a, b in zip(len_q, len_k)]
        keys = operator.index(max_seqlen_k) if max_seqlen_k is not None else max(len_k, default=0)
        # flash-attn computes the tokens its cu_seqlens cover and leaves the rest of a longer (padded, fixed-size)
        # buffer alone: here those output rows are 0 and their lse -inf
        used_q, used_k = bounds_q[-1], bounds_k[-1]
        if q.dim() == 3 and q.shape[0] > used_q >= 0:
            pad, q = q.shape[0] - used_q, q[:used_q]
        if k.dim() == 3 and v.dim() == 3 and k.shape[0] == v.shape[0] > used_k >= 0:
            k, v = k[:used_k], v[:used_k]
    window, shift = window_of(call, window_size, bool(causal), flash_attn, keys)
    if shift == NO_KEYS:  # a one-key band on each row's diagonal placed one key before the sequence's first key
        q_offset = [-n - 1 for n in len_q] if isinstance(q_offset, list) else -q.shape[1] - 1
    elif shift:
        q_offset = [x + shift for x in q_offset] if isinstance(q_offset, list) else q_offset + shift
    out, lse = fa4dist.attention(
        q, k, v, causal=bool(causal), softmax_scale=softmax_scale, return_lse=True, window=window,
        softcap=_softcap(softcap, flash_attn), sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_offset=q_offset, k_offset=0, deterministic=True if deterministic else None)
    if pad:
        out = torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
        lse = torch.cat([lse, lse.new_full((*lse.shape[:-1], pad), float("-inf"))], dim=-1)
    return out, (lse if return_lse else lse.detach())


def _softcap(softcap, flash_attn: int) -> Optional[float]:
    """fa4dist's softcap (None: no capping) of flash-attn's: 0 is none in both; flash-attn 2 caps only above 0,
    and flash-attn 4 computes c * tanh(s / c), which is |c| * tanh(s / |c|) for a negative c.  (A non-finite value
    goes on to fa4dist's own check.)"""
    if not softcap:
        return None
    softcap = float(softcap)
    if flash_attn == 2 and softcap < 0:
        return None
    return abs(softcap)
