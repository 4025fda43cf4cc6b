"""Mask semantics: the one definition of which key a query may see.

A block of ``q_len`` queries and ``k_len`` keys is placed in its sequence (or document) by global offsets: query
``i`` sits at position ``p = q_offset + i`` and key ``j`` at ``s = k_offset + j``.  A :class:`Mask` says which
pairs are visible, always through the difference ``s - p``:

- ``causal``: ``s <= p``;
- ``window=(left, right)`` (flash-attn's ``window_size``, ``-1`` = unbounded on that side):
  ``p - left <= s <= p + right``;

both intersected.  So a mask is a *band* ``lo <= s - p <= hi`` (``lo = -left``, ``hi = 0`` if causal else
``right``; ``None`` where unbounded), and two masks with the same band are the same mask (:meth:`Mask.canonical`:
``window=(-1, 0)`` is ``causal``).  Packed documents are separate segments (``cu_seqlens``) with positions counted
within each document; a query never sees a key of another segment.

Everything else on the host (the reference backend, the sub-blocks the fused torch ops need, block skipping and
key trimming in ring attention, the LPT cost model) is derived from the functions here; the CuTe kernels apply the
causal rule and a window's lower edge on the device (cute/backend.kernel_band maps a band onto them).
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch


# Token positions must leave room for a block's length in int64 arithmetic (the kernels' own, narrower limits are
# theirs to check).
OFFSET_LIMIT = 2**62


def check_window(window) -> tuple[int, int]:
    """``window=(left, right)`` in tokens, ``-1`` meaning unbounded (``None``: ``(-1, -1)``)."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints (-1: unbounded on that side), got {window!r}")
    sides = []
    for side, w in zip(("left", "right"), window):
        if not is_int(w):
            raise TypeError(f"window {side} must be an int >= -1 (-1: unbounded), got {w!r}")
        w = int(w)
        if not -1 <= w < OFFSET_LIMIT:
            raise ValueError(f"window {side} must be an int >= -1 (-1: unbounded) and < 2**62 (the token positions' "
                             f"limit), got {w}")
        sides.append(w)
    return (sides[0], sides[1])


def is_int(value) -> bool:
    """An integer scalar: a Python int or NumPy's (numbers.Integral), never a bool (NumPy's bool_ is not Integral)
    nor a tensor. The one test of the window's sides, the offsets and the other integer arguments."""
    if type(value) is int:  # (the usual argument: no ABC check, which costs host time at short sequences)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_CANONICAL: dict = {}  # (causal, window) -> Mask.canonical's mask, for plain bool / int arguments


@dataclass(frozen=True)
class Mask:
    """Which (query, key) pairs are visible, by global position: ``causal`` and a sliding ``window``.

    A small immutable value: a call, a ring step or a work item carries one.  Build it with :meth:`canonical`
    (or through the contract's ``causal=`` / ``window=`` arguments, which validate them) so that equal bands compare
    equal."""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    def __post_init__(self):
        # checked here, not only by the contract: a Mask built directly with window (-5, 3) would read -5 as
        # unbounded everywhere below, silently
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        object.__setattr__(self, "window", check_window(self.window))

    @staticmethod
    def canonical(causal: bool, window: tuple[int, int] = (-1, -1)) -> "Mask":
        """The mask of this band in its one spelling: ``causal`` iff the band ends at the query itself, and a
        right window only where it is not causal (``(-1, 0)`` -> causal; causal + ``(L, R)`` -> causal +
        ``(L, -1)``)."""
        # remembered for plain (bool, (int, int)) arguments: built twice and checked each time, it cost several us of
        # host per call (a float or NumPy side is not a key: 1.0 == 1 would find the int's mask unchecked)
        key = None
        if type(causal) is bool and type(window) is tuple and len(window) == 2 and all(type(w) is int for w in window):
            key = (causal, window)
            found = _CANONICAL.get(key)
            if found is not None:
                return found
        given = Mask(causal, window)  # checked as given: below, a right side of -7 would read as unbounded
        left, right = given.window
        hi = 0 if causal else (right if right >= 0 else None)
        mask = Mask(hi == 0, (left, hi if hi not in (None, 0) else -1))
        if key is not None and len(_CANONICAL) < 4096:
            _CANONICAL[key] = mask
        return mask

    @property
    def lo(self) -> Optional[int]:
        """Smallest visible ``s - p`` (None: unbounded)."""
        return -self.window[0] if self.window[0] >= 0 else None

    @property
    def hi(self) -> Optional[int]:
        """Largest visible ``s - p`` (None: unbounded)."""
        if self.causal:
            return 0
        return self.window[1] if self.window[1] >= 0 else None

    @property
    def windowed(self) -> bool:
        """True if a sliding window bounds the band (more than causal can say)."""
        return self.window != (-1, -1)

    @property
    def full(self) -> bool:
        """True if every pair is visible."""
        return self.lo is None and self.hi is None

    def __str__(self) -> str:
        parts = ["causal"] if self.causal else []
        if self.windowed:
            parts.append(f"window={self.window}")
        return "+".join(parts) or "full"


