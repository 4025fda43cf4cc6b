"""Backward preprocess kernel (Hopper; plain SIMT, memory bound).

One CTA per (query tile, head, sequence): for each of the tile's rows
  dpsum[row] = softmax_scale * (rowsum(dO * O) - dlse[row])      (0 for padding rows; dlse: the lse's gradient,
                                                                  when given: d lse / d s = P)
  lse2[row]  = lse * log2(e)                       (+inf for padding rows and rows with lse = -inf,
                                                    so that P = exp2(S * scale_log2 - lse2) = 0 there)
written into tile-padded vectors indexed (chunk * heads + head) * tile_m + row, where
chunk = (first tile of the sequence) + tile, and one int32 per tile (same index without the row):
  clean[tile] = 1 if every row of the tile has a finite lse and a finite dpsum, else 0.
A finite lse certifies the row's q (a row with a NaN / inf in q has no finite score, so its lse is NaN or
+-inf: the lse of the forward over the same q, as the contract requires), a finite dpsum its dO (and O): the
main kernel's masked steps on clean tiles skip the sanitizer (bwd_sm90.py). The same CTA zeroes the tile's fp32
dQ accumulator chunk and, in deterministic mode, its semaphore, so the main kernel needs no memsets (zero_dq=False: a
launch that computes no dQ has no scratch). Fixed-point dQ (dq_fixed): the accumulator is int64 (zeroed as
twice the fp32 words) and the rows' scales (fixed_point.dq_scale, lse's layout) are copied into the same
tile-padded indexing as lse2 (0 for padding rows), where the main kernel reads them.

This module imports cutlass at import time: import it lazily."""

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .block_info import WORKLIST_COLUMNS, SeqlenInfo
from .common_sm90 import select_modes
from .sanitize import block_any
from .tile_scheduler import row_tile_grid, row_tile_of

LOG2_E = math.log2(math.e)


