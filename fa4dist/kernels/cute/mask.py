"""Device side of the attention mask (the semantics are fa4dist.kernels.mask's): which (query, key) pairs of a
tile an accumulator fragment may keep.

Causal in global positions: key j of the sequence is visible to query i iff j <= i + diag (diag = q_offset -
k_offset); keys at or past seqlen_k are never visible. Per query row the visible keys are one interval; the mask
reduces it to a column limit per accumulator row, compared against the compile-time column coordinates of
thread 0 (this thread's column offset folded into the limit), so each element costs one compare and one select.

Two layouts share the same rule: ``apply`` for S (rows = queries, the forward) and ``apply_transposed`` for
S^T (rows = keys, the backward). A sliding window adds a lower limit per row beside the upper one; soft-capping
and sink logits are transforms of the scores, not of the mask, and live beside the softmax.

This module imports cutlass at import time: import it lazily.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

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

    def visible(self, q, k):
        """Key k (index in the sequence) visible to query q."""
        vis = k < self.seqlen_k
        if const_expr(self.causal):
            vis = vis & (k <= q + self.diag)
        return vis

    def row_sees_any_key(self, q):
        """Query q sees at least one key (else its lse is -inf and its out 0)."""
        sees = self.seqlen_k > 0
        if const_expr(self.causal):
            sees = sees & (q + self.diag >= 0)
        return sees

    @cute.jit
    def apply(self, acc_S: cute.Tensor, m_block: Int32, n_block: Int32, mask_seqlen: cutlass.Constexpr[bool]):
        """S (rows = queries of tile m_block, cols = keys of block n_block): -inf where key col >= seqlen_k (if
        mask_seqlen) or, when causal, where col > row + diag."""
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
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                # a select, not an `if`: a dynamic `if` that writes a register tensor yields the
                # whole fragment out of the branch (hundreds of FSELs per masked tile)
                acc_mn[r, c] = -Float32.inf if self.t0ScS_mn[0, c][1] >= limit else acc_mn[r, c]

    @cute.jit
    def apply_transposed(self, acc_St: cute.Tensor, m_block: Int32, n_block: Int32, fill: cutlass.Constexpr[float]):
        """S^T-shaped fragment (rows = keys of block n_block, cols = queries of tile m_block): ``fill`` where the
        key is at or past seqlen_k or (causal) where query < key - diag. A select per element: whatever the
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
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                acc_mn[r, c] = acc_mn[r, c] if self.t0ScS_mn[0, c][1] >= lo else Float32(fill)