NO_MASK = Mask()
CAUSAL = Mask(True)

MaskLike = Union[Mask, bool]


def as_mask(mask: MaskLike) -> Mask:
    """A Mask from a Mask or a bool (True: causal, False: no mask)."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, bool):
        return CAUSAL if mask else NO_MASK
    raise TypeError(f"mask must be a fa4dist.kernels.mask.Mask or a bool (causal), got {type(mask).__name__}")


class Visibility(enum.Enum):
    NONE = 0  # no query sees any key: skip the block
    FULL = 1  # every query sees every key: no mask needed
    PARTIAL = 2  # some pairs masked


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: MaskLike) -> torch.Tensor:
    """Boolean (len(q_pos), len(k_pos)) matrix of visible pairs for global positions in one segment."""
    mask = as_mask(mask)
    diff = k_pos.view(1, -1) - q_pos.view(-1, 1)
    keep = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
    if mask.hi is not None:
        keep &= diff <= mask.hi
    if mask.lo is not None:
        keep &= diff >= mask.lo
    return keep


def block_visibility(q_len: int, k_len: int, q_offset: int, k_offset: int, mask: MaskLike) -> Visibility:
    if q_len <= 0 or k_len <= 0:
        return Visibility.NONE
    mask = as_mask(mask)
    # every difference s - p between these bounds occurs in the block
    d_min, d_max = k_offset - (q_offset + q_len - 1), (k_offset + k_len - 1) - q_offset
    lo, hi = mask.lo, mask.hi
    if (hi is not None and d_min > hi) or (lo is not None and d_max < lo):
        return Visibility.NONE
    if (hi is None or d_max <= hi) and (lo is None or d_min >= lo):
        return Visibility.FULL
    return Visibility.PARTIAL


def _pairs_at_most(q_len: int, k_len: int, delta: int) -> int:
    """Pairs (i, j) of a q_len x k_len block with j <= i + delta, in closed form."""
    # Row i sees min(k_len, max(0, i + delta + 1)) keys.
    first = max(0, -delta)  # first row that sees a key
    if first >= q_len:
        return 0
    partial_end = min(max(k_len - delta - 1, first), q_len)  # rows [first, partial_end) see a prefix of the keys
    n = partial_end - first
    partial = n * (delta + 1) + (first + partial_end - 1) * n // 2
    return partial + (q_len - partial_end) * k_len


def visible_pairs(q_len: int, k_len: int, q_offset: int, k_offset: int, mask: MaskLike) -> int:
    """Number of visible (query, key) pairs of a block, in closed form: the pairs with ``s - p <= hi`` minus those
    with ``s - p < lo``."""
    if q_len <= 0 or k_len <= 0:
        return 0
    mask = as_mask(mask)
    d = q_offset - k_offset  # s - p <= x  <=>  j <= i + d + x
    upper = q_len * k_len if mask.hi is None else _pairs_at_most(q_len, k_len, d + mask.hi)
    lower = 0 if mask.lo is None else _pairs_at_most(q_len, k_len, d + mask.lo - 1)
    return upper - lower


@dataclass(frozen=True)
class Rect:
    """Rows [q_start, q_start + q_len) and keys [k_start, k_start + k_len) of a block."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int


def visible_rect(q_len: int, k_len: int, q_offset: int, k_offset: int, mask: MaskLike) -> Optional[Rect]:
    """The smallest rectangle of the block holding every visible pair (None if there is none): the rows that see
    a key and the keys some row sees are each one contiguous range, so nothing outside it needs loading."""
    if block_visibility(q_len, k_len, q_offset, k_offset, mask) is Visibility.NONE:
        return None
    mask = as_mask(mask)
    lo, hi = mask.lo, mask.hi
    p0, p1, k0, k1 = q_offset, q_offset + q_len - 1, k_offset, k_offset + k_len - 1
    # a row at p sees a key iff p + lo <= k1 and p + hi >= k0; a key at s is seen iff p0 + lo <= s <= p1 + hi
    r0 = p0 if hi is None else max(p0, k0 - hi)
    r1 = p1 if lo is None else min(p1, k1 - lo)
    c0 = k0 if lo is None else max(k0, p0 + lo)
    c1 = k1 if hi is None else min(k1, p1 + hi)
    return Rect(r0 - q_offset, r1 - r0 + 1, c0 - k_offset, c1 - c0 + 1)


