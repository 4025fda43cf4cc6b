"""Where a sequence lives and which blocks of it a tile must visit, for the forward and the backward alike.

``SeqlenInfo``: offsets and lengths of one sequence (a batch entry, a packed segment through cu_seqlens, or an item
of a work list's table) and its ``diag`` = q_offset - k_offset in global positions (per segment when offset tensors
are given, per item from the table).

``BlockInfo``: the block ranges that follow from the mask (fa4dist.kernels.mask semantics in global positions:
key j visible to query i iff j <= i + diag when causal, and, with a sliding window of ``window_left`` keys,
j >= i + diag - window_left; the host turns a window's right edge into the diagonal, see backend.py):
  forward  - for a query tile, the key blocks that hold a visible key [n_block_min, n_block_max), from which block
             on the causal mask is needed, and below which block the window's lower edge needs it;
  backward - for a key tile, the query tiles that see one of its keys [m_min, m_max), the causal band
             [m_min, m_mask_end) and the window band [m_window_start, m_max) that need mask math.
Blocks outside these ranges are never loaded. Both kernels take their ranges from here.

This module imports cutlass at import time: import it lazily.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


# A work list's table (kernels run one launch over many blocks, fa4dist.kernels.worklist): per item, in this order,
# the first query row, the query rows, the first key row, the key rows, q_offset - k_offset (the causal diagonal)
# and (backward) the item's first query tile in the tile-padded scratch (items own disjoint scratch tiles)
WORKLIST_COLUMNS = 6


@dataclass(frozen=True)
class SeqlenInfo:
    """Offsets (into the packed tensors; 0 for the dense layout), lengths and diagonal of one sequence."""

    offset_q: Any
    offset_k: Any
    seqlen_q: Any
    seqlen_k: Any
    diag: Any
    scratch_base: Any = None  # backward only: the sequence's first query tile in the tile-padded scratch

    @staticmethod
    def create(batch, mQ: cute.Tensor, mK: cute.Tensor, diag: Int32, mCuSeqlensQ, mCuSeqlensK, mSegOffQ, mSegOffK,
               *, varlen: bool, seg_offsets: bool, scratch_tile_m=None, worklist: bool = False) -> "SeqlenInfo":
        """mQ / mK in the kernels' (s, d, h[, b]) / packed (t, d, h) mode order; ``scratch_tile_m`` also derives
        ``scratch_base`` (the backward's padded per-tile vectors). ``worklist`` (packed tensors): ``batch`` is an
        item of the flat int32 table mCuSeqlensQ, WORKLIST_COLUMNS words per item (see there)."""
        offset_q = Int32(0)
        offset_k = Int32(0)
        seqlen_q = Int32(0)
        seqlen_k = Int32(0)
        scratch_base = None
        diag_b = diag
        if const_expr(worklist):
            row = batch * WORKLIST_COLUMNS
            offset_q = mCuSeqlensQ[row]
            seqlen_q = mCuSeqlensQ[row + 1]
            offset_k = mCuSeqlensQ[row + 2]
            seqlen_k = mCuSeqlensQ[row + 3]
            diag_b = diag + mCuSeqlensQ[row + 4]
            if const_expr(scratch_tile_m is not None):
                scratch_base = mCuSeqlensQ[row + 5]
        elif const_expr(varlen):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
            if const_expr(scratch_tile_m is not None):
                scratch_base = offset_q // scratch_tile_m + batch
        else:
            seqlen_q = cute.size(mQ.shape[0])
            seqlen_k = cute.size(mK.shape[0])
            if const_expr(scratch_tile_m is not None):
                scratch_base = batch * cute.ceil_div(seqlen_q, scratch_tile_m)
        if const_expr(seg_offsets):
            # per-sequence / per-segment global offsets of the first query / key
            diag_b = diag + mSegOffQ[batch] - mSegOffK[batch]
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, diag_b, scratch_base)

    @staticmethod
    def create_q(batch, mQ: cute.Tensor, mCuSeqlensQ, *, varlen: bool, scratch_tile_m: int,
                 worklist: bool = False) -> "SeqlenInfo":
        """The query side only (the backward's pre- and postprocess kernels): offset_q, seqlen_q and
        scratch_base; key fields are None."""
        offset_q = Int32(0)
        if const_expr(worklist):
            row = batch * WORKLIST_COLUMNS
            offset_q = mCuSeqlensQ[row]
            seqlen_q = mCuSeqlensQ[row + 1]
            scratch_base = mCuSeqlensQ[row + 5]
        elif const_expr(varlen):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            scratch_base = offset_q // scratch_tile_m + batch
        else:
            seqlen_q = cute.size(mQ.shape[0])
            scratch_base = batch * cute.ceil_div(seqlen_q, scratch_tile_m)
        return SeqlenInfo(offset_q, None, seqlen_q, None, None, scratch_base)


@dataclass(frozen=True)
class BlockInfo:
    """Block ranges of one kernel's tiling (tile_m queries x tile_n keys) under the mask. ``window_left`` >= 0
    (causal only): keys more than this many positions below the diagonal are masked too."""

    tile_m: int
    tile_n: int
    causal: bool
    window_left: int = -1

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0

    # ---------------- forward: key blocks of a query tile ----------------

    def n_block_max(self, seqlen: SeqlenInfo, m_block, n_blocks_k):
        """One past the last key block that a query of tile ``m_block`` sees (``n_blocks_k`` without a mask)."""
        last_row_excl = cutlass.min(seqlen.seqlen_q, (m_block + 1) * self.tile_m)
        nvis = last_row_excl + seqlen.diag  # keys visible to the last row of the tile
        return cutlass.min(n_blocks_k, cute.ceil_div(cutlass.max(nvis, 0), self.tile_n))

    @cute.jit
    def key_blocks(self, seqlen: SeqlenInfo, m_block: Int32):
        """(tile_valid, n_block_min, n_block_max, n_block_causal, n_block_window_end): the tile visits key blocks
        [n_block_min, n_block_max) (none when the tile lies past the sequence: not tile_valid, n_block_max =
        n_block_min); blocks >= n_block_causal need the causal mask, blocks < n_block_window_end the window's.
        Without a window n_block_min and n_block_window_end are 0."""
        tile_valid = m_block * self.tile_m < seqlen.seqlen_q
        n_block_max = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
        n_block_min = Int32(0)
        n_block_causal = Int32(0)  # blocks >= this one need the causal mask
        n_block_window_end = Int32(0)  # blocks < this one need the window's mask
        if const_expr(self.causal):
            n_block_max = self.n_block_max(seqlen, m_block, n_block_max)
            first_vis = m_block * self.tile_m + seqlen.diag + 1  # keys visible to the first row
            n_block_causal = cutlass.max(first_vis, 0) // self.tile_n
        if const_expr(self.windowed):
            first_row_lo = m_block * self.tile_m + seqlen.diag - self.window_left  # first key the tile's first row sees
            n_block_min = cutlass.min(cutlass.max(first_row_lo, 0) // self.tile_n, n_block_max)
            last_row_lo = first_row_lo + self.tile_m - 1  # ... and its last row (padding rows only mask more)
            n_block_window_end = cute.ceil_div(cutlass.max(last_row_lo, 0), self.tile_n)
        if not tile_valid:
            n_block_max = n_block_min
        return tile_valid, n_block_min, n_block_max, n_block_causal, n_block_window_end

    def phases(self, n_block_min, n_block_max, n_block_causal, n_block_window_end):
        """Split of the blocks after the first one (the highest, which always gets the full mask), in processing
        order (descending), into (n_masked, n_plain, n_window): blocks that still need the causal mask, then
        blocks that need none, then the lowest blocks, which need the window's mask. Masked blocks apply the
        whole mask (both edges), so a block in two bands is handled by either."""
        n_rest = cutlass.max(n_block_max - n_block_min - 1, 0)
        n_masked = Int32(0)
        if const_expr(self.causal):
            n_masked = cutlass.max(n_block_max - 1 - cutlass.max(n_block_causal, n_block_min), 0)
        n_window = Int32(0)
        if const_expr(self.windowed):
            n_window = cutlass.min(cutlass.max(n_block_window_end - n_block_min, 0), n_rest - n_masked)
        return n_masked, n_rest - n_masked - n_window, n_window

    # ---------------- backward: query tiles of a key tile ----------------

    @cute.jit
    def query_tiles(self, seqlen: SeqlenInfo, n_block: Int32, valid):
        """(has_work, m_min, m_mask_end, m_window_start, m_max): key tile ``n_block`` visits query tiles
        [m_min, m_max), the first [m_min, m_mask_end) of them with mask math (causal band; all of them when the
        key tile is cut by the sequence end) and the last [m_window_start, m_max) too (the window's band;
        m_window_start = m_max without a window)."""
        tm, tn = self.tile_m, self.tile_n
        m_max = cute.ceil_div(seqlen.seqlen_q, tm)
        m_min = Int32(0)
        m_mask_end = Int32(0)
        has_work = n_block * tn < seqlen.seqlen_k and seqlen.seqlen_q > 0
        if const_expr(valid is not True):
            has_work = has_work and valid
        if const_expr(self.causal):
            q0 = cutlass.max(n_block * tn - seqlen.diag, 0)  # first query that sees a key of this tile
            has_work = has_work and q0 < seqlen.seqlen_q
            m_min = q0 // tm
            m_full = cute.ceil_div(cutlass.max(n_block * tn + tn - 1 - seqlen.diag, 0), tm)
            m_mask_end = cutlass.min(cutlass.max(m_full, m_min), m_max)
        if (n_block + 1) * tn > seqlen.seqlen_k:
            m_mask_end = m_max  # partial key tile: every query tile needs the seqlen mask
        m_window_start = m_max
        if const_expr(self.windowed):
            # last query that sees a key of this tile (its last key), and the first query that misses its first key
            q_last = n_block * tn + tn - 1 - seqlen.diag + self.window_left
            has_work = has_work and q_last >= 0
            m_max = cutlass.min(m_max, q_last // tm + 1)
            has_work = has_work and m_min < m_max
            q_miss = cutlass.max(n_block * tn - seqlen.diag + self.window_left + 1, 0)
            m_mask_end = cutlass.min(m_mask_end, m_max)
            m_window_start = cutlass.min(cutlass.max(q_miss // tm, m_mask_end), m_max)
        return has_work, m_min, m_mask_end, m_window_start, m_max
