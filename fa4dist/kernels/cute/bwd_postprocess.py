"""Backward dQ convert kernel (Hopper; SIMT, memory bound).

The main kernel leaves dQ (already scaled) in an fp32 scratch, one (tile_m x d) chunk per
(query tile, head), each chunk in the register-fragment order of common_sm90.dq_tiled_mma (so that
the main kernel can add whole chunks with one bulk reduction). One CTA of 256 threads per chunk
reloads the fragments exactly as the MMA threads held them, recovers each element's (row, col)
from the same tiled MMA, and writes dq: cast to the output dtype, or added (+=) into the
caller's fp32 buffer when accumulating. A dense 16-bit dq goes through shared memory (stmatrix) and
one TMA store per chunk: the fragment order's direct stores cover half of each 32-byte sector.
Fixed-point dQ (dq_fixed): the scratch is int64; it is added (+=) into the caller's int64 dq, exactly, or
(fixed_to_float) converted, each row's integer rounded to fp32 and divided by its power-of-two scale (read
from the preprocess's tile-padded copy), then written or added as an fp32 scratch would be.
Adding (accumulate) goes through shared memory too: the fragments land row-major in a padded tile, and each
in-range row is added into dq by one bulk reduction (cp.reduce.async.bulk add, f32 or u64: the memory system
adds, no load by the SM). Added from registers, every thread's 8-byte pieces of 32-byte row segments ran at a
quarter of the convert's bandwidth (a ring rank's shared dQ: 1.4 ms against 0.4 for twice the rows written).
One CTA per chunk and one add per element: the register form's bits, except where the memory system's f32 add
treats subnormals differently (the main kernel's dQ scratch adds already go through it).

This module imports cutlass at import time: import it lazily."""

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .block_info import WORKLIST_COLUMNS, SeqlenInfo
from .common_sm90 import (
    bulk_reduce_add_f32,
    bulk_reduce_add_u64,
    dq_chunk_layout,
    dq_tiled_mma,
    dq_wg_cols,
    mn_view,
    select_modes,
    smem_layout_kmajor,
    store_acc_rows,
    store_tile_tma,
)
from .tile_scheduler import row_tile_grid, row_tile_of