class BwdPreprocess:
    def __init__(self, head_dim: int, tile_m: int, *, varlen: bool, deterministic: bool, num_threads: int = 128,
                 zero_dq: bool = True, dq_fixed: bool = False, worklist: bool = False, dlse: bool = False):
        self.dlse = dlse  # mDlse (lse's layout) is given: the lse's gradient joins the row sums
        self.worklist = worklist  # mCuSeqlensQ is a work list's item table (block_info.WORKLIST_COLUMNS)
        self.zero_dq = zero_dq
        self.dq_fixed = dq_fixed
        self.dq_words = 2 if dq_fixed else 1  # 32-bit words per dQ accumulator element
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.varlen = varlen
        self.deterministic = deterministic
        self.num_threads = num_threads
        # threads per row: a power of two (the row's sum is a shuffle reduction), 8 elements each (hdim 96: 12)
        self.tpr = 1 << ((head_dim // 8).bit_length() - 1)
        self.vec = head_dim // self.tpr  # elements per thread per row step
        assert self.vec * self.tpr == head_dim
        assert self.num_threads % self.tpr == 0 and self.tpr <= 32
        self.rows_per_pass = self.num_threads // self.tpr
        assert tile_m % self.rows_per_pass == 0

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, s, h, d) | (t, h, d), q dtype or fp32
        mdO: cute.Tensor,  # like q
        mLSE: cute.Tensor,  # (b, h, s) | (h, t) fp32
        mDlse: Optional[cute.Tensor],  # dlse: like mLSE, the lse's gradient
        mLSE2: cute.Tensor,  # flat fp32
        mDpsum: cute.Tensor,  # flat fp32
        mClean: cute.Tensor,  # flat int32, one per (chunk, h): the tile's rows all have finite lse and dpsum
        mdQacc: cute.Tensor,  # flat fp32
        mSem: Optional[cute.Tensor],  # flat int32
        mScale: Optional[cute.Tensor],  # dq_fixed: (b, h, s) | (h, t) fp32, the rows' fixed-point scales
        mScale2: Optional[cute.Tensor],  # dq_fixed: flat fp32, indexed as mLSE2
        scale: Float32,
        m_blocks: Int32,  # grid size along query tiles (varlen: ceil(max_seqlen_q / tile_m))
        mCuSeqlensQ: Optional[cute.Tensor],
        stream,
    ):
        if const_expr(not self.varlen):
            mO, mdO = [select_modes(t, (1, 3, 2, 0)) for t in (mO, mdO)]  # (s, d, h, b)
            mLSE = select_modes(mLSE, (2, 1, 0))  # (s, h, b)
            if const_expr(self.dlse):
                mDlse = select_modes(mDlse, (2, 1, 0))
            if const_expr(self.dq_fixed):
                mScale = select_modes(mScale, (2, 1, 0))
            num_batch = cute.size(mO.shape[3])
            grid_m = cute.ceil_div(cute.size(mO.shape[0]), self.tile_m)
        else:
            mO, mdO = [select_modes(t, (0, 2, 1)) for t in (mO, mdO)]  # (t, d, h)
            mLSE = select_modes(mLSE, (1, 0))  # (t, h)
            if const_expr(self.dlse):
                mDlse = select_modes(mDlse, (1, 0))
            if const_expr(self.dq_fixed):
                mScale = select_modes(mScale, (1, 0))
            num_batch = cute.size(mCuSeqlensQ.shape[0]) - 1
            if const_expr(self.worklist):
                num_batch = cute.size(mCuSeqlensQ.shape[0]) // WORKLIST_COLUMNS
            grid_m = m_blocks
        num_heads = cute.size(mO.shape[2])
        self.kernel(mO, mdO, mLSE, mDlse, mLSE2, mDpsum, mClean, mdQacc, mSem, mScale, mScale2, scale,
                    mCuSeqlensQ, grid_m).launch(
            grid=row_tile_grid(grid_m, num_heads, num_batch), block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDlse: Optional[cute.Tensor],
        mLSE2: cute.Tensor,
        mDpsum: cute.Tensor,
        mClean: cute.Tensor,
        mdQacc: cute.Tensor,
        mSem: Optional[cute.Tensor],
        mScale: Optional[cute.Tensor],
        mScale2: Optional[cute.Tensor],
        scale: Float32,
        mCuSeqlensQ: Optional[cute.Tensor],
        grid_m: Int32,
    ):
        tm, D, vec = self.tile_m, self.head_dim, self.vec
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = row_tile_of(grid_m)
        num_heads = cute.size(mO.shape[2])
        seqlen = SeqlenInfo.create_q(batch, mO, mCuSeqlensQ, varlen=self.varlen, scratch_tile_m=tm,
                                     worklist=self.worklist)
        seqlen_q, blk_base = seqlen.seqlen_q, seqlen.scratch_base
        if const_expr(self.varlen):
            mO_cur = cute.domain_offset((seqlen.offset_q, 0), mO[None, None, head])
            mdO_cur = cute.domain_offset((seqlen.offset_q, 0), mdO[None, None, head])
            mL_cur = cute.domain_offset((seqlen.offset_q,), mLSE[None, head])
            if const_expr(self.dlse):
                mG_cur = cute.domain_offset((seqlen.offset_q,), mDlse[None, head])
            if const_expr(self.dq_fixed):
                mSc_cur = cute.domain_offset((seqlen.offset_q,), mScale[None, head])
        else:
            mO_cur = mO[None, None, head, batch]
            mdO_cur = mdO[None, None, head, batch]
            mL_cur = mLSE[None, head, batch]
            if const_expr(self.dlse):
                mG_cur = mDlse[None, head, batch]
            if const_expr(self.dq_fixed):
                mSc_cur = mScale[None, head, batch]

        if m_block * tm < seqlen_q:
            chunk = (blk_base + m_block) * num_heads + head
            n_vec = cute.size(mLSE2.shape[0]) // tm
            gL2 = cute.make_tensor(mLSE2.iterator, cute.make_layout((tm, n_vec), stride=(1, tm)))[None, chunk]
            gDp = cute.make_tensor(mDpsum.iterator, cute.make_layout((tm, n_vec), stride=(1, tm)))[None, chunk]
            col = tidx % self.tpr
            unclean = Int32(0)  # this thread's rows: one with a non-finite lse or dpsum
            for p in cutlass.range_constexpr(tm // self.rows_per_pass):
                r = p * self.rows_per_pass + tidx // self.tpr
                row = m_block * tm + r
                acc = Float32(0.0)
                if row < seqlen_q:
                    o = cute.make_rmem_tensor((vec,), mO.element_type)
                    do = cute.make_rmem_tensor((vec,), mdO.element_type)
                    cute.autovec_copy(cute.local_tile(mO_cur[row, None], (vec,), (col,)), o)
                    cute.autovec_copy(cute.local_tile(mdO_cur[row, None], (vec,), (col,)), do)
                    prod = o.load().to(Float32) * do.load().to(Float32)
                    acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                acc = cute.arch.warp_reduction_sum(acc, threads_in_group=self.tpr)
                if col == 0:
                    lse2 = Float32(math.inf)
                    if row < seqlen_q:
                        lse = mL_cur[row]
                        if lse != -Float32.inf:
                            lse2 = lse * LOG2_E
                    gL2[r] = lse2
                    if const_expr(self.dlse):
                        if row < seqlen_q:
                            acc = acc - mG_cur[row]
                    dpsum = acc * scale
                    gDp[r] = dpsum
                    if row < seqlen_q:  # (padding rows: TMA zero-fills a dense sequence's end; a packed
                        # sequence's cut tile is always sanitized)
                        finite = (lse2 < Float32(math.inf)) & (lse2 > -Float32(math.inf))
                        finite = finite & (dpsum < Float32(math.inf)) & (dpsum > -Float32(math.inf))
                        unclean = unclean | (Int32(0) if finite else Int32(1))  # (NaN fails every comparison)
                    if const_expr(self.dq_fixed):
                        gSc2 = cute.make_tensor(mScale2.iterator, cute.make_layout((tm, n_vec), stride=(1, tm)))
                        row_scale = Float32(0.0)
                        if row < seqlen_q:
                            row_scale = mSc_cur[row]
                        gSc2[r, chunk] = row_scale
            any_unclean = block_any(unclean, 1, self.num_threads)
            if tidx == 0:
                mClean[chunk] = Int32(0) if any_unclean else Int32(1)
            if const_expr(self.zero_dq):
                # zero this tile's dQ accumulator chunk (16-byte stores of fp32 words)
                words = tm * D * self.dq_words
                n_chunks = cute.size(mdQacc.shape[0]) // words
                per_thread = words // (4 * self.num_threads)
                gacc = cute.make_tensor(
                    mdQacc.iterator,
                    cute.make_layout((4, self.num_threads, per_thread, n_chunks),
                                     stride=(1, 4, 4 * self.num_threads, words)),
                )[None, tidx, None, chunk]
                z = cute.make_rmem_tensor((4, per_thread), Float32)
                z.fill(0.0)
                cute.autovec_copy(z, gacc)
            if const_expr(self.deterministic and self.zero_dq):
                if tidx == 0:
                    mSem[chunk] = Int32(0)
