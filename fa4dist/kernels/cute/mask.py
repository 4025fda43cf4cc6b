"""Device side of the attention mask (the semantics are fa4dist.kernels.mask's): which (query, key) pairs of a
tile an accumulator fragment may keep.

Causal in global positions: key j of the sequence is visible to query i iff j <= i + diag (diag = q_offset -
k_offset); a sliding window of ``window_left`` keys adds j >= i + diag - window_left (the host folds a window's
right edge into diag); keys at or past seqlen_k are never visible. Per query row the visible keys are one
interval; the mask reduces it to column limits per accumulator row, compared against the compile-time column
coordinates of thread 0 (this thread's column offset folded into the limits), so each element costs one compare
(two with a window) and one select.

Two layouts share the same rule: ``apply`` for S (rows = queries, the forward) and ``apply_transposed`` for
S^T (rows = keys, the backward). Soft-capping and sink logits are transforms of the scores, not of the mask, and
live beside the softmax.

This module imports cutlass at import time: import it lazily.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint32, const_expr

from .common_sm90 import mn_view


@dataclass(frozen=True)
class AttentionMask:
    """The mask of one sequence bound to a tiling and to this thread's accumulator coordinates.

    ``tScS_mn`` / ``t0ScS_mn``: (row, col) coordinates of this thread's / thread 0's accumulator elements in the
    (rows x cols) tile, in the accumulator's (rows, cols) view (common_sm90.mn_view). For the transposed layout
    rows are keys and cols are queries; ``tile_m`` / ``tile_n`` stay the query / key tile sizes."""

    tile_m: int
    tile_n: int
    causal: bool
    seqlen_k: Any
    diag: Any
    tScS_mn: Any
    t0ScS_mn: Any
    window_left: int = -1  # >= 0 (causal only): keys more than this far below the diagonal are masked

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0

    def visible(self, q, k):
        """Key k (index in the sequence) visible to query q."""
        vis = k < self.seqlen_k
        if const_expr(self.causal):
            vis = vis & (k <= q + self.diag)
        if const_expr(self.windowed):
            vis = vis & (k >= q + self.diag - self.window_left)
        return vis

    def row_sees_any_key(self, q):
        """Query q sees at least one key (else its lse is -inf and its out 0)."""
        sees = self.seqlen_k > 0
        if const_expr(self.causal):
            sees = sees & (q + self.diag >= 0)
        if const_expr(self.windowed):
            sees = sees & (q + self.diag - self.window_left < self.seqlen_k)
        return sees

    @cute.jit
    def row_sees_marked_key(self, q, n_block, bits: cute.Tensor):
        """Query q sees a key of block n_block whose bit is set in ``bits`` (tile_n // 32 words, bit k % 32 of
        word k // 32 for the tile's key k). With a window a row's keys in a tile are an interval [lo, hi], not a
        prefix, so the first marked key does not decide (apply's rule in tile coordinates)."""
        k0 = n_block * self.tile_n
        last = self.seqlen_k - 1  # the row's last visible key
        if const_expr(self.causal):
            last = cutlass.min(last, q + self.diag)
        hi = cutlass.min(last - k0, self.tile_n - 1)
        lo = Int32(0)
        if const_expr(self.windowed):
            lo = cutlass.max(q + self.diag - self.window_left - k0, 0)
        seen = Boolean(False)
        for w in cutlass.range_constexpr(self.tile_n // 32):
            a = cutlass.max(lo - 32 * w, 0)
            b = cutlass.min(hi - 32 * w, 31)
            # bits a..b of the word (shift amounts clamped to 0..31; the a <= b test discards the clamped cases)
            width_shift = cutlass.min(cutlass.max(31 - (b - a), 0), 31)
            span = (Uint32(0xFFFFFFFF) >> Uint32(width_shift)) << Uint32(cutlass.min(a, 31))
            seen = seen | ((a <= b) & ((Uint32(bits[w]) & span) != Uint32(0)))
        return seen

    @cute.jit
    def apply(self, acc_S: cute.Tensor, m_block: Int32, n_block: Int32, mask_seqlen: cutlass.Constexpr[bool]):
        """S (rows = queries of tile m_block, cols = keys of block n_block): -inf where key col >= seqlen_k (if
        mask_seqlen) or, when causal, where col > row + diag, or (window) where col < row + diag - window_left."""
        acc_mn = mn_view(acc_S)
        thr_col = self.tScS_mn[0, 0][1]
        col0 = n_block * self.tile_n + thr_col
        seqlen_limit = self.seqlen_k - col0
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            limit = seqlen_limit
            if const_expr(self.causal):
                row = m_block * self.tile_m + self.tScS_mn[r, 0][0]
                causal_limit = row + self.diag + 1 - col0
                if const_expr(mask_seqlen):
                    limit = cutlass.min(limit, causal_limit)
                else:
                    limit = causal_limit
            if const_expr(self.windowed):
                row = m_block * self.tile_m + self.tScS_mn[r, 0][0]
                window_limit = row + self.diag - self.window_left - col0  # columns below it are masked
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    col = self.t0ScS_mn[0, c][1]
                    acc_mn[r, c] = -Float32.inf if (col >= limit) | (col < window_limit) else acc_mn[r, c]
            else:
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    # a select, not an `if`: a dynamic `if` that writes a register tensor yields the
                    # whole fragment out of the branch (hundreds of FSELs per masked tile)
                    acc_mn[r, c] = -Float32.inf if self.t0ScS_mn[0, c][1] >= limit else acc_mn[r, c]

    @cute.jit
    def apply_transposed(self, acc_St: cute.Tensor, m_block: Int32, n_block: Int32, fill: cutlass.Constexpr[float]):
        """S^T-shaped fragment (rows = keys of block n_block, cols = queries of tile m_block): ``fill`` where the
        key is at or past seqlen_k or (causal) where query < key - diag or (window) where query > key - diag +
        window_left. A select per element: whatever the
        fragment held there (NaN, inf) is replaced. (Padding query rows past seqlen_q need no mask here: their
        lse2 is +inf, so P is 0 once their operand rows are finite.)"""
        acc_mn = mn_view(acc_St)
        q0 = m_block * self.tile_m + self.tScS_mn[0, 0][1]  # query of this thread's column 0
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            key = n_block * self.tile_n + self.tScS_mn[r, 0][0]
            lo = Int32(0)  # columns >= lo are visible
            if const_expr(self.causal):
                lo = key - self.diag - q0
            lo = lo if key < self.seqlen_k else Int32(self.tile_m)
            if const_expr(self.windowed):
                hi = key - self.diag + self.window_left - q0  # columns <= hi are visible
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    col = self.t0ScS_mn[0, c][1]
                    acc_mn[r, c] = acc_mn[r, c] if (col >= lo) & (col <= hi) else Float32(fill)
            else:
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    acc_mn[r, c] = acc_mn[r, c] if self.t0ScS_mn[0, c][1] >= lo else Float32(fill)