class BwdPostprocess:
    def __init__(self, dtype, head_dim: int, tile_m: int, *, varlen: bool, accumulate: bool, dq_fixed: bool = False,
                 fixed_to_float: bool = False, worklist: bool = False):
        self.worklist = worklist  # mCuSeqlensQ is a work list's item table (block_info.WORKLIST_COLUMNS)
        self.dtype = dtype  # q dtype (selects the MMA the scratch order came from)
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.varlen = varlen
        self.accumulate = accumulate
        self.dq_fixed = dq_fixed
        self.fixed_to_float = fixed_to_float  # int64 scratch -> a float dq (the deterministic GQA backward)
        assert accumulate or not dq_fixed or fixed_to_float
        assert dq_fixed or not fixed_to_float
        self.acc_type = cutlass.Int64 if dq_fixed else Float32
        # accumulating: dq's element type (the fixed point's integers, or fp32), and the staging tile's row pitch,
        # padded by 32 bytes so that a warp's fragment stores (8 rows) fall in distinct banks; 16-byte aligned rows
        self.add_type = cutlass.Int64 if dq_fixed and not fixed_to_float else Float32
        self.add_pitch = head_dim + 32 // (self.add_type.width // 8)

    @cute.jit
    def __call__(
        self,
        mdQacc: cute.Tensor,  # flat fp32 scratch (int64: dq_fixed)
        mdQ: cute.Tensor,  # (b, s, h, d) | (t, h, d): q dtype, or fp32 when accumulating (int64: dq_fixed)
        mScale2: Optional[cute.Tensor],  # fixed_to_float: flat fp32, the rows' scales in lse2's tile indexing
        m_blocks: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],
        stream,
    ):
        if const_expr(not self.varlen):
            mdQ = select_modes(mdQ, (1, 3, 2, 0))
            num_batch = cute.size(mdQ.shape[3])
            grid_m = cute.ceil_div(cute.size(mdQ.shape[0]), self.tile_m)
        else:
            mdQ = select_modes(mdQ, (0, 2, 1))
            num_batch = cute.size(mCuSeqlensQ.shape[0]) - 1
            if const_expr(self.worklist):
                num_batch = cute.size(mCuSeqlensQ.shape[0]) // WORKLIST_COLUMNS
            grid_m = m_blocks
        num_heads = cute.size(mdQ.shape[2])
        tiled_mma = dq_tiled_mma(self.dtype, self.tile_m, self.head_dim)
        self.use_tma = not self.accumulate and not self.varlen and mdQ.element_type == self.dtype
        self.use_tma = self.use_tma and not (self.dq_fixed and not self.fixed_to_float)
        tma_atom, tma_dQ = None, None
        self.sdQ_layout = smem_layout_kmajor(self.dtype, self.tile_m, self.head_dim,
                                             atom_cols=dq_wg_cols(self.tile_m, self.head_dim))
        if const_expr(self.use_tma):
            tma_atom, tma_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mdQ, self.sdQ_layout, (self.tile_m, self.head_dim)
            )

        staged_type, staged_elems = self.dtype, cute.cosize(self.sdQ_layout)
        if const_expr(self.accumulate):
            staged_type, staged_elems = self.add_type, self.tile_m * self.add_pitch

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[staged_type, staged_elems], 1024]

        self.shared_storage = SharedStorage
        self.kernel(mdQacc, mdQ, mScale2, tma_dQ, tma_atom, tiled_mma, mCuSeqlensQ, self.sdQ_layout, grid_m).launch(
            grid=row_tile_grid(grid_m, num_heads, num_batch), block=[256, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mScale2: Optional[cute.Tensor], mdQ_tma: Optional[cute.Tensor],
        tma_atom: Optional[cute.CopyAtom], tiled_mma: cute.TiledMma, mCuSeqlensQ: Optional[cute.Tensor],
        sdQ_layout: cute.ComposedLayout, grid_m: Int32,
    ):
        tm, D = self.tile_m, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = row_tile_of(grid_m)
        num_heads = cute.size(mdQ.shape[2])
        seqlen = SeqlenInfo.create_q(batch, mdQ, mCuSeqlensQ, varlen=self.varlen, scratch_tile_m=tm,
                                     worklist=self.worklist)
        seqlen_q, blk_base = seqlen.seqlen_q, seqlen.scratch_base
        if const_expr(self.varlen):
            mdQ_cur = cute.domain_offset((seqlen.offset_q, 0), mdQ[None, None, head])
        else:
            mdQ_cur = mdQ[None, None, head, batch]

        if m_block * tm < seqlen_q:
            chunk = (blk_base + m_block) * num_heads + head
            n_chunks = cute.size(mdQacc.shape[0]) // (tm * D)
            gacc = cute.make_tensor(mdQacc.iterator, dq_chunk_layout(tm, D, n_chunks))
            wg = tidx // 128
            t = tidx - wg * 128
            wg_layout = cute.make_layout(2, stride=128)
            acc_shape = tiled_mma.get_slice(wg_layout(wg)).partition_shape_C((tm, D))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_type)
            src = gacc[None, t, None, wg, chunk]
            flat = cute.make_tensor(acc.iterator, cute.make_layout(src.shape))
            cute.autovec_copy(src, flat)
            if const_expr(self.fixed_to_float):
                # each row's integer sum, rounded once to fp32, times 2^-s (exact: a power of two)
                fixed = acc
                acc = cute.make_rmem_tensor(acc_shape, Float32)
                acc.store(fixed.load().to(Float32))
                acc_mn = mn_view(acc)
                rows = mn_view(tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((tm, D))))
                gscale = cute.make_tensor(mScale2.iterator + chunk * tm, cute.make_layout(tm))
                for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
                    inverse = Float32(1.0) / gscale[rows[r, 0][0]]
                    for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                        acc_mn[r, c] = acc_mn[r, c] * inverse

            if const_expr(self.use_tma):
                # fragments -> smem (stmatrix) -> one TMA store of the chunk (rows past seqlen_q are clipped)
                storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
                sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
                rdQ = cute.make_rmem_tensor_like(acc, self.dtype)
                rdQ.store(acc.load().to(self.dtype))
                store_tile_tma(tiled_mma, rdQ, sdQ, tma_atom, mdQ_tma[None, None, head, batch], (tm, D),
                               (m_block, 0), tidx)
                if tidx < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            elif const_expr(self.accumulate):
                self.add_rows_bulk(acc, mdQ_cur, tiled_mma.get_slice(tidx), m_block, seqlen_q, tidx)
            else:
                store_acc_rows(acc, mdQ_cur, tiled_mma.get_slice(tidx), (tm, D), m_block, seqlen_q, False)

    @cute.jit
    def add_rows_bulk(self, acc: cute.Tensor, mdst: cute.Tensor, thr_mma, m_block: Int32, seqlen: Int32,
                      tidx: Int32):
        """The fragments -> a padded row-major smem tile -> one bulk reduction (+=) per row of tile ``m_block`` of
        mdst that is below ``seqlen``, issued by the row's own thread, which waits until its row has been read."""
        tm, D = self.tile_m, self.head_dim
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        staged = storage.sdQ.get_tensor(cute.make_layout((tm, D), stride=(self.add_pitch, 1)))
        tstaged = mn_view(thr_mma.partition_C(staged))
        acc_mn = mn_view(acc)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            cute.autovec_copy(acc_mn[r, None], tstaged[r, None])
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> the bulk reductions (async proxy)
        cute.arch.barrier()
        if tidx < tm:
            if m_block * tm + tidx < seqlen:
                gdst = cute.local_tile(mdst, (tm, D), (m_block, 0))
                add = bulk_reduce_add_u64 if const_expr(self.add_type == cutlass.Int64) else bulk_reduce_add_f32
                add(staged[tidx, None].iterator, gdst[tidx, None].iterator, D * (self.add_type.width // 8))
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