@dataclass(frozen=True)
class SubBlock:
    """A rectangle of a block that a kernel without offsets can compute.

    ``aligned_causal`` blocks are square with the diagonal on query i == key i (what every fused kernel's
    ``is_causal`` means for equal lengths); the other blocks are fully visible."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    aligned_causal: bool


def causal_decomposition(q_len: int, k_len: int, q_offset: int, k_offset: int, mask: MaskLike) -> list[SubBlock]:
    """Splits a block of any alignment into at most three sub-blocks: fully visible rectangles and one aligned
    causal square (for kernels whose only masks are "none" and "causal on the diagonal"; no windows).  Rows that
    appear in no sub-block see no key at all; rows in two sub-blocks merge them."""
    mask = as_mask(mask)
    if mask.windowed:
        raise ValueError(f"causal_decomposition cannot express a sliding window ({mask}); see band_decomposition")
    vis = block_visibility(q_len, k_len, q_offset, k_offset, mask)
    if vis is Visibility.NONE:
        return []
    if vis is Visibility.FULL:
        return [SubBlock(0, q_len, 0, k_len, False)]
    d = q_offset - k_offset
    first = max(0, -d)
    diag_end = min(q_len, k_len - d)  # the diagonal key i + d leaves the block at row k_len - d
    blocks = []
    if diag_end > first:
        if first + d > 0:  # keys left of the diagonal are visible to all the diagonal's rows
            blocks.append(SubBlock(first, diag_end - first, 0, first + d, False))
        blocks.append(SubBlock(first, diag_end - first, first + d, diag_end - first, True))
    full_start = max(first, diag_end)
    if full_start < q_len:  # rows below the block's last key see every key
        blocks.append(SubBlock(full_start, q_len - full_start, 0, k_len, False))
    return blocks


@dataclass(frozen=True)
class BandBlock:
    """A rectangle of a block whose rows all see a key, with its band in local indices: row ``i`` sees keys ``j``
    with ``lo <= j - i <= hi`` (None: unbounded) inside the rectangle.  The band passes through the bottom-right
    corner (``lo <= k_len - q_len <= hi``), so a kernel that aligns its window on that corner (flash-attn's
    ``window_size``) expresses it with non-negative windows, and ``lo`` / ``hi`` are None wherever that edge
    never binds inside the rectangle (such kernels read a window past the keys as unbounded; and a window wider
    than the block, up to 2**62, would not fit the C int they take it in)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    lo: Optional[int]
    hi: Optional[int]


def band_decomposition(q_len: int, k_len: int, q_offset: int, k_offset: int, mask: MaskLike) -> list[BandBlock]:
    """At most two :class:`BandBlock` that hold every visible pair of the block exactly once, for kernels with a
    bottom-right-aligned window: the visible rectangle, its rows split where the band's right edge stops cutting
    the keys.  Rows outside them see no key."""
    rect = visible_rect(q_len, k_len, q_offset, k_offset, mask)
    if rect is None:
        return []
    mask = as_mask(mask)
    n, m = rect.q_len, rect.k_len
    e = (k_offset + rect.k_start) - (q_offset + rect.q_start)  # s - p of local row 0, key 0
    lo = None if mask.lo is None else mask.lo - e
    hi = None if mask.hi is None else mask.hi - e
    split = 0 if hi is None else max(0, min(n, m - 1 - hi))  # rows [0, split) end before the last key
    if split == 0:
        return [BandBlock(rect.q_start, n, rect.k_start, m, _binding_lo(lo, n), None)]
    # rows [0, split): their last visible key is m - 2 at most, the last row's exactly (the band's right edge);
    # rows [split, n): see up to the last key, from their own first visible key on
    first_b = 0 if lo is None else max(0, split + lo)
    return [
        BandBlock(rect.q_start, split, rect.k_start, split - 1 + hi + 1, _binding_lo(lo, split), hi),
        BandBlock(rect.q_start + split, n - split, rect.k_start + first_b, m - first_b,
                  _binding_lo(None if lo is None else lo + split - first_b, n - split), None),
    ]


def _binding_lo(lo: Optional[int], rows: int) -> Optional[int]:
    """A band block's lower edge, or None where it never binds: every one of its ``rows`` rows (row i sees keys
    from ``i + lo`` on) then sees from the block's first key."""
    return None if lo is None or lo + rows - 1 <= 0 else lo
