"""Hopper (sm_90a) attention forward kernel written in CuTe DSL.

Structure (one CTA = one query tile of ``tile_m`` rows of one (head, batch), tile_scheduler.fwd_work_tile; or with
``persistent_ctas`` one CTA per SM walking tiles, tile_scheduler.persistent_turn, each role's pipeline states running
on from one tile into the next):
  * warpgroup 0 is the producer: its first warp issues TMA loads of Q (once) and of K/V tiles (multi-stage
    ring, PipelineTmaAsync) and then idles with few registers (setmaxnreg.dec);
  * warpgroups 1..num_wg are consumers: each owns 64 query rows of the tile. S = Q K^T and O += P V run on
    wgmma (P is fed from registers), the online softmax (softmax.py) runs in exp2 with the softmax scale folded
    into one FFMA, and the O rescale is skipped when no row max of the warp grew past a threshold.
  * Optional intra-warpgroup overlap: the QK^T of block j is issued together with the PV of block j-1, so the
    softmax of block j overlaps the tensor cores; optional inter-warpgroup "scheduler" named barriers make the
    consumer warpgroups take turns issuing their wgmmas.
  * Epilogue: normalisation (with the optional per-head sink logit in the denominator), then either a plain
    store of O (q dtype) and LSE (natural log), or the accumulate-merge of this block's (O, LSE) into a running
    fp32 (out, lse) pair.

Masking (mask.py, block_info.py): key tiles entirely masked are never loaded or computed; tiles entirely visible
run without mask math; rows without any visible key produce O = 0, LSE = -inf.

Non-finite values (sanitize.py): a masked pair contributes nothing, whatever V holds there. The V tiles of the
masked blocks (diagonal, document boundary, sequence end) go through warps 1-3 of the producer warpgroup
before the consumers see them: the TMA lands them on a separate barrier, the sanitizer warps zero rows holding
NaN / inf and publish the first bad row, then release the tile. The consumers mark the rows that see that key
(their O becomes NaN; their lse, which V does not enter, stays); K needs no such care (masked scores are replaced
by a select). A row whose softmax is undefined (all scores -inf, or NaN) gets lse = NaN; -inf only means "saw
no key".

This module imports cutlass at import time: import it lazily.
"""

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .barriers import FwdBarrier
from .block_info import WORKLIST_COLUMNS, BlockInfo, SeqlenInfo
from .common_sm90 import (
    Context,
    acc_to_operand_a,
    check_smem,
    descriptor_hoister,
    elected_lane,
    fma_rn,
    k_slices,
    mn_view,
    mul_rn,
    prefetch_l2,
    prefetch_l2_bulk,
    select_modes,
    smem_layout_kmajor,
    stage_release,
    stage_wait,
    store_tile_tma,
    tma_pipeline,
    tma_tile_partition,
    to_16bit,
    transpose_smem,
    true_after,
    wgmma_gemm,
)
from .mask import AttentionMask
from .sanitize import NONE, block_any, clear_nonfinite_rows, clear_nonfinite_rows_marking, tile_maybe_nonfinite
from .softmax import (
    LN_2,
    LOG2_E,
    OnlineSoftmax,
    merge_lse,
    nan_max,
    softcap_fixed_row_max,
    softcap_scale_log2,
    softcap_scores,
)
from .split_plans import launch_items
from .tile_scheduler import TileClaims, fwd_work_tile, parts_first, parts_last, persistent_turn


# a tile of at most this many key blocks prefetches its running (out, lse) at its start: ~1.7 us per block at
# hdim 128 against ~2 us for an SM's share of HBM bandwidth to bring 64 KB when every SM does it at once
PREFETCH_LEAD_BLOCKS = 4


class FlashFwdSm90:
    """Static configuration of one compiled forward variant."""

    def __init__(
        self,
        dtype,
        head_dim: int,
        *,
        causal: bool,
        varlen: bool,
        accumulate: bool,
        seg_offsets: bool = False,
        tile_m: int = 128,
        tile_n: int = 128,
        num_stages: int = 2,
        intra_wg_overlap: bool = True,
        sched_barrier: bool = True,
        rescale_threshold: float = 0.0,
        sum_from_old: bool = False,
        chained_max: bool = False,
        late_pv_wait: bool = False,
        hoist_descriptors: bool = True,
        hoist_q_slices: bool = True,
        tma_store_o: bool = True,
        sanitize: bool = True,
        defer_v_marks: bool = True,
        l2_rows: Optional[int] = None,
        interleave_lengths: bool = False,
        window_left: int = -1,
        softcap: float = 0.0,
        sinks: bool = False,
        softcap_fixed_max: bool = True,
        worklist: bool = False,
        prefetch_running: bool = True,
        persistent_ctas: int = 0,
        dynamic_tiles: bool = True,
        reset_counter: bool = False,
        exact_merge: bool = False,
        regs_producer: int = 0,
        ctas_per_sm: int = 1,
        split_tail: bool = False,
        pdl: bool = False,
        elect_release: bool = False,
        late_k_release: bool = False,
    ):
        assert tile_m % 64 == 0 and tile_m // 64 in (1, 2, 3)
        assert head_dim % 16 == 0 and tile_n % 16 == 0
        assert window_left < 0 or causal, "a sliding window comes with the causal upper edge (see backend.py)"
        self.window_left = window_left
        self.softcap = float(softcap)  # > 0: scores capped to softcap * tanh(. / softcap); scale_log2 = tanh scale
        # capped scores are bounded: a constant row max where P's range allows (softmax.softcap_fixed_row_max)
        self.fixed_row_max = (softcap_fixed_row_max(self.softcap, dtype == cutlass.Float16)
                              if softcap_fixed_max else None)
        # one learned logit per query head joins each row's denominator in the epilogue (non-accumulate only: a
        # running result takes its sinks once, from the contract, after its last block)
        assert not (sinks and accumulate), "sinks enter a row once: not in an accumulate-merge"
        self.sinks = sinks
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.varlen = varlen
        # a work list: packed tensors, mCuSeqlensQ is the item table (block_info.WORKLIST_COLUMNS), one "sequence"
        # per item with its own query rows, key rows and diagonal
        assert not worklist or (varlen and not seg_offsets)
        self.worklist = worklist
        self.accumulate = accumulate
        # accumulate: the producer warp asks L2 for the running (out, lse) of the tile once its last K/V load is
        # out, so the epilogue's reads of them hit L2 instead of waiting on HBM
        self.prefetch_running = prefetch_running and accumulate
        self.seg_offsets = seg_offsets
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.num_wg = tile_m // 64
        self.intra_wg_overlap = intra_wg_overlap
        self.sched_barrier = sched_barrier and self.num_wg >= 2 and intra_wg_overlap
        self.rescale_threshold = float(rescale_threshold)
        self.sum_from_old = sum_from_old  # the row sum's order (softmax.OnlineSoftmax.online)
        self.chained_max = chained_max  # the row max as flash-attn-4 takes it (softmax.max_chains)
        # flash-attn-4's forms in the overlapped step: each K / V barrier tried once before the blocking wait loop,
        # and P converted with inline cvts; ptxas then places the PV wait among the exponentials instead of before
        # them (NOTES_FWD.md, fourteenth session)
        self.late_pv_wait = late_pv_wait
        # the overlapped step's stage releases by elect.sync's winner, taken every step (elect_release) or once per
        # tile with the K release after the step's softmax (late_k_release): FwdConfig
        self.elect_release, self.late_k_release = elect_release, late_k_release
        self.elected_releases = elect_release or late_k_release
        self.hoist_descriptors = hoist_descriptors
        self.hoist_q_slices = hoist_q_slices and hoist_descriptors
        # O through smem (reusing sQ) and one TMA store; dense, non-accumulate, 16-bit out only
        self.tma_store_o = tma_store_o and not varlen and not accumulate
        # > 0: a persistent grid of at most this many CTAs (one per SM), each walking tiles in launch order
        # (tile_scheduler.persistent_turn): the next tile's K and Q loads overlap this tile's epilogue. O is then
        # staged in its own smem buffer (sO), so the next Q can land while this tile's O is stored. Which variants
        # may run persistent is FwdConfig.persistent's rule; its build passes 0 for the others
        self.persistent = persistent_ctas > 0
        assert not (self.persistent and varlen and not dynamic_tiles), "packed persistent grids need dynamic_tiles"
        self.persistent_ctas = persistent_ctas
        self.separate_o = self.persistent and self.tma_store_o
        # a persistent CTA's next tile comes from a global counter (tile_scheduler.TileClaims) instead of the
        # static walk
        self.dynamic_tiles = dynamic_tiles and self.persistent
        # the launch's last claim sets the counter back to 0 (TileClaims.reset_after_last): the host may pass a
        # reused one
        self.reset_counter = reset_counter and self.dynamic_tiles
        # the tiles that make a few-wave launch's tail run as parts over their key blocks, merged by the last part
        # to finish (epilogue_split): non-causal the last partial wave's tiles, claimed last (split_plans.split_plan),
        # causal the longest tiles, claimed first (split_plans.causal_split_plan); dense fresh launches, dynamic grid
        self.split_tail = split_tail
        assert not split_tail or (self.dynamic_tiles and not varlen and not accumulate and not sinks
                                  and not worklist and window_left < 0 and intra_wg_overlap)
        # accumulate: the merge's o_old * w_old + o_blk with fixed roundings (an fma of a separately rounded
        # product), so that every compiled variant merges to the same bits; otherwise ptxas picks which product to
        # fuse, and persistent and one-CTA-per-tile kernels were measured 1-2 ulp apart
        self.exact_merge = exact_merge and accumulate
        # programmatic dependent launch: the launch may start while the kernel before it in the stream finishes.
        # Each CTA lets its own dependents launch at its start, and the epilogue waits for the previous grid (its
        # writes then visible) before it reads or writes out / lse; Q, K, V and the table are read before that wait,
        # so the caller promises that the previous kernel did not write them. One CTA per tile only: a persistent
        # grid's tile counter would be shared with the launch it overlaps
        assert not pdl or not self.persistent, "pdl: one CTA per tile"
        self.pdl = pdl
        self.num_threads = 128 * (self.num_wg + 1)
        self.regs_producer, self.regs_consumer = {1: (56, 256), 2: (24, 240), 3: (32, 160)}[self.num_wg]
        if ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm}")
        self.ctas_per_sm = ctas_per_sm
        if ctas_per_sm > 1 and not regs_producer:
            regs_producer = 24
        if regs_producer:
            # another split of the registers the CTA launches with (64K over its warpgroups, in multiples of 8 per
            # thread: 168 each for 3 warpgroups): the consumers take what the producer warpgroup leaves
            # (setmaxnreg, multiples of 8). More for the producer moves a persistent walk's spills out of it (hdim
            # 96 causal: 32 / 232, NOTES_FWD.md)
            per_thread = 65536 // ctas_per_sm // (128 * (self.num_wg + 1)) // 8 * 8
            assert regs_producer % 8 == 0 and 24 <= regs_producer < per_thread, regs_producer
            self.regs_producer = regs_producer
            self.regs_consumer = min((per_thread * (self.num_wg + 1) - regs_producer) // self.num_wg // 8 * 8, 256)
        elem = dtype.width // 8
        # K+V rows of a group of heads that we try to keep resident in L2 (grouping of heads for causal LPT):
        # 16 MB at hdim 128, 24 MB below (measured on the H200 at 4k-32k, NOTES_FWD.md, thirteenth session)
        if l2_rows is None:
            l2_rows = ((16 if head_dim >= 128 else 24) * 1024 * 1024) // (2 * head_dim * elem)
        self.l2_rows = l2_rows
        # causal: long and short query tiles alternate in the launch order (tile_scheduler.causal_m_block)
        self.interleave_lengths = interleave_lengths and causal
        self.block_info = BlockInfo(tile_m, tile_n, causal, window_left)
        # V tiles of masked blocks go through the sanitizer warps (dense non-causal: TMA zero-fills past the end)
        self.sanitize_v = sanitize and (causal or varlen)
        # a masked block's bad-V rows marked at the end of the step that issues its PV (overlap_phases_deferred),
        # so that the consumer does not wait for the sanitizer before the next S GEMM
        self.defer_v_marks = defer_v_marks and self.sanitize_v and intra_wg_overlap
        self.fp16 = dtype == cutlass.Float16
        self.sanitizer_threads = 96  # warps 1..3 of the producer warpgroup
        # smem words per stage telling the consumers which V rows held NaN / inf: the first such row, or with a
        # window (rows see an interval of a tile's keys) a bitmask of all of them
        self.bad_v_words = tile_n // 32 if window_left >= 0 else 1

    # ------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d) | varlen (t_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d) | varlen (t_k, h_kv, d)
        mV: cute.Tensor,
        mO: cute.Tensor,  # like q (q dtype, or fp32 running output when accumulating)
        mLSE: cute.Tensor,  # (b, h, s_q) | varlen (h, t_q), fp32
        scale_log2: Float32,  # softmax_scale * log2(e)
        diag: Int32,  # q_offset - k_offset (plus per-sequence offsets mSegOffQ/K when given)
        max_seqlen_q: Int32,  # varlen: longest segment (upper bound is fine); else ignored
        mCuSeqlensQ: Optional[cute.Tensor],  # varlen: (nseg + 1,); worklist: the flat item table
        mCuSeqlensK: Optional[cute.Tensor],  # varlen only (None with a work list)
        mSegOffQ: Optional[cute.Tensor],
        mSegOffK: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],  # (h,) fp32 sink logits when self.sinks
        mTileCounter: Optional[cute.Tensor],  # dynamic_tiles: (1,) int32, zero at launch (split_tail: 1 + split tiles)
        mSplitO: Optional[cute.Tensor],  # split_tail: (parts' slots * tile_m, d) fp32 scratch of the parts' out
        mSplitLSE: Optional[cute.Tensor],  # split_tail: (parts' slots * tile_m,) fp32, their lse
        split_edge: Optional[Int32],  # split_tail: non-causal the first split tile, causal how many (split_plans)
        split_parts: Optional[Int32],  # split_tail: parts per split tile
        stream,
    ):
        if const_expr(not self.varlen):
            mQ, mO = [select_modes(t, (1, 3, 2, 0)) for t in (mQ, mO)]  # (s, d, h, b)
            mK, mV = [select_modes(t, (1, 3, 2, 0)) for t in (mK, mV)]
            mLSE = select_modes(mLSE, (2, 1, 0))  # (s, h, b)
        else:
            mQ, mO = [select_modes(t, (0, 2, 1)) for t in (mQ, mO)]  # (t, d, h)
            mK, mV = [select_modes(t, (0, 2, 1)) for t in (mK, mV)]
            mLSE = select_modes(mLSE, (1, 0))  # (t, h)

        D = self.head_dim
        self.sQ_layout = smem_layout_kmajor(self.dtype, self.tile_m, D)
        self.sK_layout = smem_layout_kmajor(self.dtype, self.tile_n, D, self.num_stages)
        self.sV_layout = smem_layout_kmajor(self.dtype, self.tile_n, D, self.num_stages)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.num_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(self.num_wg, 1, 1),
            tiler_mn=(64, D),
            a_source=warpgroup.OperandSource.RMEM,
        )

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ, self.sQ_layout, (self.tile_m, D))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(self.sK_layout, mode=[0, 1]), (self.tile_n, D), 1
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.select(self.sV_layout, mode=[0, 1]), (self.tile_n, D), 1
        )
        self.use_tma_o = self.tma_store_o and mO.element_type == self.dtype
        tma_atom_O, tma_O = None, None
        if const_expr(self.use_tma_o):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, self.sQ_layout, (self.tile_m, D)
            )
        self.bytes_q = cute.size_in_bytes(self.dtype, self.sQ_layout)
        self.bytes_kv = cute.size_in_bytes(self.dtype, cute.select(self.sK_layout, mode=[0, 1]))

        def smem_tile(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]

        fields = dict(
            mbar_q=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_k=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            mbar_v=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            mbar_vland=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],  # V tiles to sanitize land here
            # per stage: the first row that held NaN / inf (with a window: a bitmask of every such row)
            sVbad=cute.struct.MemRange[Int32, self.bad_v_words * self.num_stages],
            sQ=smem_tile(self.sQ_layout),
            sK=smem_tile(self.sK_layout),
            sV=smem_tile(self.sV_layout),
        )
        if const_expr(self.separate_o):
            fields["sO"] = smem_tile(self.sQ_layout)
        if const_expr(self.dynamic_tiles):
            fields["mbar_tile"] = cute.struct.MemRange[cutlass.Int64, 2 * TileClaims.STAGES]
            fields["sTile"] = cute.struct.MemRange[Int32, TileClaims.STAGES]  # claimed tile indices in flight
        if const_expr(self.split_tail):
            fields["sSplit"] = cute.struct.MemRange[Int32, 1]  # a part's arrival count, for the consumer threads
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        check_smem(self.shared_storage, self.ctas_per_sm)

        num_heads = cute.size(mQ.shape[2])
        if const_expr(not self.varlen):
            num_batch = cute.size(mQ.shape[3])
            num_m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m)
        elif const_expr(self.worklist):
            num_batch = cute.size(mCuSeqlensQ.shape[0]) // WORKLIST_COLUMNS
            num_m_blocks = cute.ceil_div(max_seqlen_q, self.tile_m)
        else:
            num_batch = cute.size(mCuSeqlensQ.shape[0]) - 1
            num_m_blocks = cute.ceil_div(max_seqlen_q, self.tile_m)
        num_tiles = num_m_blocks * num_heads * num_batch
        if const_expr(self.split_tail):
            num_tiles = launch_items(self.causal, num_tiles, split_edge, split_parts)
        grid = (num_tiles, 1, 1)
        if const_expr(self.persistent):
            grid = (cutlass.min(num_tiles, Int32(self.persistent_ctas)), 1, 1)

        self.kernel(
            tma_Q,
            tma_K,
            tma_V,
            mO,
            mLSE,
            tma_O,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            tma_atom_O,
            tiled_mma_qk,
            tiled_mma_pv,
            scale_log2,
            diag,
            num_m_blocks,
            num_batch,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSegOffQ,
            mSegOffK,
            mSinks,
            mTileCounter,
            mSplitO,
            mSplitLSE,
            split_edge,
            split_parts,
            self.sQ_layout,
            self.sK_layout,
            self.sV_layout,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            # (all of the SM's memory as shared memory; also spares the DSL a device query for two CTAs per SM)
            preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None,
            use_pdl=self.pdl,
        )

    # ------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mO_tma: Optional[cute.Tensor],
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        scale_log2: Float32,
        diag: Int32,
        num_m_blocks: Int32,
        num_batch: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSegOffQ: Optional[cute.Tensor],
        mSegOffK: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        mSplitO: Optional[cute.Tensor],
        mSplitLSE: Optional[cute.Tensor],
        split_edge: Optional[Int32],
        split_parts: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()  # (the next launch may take SMs this grid's tail leaves)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
            if const_expr(tma_atom_O is not None):
                cpasync.prefetch_descriptor(tma_atom_O)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        consumer_warps = self.num_wg * 4
        pipe_q = tma_pipeline(storage.mbar_q.data_ptr(), 1, consumer_warps, self.bytes_q)
        pipe_k = tma_pipeline(storage.mbar_k.data_ptr(), self.num_stages, consumer_warps, self.bytes_kv)
        pipe_v = tma_pipeline(storage.mbar_v.data_ptr(), self.num_stages, consumer_warps, self.bytes_kv)
        pipe_vland = None
        if const_expr(self.sanitize_v):
            pipe_vland = tma_pipeline(storage.mbar_vland.data_ptr(), self.num_stages, self.sanitizer_threads // 32,
                                      self.bytes_kv)
        claims = None
        if const_expr(self.dynamic_tiles):
            # every consumer warp and sanitizer warp reads each claimed tile index
            claims = TileClaims.create(storage.mbar_tile.data_ptr(),
                                       storage.sTile.get_tensor(cute.make_layout(TileClaims.STAGES)), mTileCounter,
                                       consumer_warps + (self.sanitizer_threads // 32 if self.sanitize_v else 0))
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)

        io = Context(
            mQ=mQ, mK=mK, mV=mV, mO=mO, mLSE=mLSE, mO_tma=mO_tma, mSinks=mSinks,
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            tma_atom_Q=tma_atom_Q, tma_atom_K=tma_atom_K, tma_atom_V=tma_atom_V, tma_atom_O=tma_atom_O,
            pipe_q=pipe_q, pipe_k=pipe_k, pipe_v=pipe_v, pipe_vland=pipe_vland,
            sVbad=storage.sVbad.get_tensor(cute.make_layout((self.bad_v_words, self.num_stages))),
            sO=(storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner) if const_expr(self.separate_o)
                else None),
            claims=claims,
            mTileCounter=mTileCounter, mSplitO=mSplitO, mSplitLSE=mSplitLSE,
            sSplit=storage.sSplit.get_tensor(cute.make_layout(1)) if const_expr(self.split_tail) else None,
        )
        launch = Context(diag=diag, num_m_blocks=num_m_blocks, num_batch=num_batch, mCuSeqlensQ=mCuSeqlensQ,
                         mCuSeqlensK=mCuSeqlensK, mSegOffQ=mSegOffQ, mSegOffK=mSegOffK, split_edge=split_edge,
                         split_parts=split_parts)

        # the one work tile of a non-persistent CTA (identical in every warp); a persistent CTA finds its tiles in
        # each role's tile loop (the roles walk the same tiles, so their pipeline states stay in step)
        first = None
        if const_expr(not self.persistent):
            first = self.work_at(io, launch, None)

        pipeline.pipeline_init_wait(cluster_shape_mn=None)

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            # ============================ producer ============================
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:
                self.producer_role(io, launch, first)
            if const_expr(self.sanitize_v):
                if warp_idx > 0:
                    self.sanitizer_role(io, launch, first, tidx - 32)
        else:
            # ============================ consumers ===========================
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consumer_role(io, launch, first, tiled_mma_qk, tiled_mma_pv, scale_log2)

    # ------------------------------------------------------------------------
    @cute.jit
    def work_at(self, io: Context, launch: Context, tile_idx):
        """(tile, seqlen, tile_valid, blk) of launch-order tile ``tile_idx`` (None: this CTA's blockIdx.x): the
        work tile, its sequence and its key-block range in processing phases. With split_tail some indices are
        parts, the p-th of ``parts`` consecutive runs of a split tile's key blocks (blk.split_tile: the tile's
        index among the split ones; blk.split_slot = split_tile * parts + p, blk.split_part = p): non-causal,
        index split_edge + i * parts + p is part p of tile split_edge + i (the last partial wave, after every whole
        tile); causal, index i * parts + p is part p of tile i < split_edge (the longest tiles, claimed first), and
        the other tiles follow whole."""
        base_idx = tile_idx
        split_rel = split_tile = split_part = None
        if const_expr(self.split_tail):
            decode = parts_first if const_expr(self.causal) else parts_last
            base_idx, split_rel, split_tile = decode(tile_idx, launch.split_edge, launch.split_parts)
            split_part = split_rel - split_tile * launch.split_parts
        # (a causal split launch orders its tiles longest first over every head: all of them are in flight at once,
        # so the L2 head groups do not matter, and the split tiles must be the longest)
        tile = fwd_work_tile(io.mQ, io.mK, launch.num_m_blocks, launch.num_batch, causal=self.causal,
                             varlen=self.varlen, l2_rows=self.l2_rows,
                             interleave=self.interleave_lengths and not self.split_tail, tile_idx=base_idx,
                             longest_first_over_heads=self.causal and self.split_tail)
        seqlen = SeqlenInfo.create(tile.batch, io.mQ, io.mK, launch.diag, launch.mCuSeqlensQ, launch.mCuSeqlensK,
                                   launch.mSegOffQ, launch.mSegOffK, varlen=self.varlen,
                                   seg_offsets=self.seg_offsets, worklist=self.worklist)
        tile_valid, n_block_min, n_block_max, n_block_causal, n_block_window_end = self.block_info.key_blocks(
            seqlen, tile.block)
        if const_expr(self.split_tail):
            if split_rel >= 0:  # (phases below give each part its own masked blocks)
                n_all = n_block_max - n_block_min
                n_lo = n_block_min + split_part * n_all // launch.split_parts
                n_block_max = n_block_min + (split_part + 1) * n_all // launch.split_parts
                n_block_min = n_lo
        n_masked, n_plain, n_window = self.block_info.phases(n_block_min, n_block_max, n_block_causal,
                                                             n_block_window_end)
        blk = Context(n_block_min=n_block_min, n_block_max=n_block_max, n_blocks=n_block_max - n_block_min,
                      n_masked=n_masked, n_plain=n_plain, n_window=n_window, split_slot=split_rel,
                      split_part=split_part, split_tile=split_tile, split_parts=launch.split_parts)
        return tile, seqlen, tile_valid, blk

    @cute.jit
    def persistent_grid(self, io: Context, launch: Context):
        """(num_ctas, num_tiles, turns) of a persistent CTA: every CTA takes the same number of turns (a turn past
        the last tile is skipped). With split_tail a split tile counts once per part."""
        num_ctas = cute.arch.grid_dim()[0]
        num_tiles = launch.num_m_blocks * cute.size(io.mQ.shape[2]) * launch.num_batch
        if const_expr(self.split_tail):
            num_tiles = launch_items(self.causal, num_tiles, launch.split_edge, launch.split_parts)
        return num_ctas, num_tiles, cute.ceil_div(num_tiles, num_ctas)

    @cute.jit
    def walk_tiles(self, io: Context, launch: Context, body, state, claimer: bool):
        """A persistent CTA's tiles for one role: ``state = body(t, state)`` for each tile index t it takes, in the
        static walk (tile_scheduler.persistent_turn) or with dynamic_tiles as claimed (``claimer``: this warp, the
        producer, claims each next tile once its loads of the current one are out, and hands it to the readers);
        returns the final state."""
        num_ctas, num_tiles, turns = self.persistent_grid(io, launch)
        if const_expr(self.dynamic_tiles):
            # the producer claims a next tile about two key blocks before the CTA runs dry
            state = io.claims.walk(body, state, num_tiles, num_ctas, claimer, resets=self.reset_counter)
        else:
            for turn in cutlass.range(turns, unroll=1):
                t = persistent_turn(turn, num_ctas)
                if t < num_tiles:
                    state = body(t, state)
        return state

    @cute.jit
    def producer_role(self, io: Context, launch: Context, first):
        """Warp 0: the TMA loads of every tile of the CTA."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        land_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if const_expr(self.persistent):
            self.walk_tiles(io, launch, lambda t, st: self.produce_at(io, launch, t, *st),
                            (q_state, kv_state, land_state), True)
        else:
            tile, seqlen, _, blk = first
            if blk.n_blocks > 0:
                self.produce(io, tile, seqlen, blk, q_state, kv_state, land_state)

    @cute.jit
    def produce_at(self, io: Context, launch: Context, t: Int32, q_state, kv_state, land_state):
        """A persistent CTA's loads of tile ``t`` (none for a tile without key blocks)."""
        tile, seqlen, _, blk = self.work_at(io, launch, t)
        if blk.n_blocks > 0:
            q_state, kv_state, land_state = self.produce(io, tile, seqlen, blk, q_state, kv_state, land_state)
        return q_state, kv_state, land_state

    @cute.jit
    def sanitizer_role(self, io: Context, launch: Context, first, tid: Int32):
        """Warps 1-3: the V tiles of every tile's masked blocks (sanitize_v_tiles)."""
        land_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        if const_expr(self.persistent):
            # (with the K/V ring's stage of each tile's first block)
            self.walk_tiles(io, launch, lambda t, st: self.sanitize_at(io, launch, t, tid, *st),
                            (land_state, Int32(0)), False)
        else:
            self.sanitize_v_tiles(io, first[3], tid, land_state, None)

    @cute.jit
    def sanitize_at(self, io: Context, launch: Context, t: Int32, tid: Int32, land_state, kv_base: Int32):
        """A persistent CTA's sanitizer work for tile ``t``; returns the landing state and the ring's stage at the
        next tile's first block."""
        _, _, _, blk = self.work_at(io, launch, t)
        land_state = self.sanitize_v_tiles(io, blk, tid, land_state, kv_base)
        return land_state, (kv_base + blk.n_blocks) % self.num_stages

    @cute.jit
    def consumer_role(self, io: Context, launch: Context, first, tiled_mma_qk, tiled_mma_pv, scale_log2: Float32):
        """The consumer warpgroups: every tile's main loop and epilogue."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        mmas = Context(tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, scale_log2=scale_log2)
        if const_expr(self.persistent):
            if const_expr(self.sched_barrier):
                # one turn token for the whole kernel: every tile's steps pass it on, the last one back to
                # warpgroup 0 (a tile without steps leaves it there)
                tidx, _, _ = cute.arch.thread_idx()
                if cute.arch.make_warp_uniform((tidx - 128) // 128) == 0:
                    cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.SCHED_WG0), number_of_threads=256)
            self.walk_tiles(io, launch, lambda t, st: self.consume_at(io, launch, mmas, t, *st),
                            (kv_state, q_state), False)
            if const_expr(self.separate_o):
                tidx, _, _ = cute.arch.thread_idx()
                if tidx - 128 < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO stays allocated until read
        else:
            tile, seqlen, tile_valid, blk = first
            if tile_valid:
                self.consume(io, tiled_mma_qk, tiled_mma_pv, scale_log2, tile, seqlen, blk, kv_state, q_state)

    @cute.jit
    def consume_at(self, io: Context, launch: Context, mmas: Context, t: Int32, kv_state, q_state):
        """A persistent CTA's main loop and epilogue of tile ``t`` (none for a tile past its sequence)."""
        tile, seqlen, tile_valid, blk = self.work_at(io, launch, t)
        if tile_valid:
            kv_state, q_state = self.consume(io, mmas.tiled_mma_qk, mmas.tiled_mma_pv, mmas.scale_log2, tile, seqlen,
                                             blk, kv_state, q_state)
        return kv_state, q_state

    @cute.jit
    def produce(self, io: Context, tile, seqlen: SeqlenInfo, blk: Context, q_state, kv_state, land_state):
        """One tile's loads: K first, then Q, then K/V in the consumers' order; returns the advanced states."""
        D = self.head_dim
        head, head_kv, batch = tile.head, tile.head_kv, tile.batch
        if const_expr(not self.varlen):
            mQ_cur = io.mQ[None, None, head, batch]
            mK_cur = io.mK[None, None, head_kv, batch]
            mV_cur = io.mV[None, None, head_kv, batch]
        else:
            mQ_cur = cute.domain_offset((seqlen.offset_q, 0), io.mQ[None, None, head])
            mK_cur = cute.domain_offset((seqlen.offset_k, 0), io.mK[None, None, head_kv])
            mV_cur = cute.domain_offset((seqlen.offset_k, 0), io.mV[None, None, head_kv])
        gQ = cute.local_tile(mQ_cur, (self.tile_m, D), (tile.block, 0))
        gK = cute.local_tile(mK_cur, (self.tile_n, D), (None, 0))  # (tile_n, D, nblk)
        gV = cute.local_tile(mV_cur, (self.tile_n, D), (None, 0))
        tQsQ, tQgQ = tma_tile_partition(io.tma_atom_Q, io.sQ, gQ)
        tKsK, tKgK = tma_tile_partition(io.tma_atom_K, io.sK, gK)
        tVsV, tVgV = tma_tile_partition(io.tma_atom_V, io.sV, gV)
        pipe_q, pipe_k = io.pipe_q, io.pipe_k

        ld = Context(io=io, tVgV=tVgV, tVsV=tVsV)

        n_block_max, n_blocks = blk.n_block_max, blk.n_blocks
        n_block = n_block_max - 1
        n_san_top, n_san_bottom = self.sanitized_v_counts(blk)
        # first K tile goes out before Q so that both land together
        pipe_k.producer_acquire(kv_state)
        cute.copy(io.tma_atom_K, tKgK[None, n_block], tKsK[None, kv_state.index],
                  tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
        pipe_q.producer_acquire(q_state)
        cute.copy(io.tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        # the running (out, lse) of a short tile is asked for now (its last loads would leave too little time)
        prefetch_early = n_blocks <= PREFETCH_LEAD_BLOCKS
        if const_expr(self.prefetch_running):
            if prefetch_early:
                self.prefetch_running_tile(io, tile, seqlen)
        # V tiles of the masked blocks (sanitized_v_counts) land on the sanitizer's barrier instead
        san = self.sanitize_v
        if const_expr(self.intra_wg_overlap):
            # consumer order: K(n), [K(n-1), V(n)], [K(n-2), V(n-1)], ..., V(n_block_min)
            n_pairs = n_blocks - 1
            # pair i loads K(i + 1) and V(i), in three runs: sanitized V (the top masked blocks), plain V, and
            # sanitized V again (the window's bottom blocks). (The runs as one trace-time loop over (kind, start,
            # end) hoisted the plain run's end above the first loop: not the PTX verified on the GPU, so not taken.)
            n_pairs_sanitized = Int32(0)
            if const_expr(san):
                n_pairs_sanitized = cutlass.min(n_san_top, n_pairs)
                for i in cutlass.range(n_pairs_sanitized, unroll=1):
                    n_prev = n_block_max - 1 - i
                    prev_state = kv_state.clone()
                    kv_state.advance()
                    self.load_k(ld, tKgK, tKsK, kv_state, n_prev - 1)
                    self.load_v_sanitized(ld, prev_state, land_state, n_prev)
                    land_state.advance()
            n_pairs_plain_end = n_pairs
            if const_expr(san and self.block_info.windowed):
                n_pairs_plain_end = cutlass.min(cutlass.max(n_blocks - n_san_bottom, n_pairs_sanitized), n_pairs)
            for i in cutlass.range(n_pairs_sanitized, n_pairs_plain_end, unroll=1):
                n_prev = n_block_max - 1 - i
                prev_state = kv_state.clone()
                kv_state.advance()
                self.load_k(ld, tKgK, tKsK, kv_state, n_prev - 1)
                self.load_v(ld, prev_state, n_prev)
            if const_expr(san and self.block_info.windowed):
                for i in cutlass.range(n_pairs_plain_end, n_pairs, unroll=1):
                    n_prev = n_block_max - 1 - i
                    prev_state = kv_state.clone()
                    kv_state.advance()
                    self.load_k(ld, tKgK, tKsK, kv_state, n_prev - 1)
                    self.load_v_sanitized(ld, prev_state, land_state, n_prev)
                    land_state.advance()
            n_last = blk.n_block_min
            if const_expr(san):
                if n_san_top > n_pairs or n_san_bottom > 0:
                    self.load_v_sanitized(ld, kv_state, land_state, n_last)
                    land_state.advance()  # (a persistent CTA's next tile lands on the next stage)
                else:
                    self.load_v(ld, kv_state, n_last)
            else:
                self.load_v(ld, kv_state, n_last)
            kv_state.advance()
        else:
            if const_expr(san):
                if n_san_top > 0 or n_san_bottom >= n_blocks:
                    self.load_v_sanitized(ld, kv_state, land_state, n_block)
                else:
                    self.load_v(ld, kv_state, n_block)
                land_state.advance()
            else:
                self.load_v(ld, kv_state, n_block)
            kv_state.advance()
            for i in cutlass.range(n_blocks - 1, unroll=1):
                n = n_block_max - 2 - i
                self.load_k(ld, tKgK, tKsK, kv_state, n)
                if const_expr(san):
                    if i + 1 < n_san_top or i + 1 >= n_blocks - n_san_bottom:
                        self.load_v_sanitized(ld, kv_state, land_state, n)
                    else:
                        self.load_v(ld, kv_state, n)
                    land_state.advance()
                else:
                    self.load_v(ld, kv_state, n)
                kv_state.advance()
        if const_expr(self.prefetch_running):
            if not prefetch_early:
                self.prefetch_running_tile(io, tile, seqlen)
        q_state.advance()
        return q_state, kv_state, land_state

    @cute.jit
    def prefetch_running_tile(self, io: Context, tile, seqlen: SeqlenInfo):
        """Warp-wide: L2 prefetches of the tile's rows of the running fp32 out (one bulk prefetch of a row per
        lane and step) and of its running lse (a line per lane), rows past seqlen_q left alone. Issued after the
        last K/V load (about two key blocks, the pipeline's depth, before the epilogue reads them), or for a tile of
        at most PREFETCH_LEAD_BLOCKS blocks right after Q's load."""
        D = self.head_dim
        mO_cur, mL_cur = self.running_views(io, tile, seqlen)
        lane = cute.arch.lane_idx()
        first = tile.block * self.tile_m
        rows = cutlass.min(seqlen.seqlen_q - first, Int32(self.tile_m))
        for i in cutlass.range_constexpr(self.tile_m // 32):
            r = lane + i * 32
            if r < rows:
                prefetch_l2_bulk(cute.domain_offset((first + r, 0), mO_cur).iterator, D * 4)
        # the lse rows are contiguous: one line (32 floats) per lane, and the last row (the tile may reach into
        # one more line than tile_m / 32)
        if lane * 32 < rows:
            prefetch_l2(cute.domain_offset((first + lane * 32,), mL_cur).iterator)
        if lane == 0 and rows > 0:
            prefetch_l2(cute.domain_offset((first + rows - 1,), mL_cur).iterator)

    def row_sink(self, io: Context, tile):
        """The tile's head's sink logit (joins each row's denominator in the epilogue), or None without sinks."""
        return io.mSinks[tile.head] if self.sinks else None

    def running_views(self, io: Context, tile, seqlen: SeqlenInfo):
        """(out, lse) of the tile's sequence and head: (seqlen_q, D) and (seqlen_q,) views (the epilogues' outputs,
        and with accumulate=True the running result)."""
        if const_expr(not self.varlen):
            return io.mO[None, None, tile.head, tile.batch], io.mLSE[None, tile.head, tile.batch]
        return (cute.domain_offset((seqlen.offset_q, 0), io.mO[None, None, tile.head]),
                cute.domain_offset((seqlen.offset_q,), io.mLSE[None, tile.head]))

    @cute.jit
    def load_k(self, ld: Context, tKgK: cute.Tensor, tKsK: cute.Tensor, state, n: Int32):
        ld.io.pipe_k.producer_acquire(state)
        cute.copy(ld.io.tma_atom_K, tKgK[None, n], tKsK[None, state.index],
                  tma_bar_ptr=ld.io.pipe_k.producer_get_barrier(state))

    @cute.jit
    def load_v(self, ld: Context, state, n: Int32):
        """V(n) into the stage of ``state``, armed on the consumers' V barrier."""
        ld.io.pipe_v.producer_acquire(state)
        cute.copy(ld.io.tma_atom_V, ld.tVgV[None, n], ld.tVsV[None, state.index],
                  tma_bar_ptr=ld.io.pipe_v.producer_get_barrier(state))

    @cute.jit
    def load_v_sanitized(self, ld: Context, state, land_state, n: Int32):
        """V(n) into the stage of ``state``, landing on the sanitizer's barrier: the sanitizer, not the TMA,
        completes the consumers' V barrier of that stage."""
        ld.io.pipe_v.sync_object_empty.wait(state.index, state.phase)
        ld.io.pipe_vland.producer_acquire(land_state)
        cute.copy(ld.io.tma_atom_V, ld.tVgV[None, n], ld.tVsV[None, state.index],
                  tma_bar_ptr=ld.io.pipe_vland.producer_get_barrier(land_state))

    # ------------------------------------------------------------------------
    def sanitized_v_counts(self, blk: Context):
        """(n_top, n_bottom): the V tiles of the masked blocks go through the sanitizer, i.e. processing index i
        (block n_block_max - 1 - i) iff i < n_top (causal band, sequence end) or i >= n_blocks - n_bottom (the
        window's lower edge); the two sets never overlap (block_info.phases)."""
        return cutlass.min(blk.n_masked + 1, blk.n_blocks), blk.n_window

    @cute.jit
    def sanitize_v_tiles(self, io: Context, blk: Context, tid: Int32, land_state, kv_base):
        """Sanitizer warps: for each V tile of one work tile to sanitize, zero rows that hold NaN / inf, publish the
        first such row (sVbad[stage], NONE if none), then complete the consumers' V barrier of the stage. The
        landing barriers count sanitized tiles only; the smem stage is the K/V ring's: the tile's processing index
        (plus ``kv_base``, the ring's stage at the work tile's first block; None: 0) modulo the stages, which
        differs from the landing stage once plain tiles came in between. Returns the advanced landing state."""
        nthr = self.sanitizer_threads
        n_top, n_bottom = self.sanitized_v_counts(blk)
        for j in cutlass.range(n_top + n_bottom, unroll=1):
            io.pipe_vland.consumer_wait(land_state)
            proc_idx = j
            if const_expr(self.block_info.windowed):
                if j >= n_top:
                    proc_idx = blk.n_blocks - n_bottom + (j - n_top)
            if const_expr(kv_base is not None):
                proc_idx = proc_idx + kv_base
            stage = proc_idx % self.num_stages
            if const_expr(self.block_info.windowed):
                if tid < self.bad_v_words:
                    io.sVbad[tid, stage] = Int32(0)
            else:
                if tid == 0:
                    io.sVbad[0, stage] = Int32(NONE)
            maybe = tile_maybe_nonfinite(io.sV.iterator, self.tile_n * self.head_dim, stage, tid, nthr, self.fp16)
            if block_any(maybe, int(FwdBarrier.SANITIZE), nthr):
                if const_expr(self.block_info.windowed):
                    clear_nonfinite_rows_marking(io.sV[None, None, stage], tid, nthr, self.fp16,
                                                 io.sVbad.iterator + stage * self.bad_v_words)
                else:
                    first = clear_nonfinite_rows(io.sV[None, None, stage], tid, nthr, self.fp16)
                    if first != NONE:
                        cute.arch.atomic_min(io.sVbad.iterator + stage, first)
                cute.arch.fence_view_async_shared()  # zeroed rows -> wgmma (async proxy)
                cute.arch.barrier(barrier_id=int(FwdBarrier.SANITIZE), number_of_threads=nthr)
            if tid == 0:
                cute.arch.mbarrier_arrive(io.pipe_v.sync_object_full.get_barrier(stage))
            io.pipe_vland.consumer_release(land_state)
            land_state.advance()
        return land_state

    # ------------------------------------------------------------------------
    @cute.jit
    def consume(
        self,
        io: Context,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        scale_log2: Float32,
        tile,
        seqlen: SeqlenInfo,
        blk: Context,
        kv_state,
        q_state,
    ):
        """One tile's main loop and epilogue; returns the advanced (kv_state, q_state)."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_layout = cute.make_layout(self.num_wg, stride=128)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg))
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)

        D = self.head_dim
        # the smem operands' descriptor bases computed once here, not per step (loop_invariant_descriptors); Q's
        # K-block slices too, each its own loop-invariant descriptor with hoist_q_slices (else ptxas adds each
        # slice's offset to the base again in every step, a 64-bit add split in two before each QK wgmma)
        hoist = descriptor_hoister(self.hoist_descriptors)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(io.sQ))
        if const_expr(self.hoist_q_slices):
            tSrQ = tuple(hoist(q) for q in k_slices(tSrQ))
        else:
            tSrQ = k_slices(hoist(tSrQ))
        tSrK = hoist(wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(io.sK)))
        sVt = transpose_smem(io.sV)  # (D, tile_n, stages)
        tOrVt = hoist(wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt)))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, D)), Float32)
        acc_O.fill(0.0)
        s_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))

        # per-thread coordinates of the S accumulator (rows/cols within the tile)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = mn_view(thr_mma_qk.partition_C(cS))
        t0ScS_mn = mn_view(tiled_mma_qk.get_slice(0).partition_C(cS))
        exp_scale_log2 = scale_log2  # with softcap the runtime scale is tanh's; the exponential's is c * log2(e)
        if const_expr(self.softcap > 0):
            exp_scale_log2 = Float32(softcap_scale_log2(self.softcap))
        softmax = OnlineSoftmax.create(cute.size(tScS_mn, mode=[0]), exp_scale_log2, self.rescale_threshold,
                                       self.fixed_row_max, self.sum_from_old, self.chained_max)
        m_block = tile.block
        ml = Context(
            tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tOrP=tOrP,
            acc_O=acc_O, s_shape=s_shape, pipe_k=io.pipe_k, pipe_v=io.pipe_v, softmax=softmax, m_block=m_block,
            wg=wg, mask=AttentionMask(self.tile_m, self.tile_n, self.causal, seqlen.seqlen_k, seqlen.diag, tScS_mn,
                                      t0ScS_mn, self.window_left),
            sVbad=io.sVbad, tanh_scale=scale_log2, winner=elected_lane() if const_expr(self.late_k_release) else None,
        )

        n_block_max = blk.n_block_max
        if blk.n_blocks > 0:
            io.pipe_q.consumer_wait(q_state)
            if const_expr(self.sched_barrier and not self.persistent):  # (persistent: consumer_role's token)
                if wg == 0:
                    cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.SCHED_WG0), number_of_threads=256)
            # blocks after the first one that still need the causal mask, then blocks that need none, then the
            # lowest blocks, cut by the window's lower edge (block_info.phases)
            n_masked, n_plain, n_window = blk.n_masked, blk.n_plain, blk.n_window
            n_plain_top = blk.n_block_min + n_window + n_plain  # one past the highest plain block

            if const_expr(self.intra_wg_overlap):
                # ---- first block: S only ----
                n_block = n_block_max - 1
                io.pipe_k.consumer_wait(kv_state)
                acc_S = cute.make_rmem_tensor(s_shape, Float32)
                self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, 0)
                io.pipe_k.consumer_release(kv_state)
                self.cap_scores(ml, acc_S)
                ml.mask.apply(acc_S, m_block, n_block, True)
                softmax.online(acc_S, True)
                tOrP.store(acc_to_operand_a(acc_S).load().to(self.dtype))
                if const_expr(self.defer_v_marks):
                    kv_state, pending = self.overlap_phases_deferred(ml, kv_state, blk, n_block_max)
                    io.pipe_v.consumer_wait(kv_state)
                    if pending >= 0:  # the last block was masked: its rows' marks before its PV
                        self.mark_bad_v_rows(ml, kv_state, pending)
                else:
                    self.mark_rows_seeing_bad_v(ml, kv_state, n_block)
                    for i in cutlass.range(n_masked, unroll=1):
                        kv_state = self.overlap_step(ml, kv_state, n_block_max - 2 - i, True)
                    for i in cutlass.range(n_plain, unroll=1):
                        kv_state = self.overlap_step(ml, kv_state, n_plain_top - 1 - i, False)
                    if const_expr(self.block_info.windowed):
                        for i in cutlass.range(n_window, unroll=1):
                            kv_state = self.overlap_step(ml, kv_state, blk.n_block_min + n_window - 1 - i, True)
                    io.pipe_v.consumer_wait(kv_state)
                # ---- last P @ V ----
                self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False, 0)
                io.pipe_v.consumer_release(kv_state)
                kv_state.advance()
            else:
                kv_state = self.simple_step(ml, kv_state, n_block_max - 1, 2)
                for i in cutlass.range(n_masked, unroll=1):
                    kv_state = self.simple_step(ml, kv_state, n_block_max - 2 - i, 1)
                for i in cutlass.range(n_plain, unroll=1):
                    kv_state = self.simple_step(ml, kv_state, n_plain_top - 1 - i, 0)
                if const_expr(self.block_info.windowed):
                    for i in cutlass.range(n_window, unroll=1):
                        kv_state = self.simple_step(ml, kv_state, blk.n_block_min + n_window - 1 - i, 1)
            if const_expr(self.persistent):
                # every wgmma reading sQ has completed (the last PV waited for all): the next tile's Q may land
                io.pipe_q.consumer_release(q_state)
                q_state.advance()

        if const_expr(self.split_tail):
            if blk.split_slot >= 0:
                self.epilogue_split(io, ml, tidx, tile, seqlen, blk)
            else:
                self.epilogue(io, ml, tidx, tile, seqlen)
        else:
            self.epilogue(io, ml, tidx, tile, seqlen)
        return kv_state, q_state

    # ------------------------------------------------------------------------
    @cute.jit
    def gemm(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        tA: cute.Tensor,
        tB: cute.Tensor,
        zero_init: cutlass.Constexpr[bool],
        wait: cutlass.Constexpr[int],
    ):
        wgmma_gemm(tiled_mma, acc, tA, tB, zero_init)
        if const_expr(wait >= 0):
            warpgroup.wait_group(wait)

    @cute.jit
    def sched_sync(self, wg: Int32):
        if const_expr(self.sched_barrier):
            cute.arch.barrier(barrier_id=int(FwdBarrier.SCHED_WG0) + wg, number_of_threads=256)

    @cute.jit
    def sched_arrive(self, wg: Int32):
        if const_expr(self.sched_barrier):
            nxt = wg + 1
            if nxt == self.num_wg:
                nxt = Int32(0)
            cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.SCHED_WG0) + nxt, number_of_threads=256)

    # ------------------------------------------------------------------------
    @cute.jit
    def overlap_phases_deferred(self, ml: Context, kv_state, blk: Context, n_block_max: Int32):
        """The overlapped steps after the first block (masked, plain, window: block_info.phases) with defer_v_marks:
        each step marks the previous block's bad-V rows at its end when that block was masked. Returns
        (kv_state, pending): the last block when it was masked (its mark belongs to the last PV), else -1."""
        n_masked, n_plain, n_window = blk.n_masked, blk.n_plain, blk.n_window
        for i in cutlass.range(n_masked, unroll=1):  # the previous block is masked: the first one or this loop's
            kv_state = self.overlap_step(ml, kv_state, n_block_max - 2 - i, True, n_block_max - 1 - i)
        pending = n_block_max - 1 - n_masked
        if n_plain > 0:
            n_plain_top = blk.n_block_min + n_window + n_plain  # one past the highest plain block
            kv_state = self.overlap_step(ml, kv_state, n_plain_top - 1, False, pending)
            for i in cutlass.range(1, n_plain, unroll=1):
                kv_state = self.overlap_step(ml, kv_state, n_plain_top - 1 - i, False)
            pending = Int32(-1)
        if const_expr(self.block_info.windowed):
            if n_window > 0:
                top = blk.n_block_min + n_window - 1
                kv_state = self.overlap_step(ml, kv_state, top, True, pending, mark_if_masked=True)
                for i in cutlass.range(1, n_window, unroll=1):
                    kv_state = self.overlap_step(ml, kv_state, top - i, True, top - i + 1)
                pending = blk.n_block_min
        return kv_state, pending

    @cute.jit
    def overlap_step(self, ml: Context, kv_state, n_block: Int32, causal_mask: cutlass.Constexpr[bool],
                     mark_prev=None, mark_if_masked: cutlass.Constexpr[bool] = False):
        """S of block n_block issued with the PV of the previous block; softmax of S while PV runs. ``mark_prev``
        (defer_v_marks): the previous block's index, whose bad-V rows are marked at the end of this step, once S is
        in 16 bits (as few registers live as where the mark was before), its V stage released after it (with
        ``mark_if_masked``, only when it is >= 0: -1 says the previous block was not masked). NaN set after that
        block's PV instead of before it: the row's O is NaN either way."""
        v_state = kv_state.clone()
        kv_state.advance()
        stage_wait(ml.pipe_k, kv_state, self.late_pv_wait)
        self.sched_sync(ml.wg)
        acc_S = cute.make_rmem_tensor(ml.s_shape, Float32)
        self.gemm(ml.tiled_mma_qk, acc_S, ml.tSrQ, ml.tSrK[None, None, None, kv_state.index], True, -1)
        stage_wait(ml.pipe_v, v_state, self.late_pv_wait)
        self.gemm(ml.tiled_mma_pv, ml.acc_O, ml.tOrP, ml.tOrVt[None, None, None, v_state.index], False, -1)
        self.sched_arrive(ml.wg)
        warpgroup.wait_group(1)
        if const_expr(not self.late_k_release):
            stage_release(ml.pipe_k, kv_state, self.release_winner(ml))
        self.cap_scores(ml, acc_S)
        if const_expr(causal_mask):
            ml.mask.apply(acc_S, ml.m_block, n_block, False)
        row_scale = ml.softmax.online(acc_S, False)
        if const_expr(self.late_k_release):  # (ordered after one of the step's exponentials, and the PV wait with it)
            stage_release(ml.pipe_k, kv_state, true_after(acc_S[cute.size(acc_S) // 3]) & ml.winner)
        warpgroup.wait_group(0)
        if const_expr(mark_prev is None and not self.elected_releases):
            ml.pipe_v.consumer_release(v_state)
        to_16bit(acc_to_operand_a(acc_S), ml.tOrP, self.late_pv_wait)
        ml.softmax.rescale_o(ml.acc_O, row_scale)
        if const_expr(mark_prev is None and self.elected_releases):  # (after the step's work: ptxas keeps
            stage_release(ml.pipe_v, v_state, self.release_winner(ml))  # elect.sync where it stands)
        if const_expr(mark_prev is not None):
            if const_expr(mark_if_masked):
                if mark_prev >= 0:
                    self.mark_bad_v_rows(ml, v_state, mark_prev)
            else:
                self.mark_bad_v_rows(ml, v_state, mark_prev)
            stage_release(ml.pipe_v, v_state, self.release_winner(ml))
        if const_expr(causal_mask and not self.defer_v_marks):
            self.mark_rows_seeing_bad_v(ml, kv_state, n_block)
        return kv_state

    def release_winner(self, ml: Context):
        """The predicate of the overlapped step's stage releases (common_sm90.stage_release): the tile's elect.sync
        winner (late_k_release), the step's (elect_release), or None (the pipeline's lane-0 predicate)."""
        if const_expr(self.late_k_release):
            return ml.winner
        return elected_lane() if const_expr(self.elect_release) else None

    @cute.jit
    def cap_scores(self, ml: Context, acc_S: cute.Tensor):
        if const_expr(self.softcap > 0):
            softcap_scores(acc_S, ml.tanh_scale)

    @cute.jit
    def mark_rows_seeing_bad_v(self, ml: Context, kv_state, n_block: Int32):
        """After the softmax of a masked block (no PV in flight): wait for its V tile (sanitized) and make O
        non-finite for the rows that see a key whose V row held NaN / inf (the first such key decides for a
        prefix of visible keys; with a window, any marked key of the row's interval). Their lse stays what the
        scores give, as in the reference (a bad value row does not change the softmax)."""
        if const_expr(self.sanitize_v):
            ml.pipe_v.consumer_wait(kv_state)
            self.mark_bad_v_rows(ml, kv_state, n_block)

    @cute.jit
    def mark_bad_v_rows(self, ml: Context, v_state, n_block: Int32):
        """mark_rows_seeing_bad_v's marking, once the sanitized V tile of block ``n_block`` (stage of ``v_state``)
        has landed and while the stage is held (its sVbad words): before the block's PV, or with defer_v_marks after
        it (the row's O is NaN either way)."""
        if const_expr(self.sanitize_v):
            acc_mn = mn_view(ml.acc_O)
            for r in cutlass.range_constexpr(cute.size(ml.softmax.row_sum)):
                row = ml.m_block * self.tile_m + ml.mask.tScS_mn[r, 0][0]
                if const_expr(self.block_info.windowed):
                    seen = ml.mask.row_sees_marked_key(row, n_block, ml.sVbad[None, v_state.index])
                else:
                    seen = ml.mask.visible(row, n_block * self.tile_n + ml.sVbad[0, v_state.index])
                acc_mn[r, 0] = Float32.nan if seen else acc_mn[r, 0]  # each of the row's 4 threads: one column

    @cute.jit
    def simple_step(self, ml: Context, kv_state, n_block: Int32, mask_kind: cutlass.Constexpr[int]):
        """S, softmax, PV of one block in sequence. mask_kind: 0 none, 1 causal, 2 seqlen + causal."""
        ml.pipe_k.consumer_wait(kv_state)
        acc_S = cute.make_rmem_tensor(ml.s_shape, Float32)
        self.gemm(ml.tiled_mma_qk, acc_S, ml.tSrQ, ml.tSrK[None, None, None, kv_state.index], True, 0)
        ml.pipe_k.consumer_release(kv_state)
        self.cap_scores(ml, acc_S)
        if const_expr(mask_kind > 0):
            ml.mask.apply(acc_S, ml.m_block, n_block, mask_kind == 2)
        row_scale = ml.softmax.online(acc_S, False)
        ml.tOrP.store(acc_to_operand_a(acc_S).load().to(self.dtype))
        ml.softmax.rescale_o(ml.acc_O, row_scale)
        if const_expr(mask_kind > 0):
            self.mark_rows_seeing_bad_v(ml, kv_state, n_block)
        ml.pipe_v.consumer_wait(kv_state)
        self.gemm(ml.tiled_mma_pv, ml.acc_O, ml.tOrP, ml.tOrVt[None, None, None, kv_state.index], False, 0)
        ml.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # ------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, io: Context, ml: Context, tidx: Int32, tile, seqlen: SeqlenInfo):
        self.await_previous_grid()
        if const_expr(io.tma_atom_O is not None):
            self.epilogue_tma(io, ml, tidx, tile, seqlen)
        else:
            self.epilogue_direct(io, ml, tidx, tile, seqlen)

    @cute.jit
    def await_previous_grid(self):
        """pdl: wait until the grid launched before this one has finished and its writes are visible (a no-op
        otherwise): every read and write of out / lse comes after it."""
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def epilogue_tma(self, io: Context, ml: Context, tidx: Int32, tile, seqlen: SeqlenInfo):
        """O -> registers (q dtype) -> smem -> one TMA store (rows past seqlen_q are clipped by TMA). The smem is the
        Q buffer, free once every consumer warpgroup is past its last S = Q K^T; or in a persistent CTA its own
        buffer sO, free once the previous tile's store has read it (the next tile's Q may be landing in sQ)."""
        D = self.head_dim
        tiled_mma_pv, acc_O = ml.tiled_mma_pv, ml.acc_O
        sO = io.sO if const_expr(self.separate_o) else io.sQ
        row_sum = ml.softmax.row_sum
        m_block = tile.block
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        acc_mn = mn_view(acc_O)
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO_mn = mn_view(rO)
        lse_r = cute.make_rmem_tensor_like(row_sum, Float32)
        cO = cute.make_identity_tensor((self.tile_m, D))
        tOcO_mn = mn_view(thr_mma_pv.partition_C(cO))
        sink = self.row_sink(io, tile)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            row = m_block * self.tile_m + tOcO_mn[r, 0][0]
            inv, lse = ml.softmax.finalize(r, ml.mask.row_sees_any_key(row), sink)
            lse_r[r] = lse
            rO_mn[r, None].store((acc_mn[r, None].load() * inv).to(self.dtype))
        if const_expr(self.separate_o):
            if tidx < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous tile's store has read sO
        # every consumer warpgroup has finished reading sQ (separate sO: the previous store is done with it)
        cute.arch.barrier(barrier_id=int(FwdBarrier.EPILOGUE), number_of_threads=self.num_wg * 128)
        store_tile_tma(tiled_mma_pv, rO, sO, io.tma_atom_O, io.mO_tma[None, None, tile.head, tile.batch],
                       (self.tile_m, D), (m_block, 0), tidx, int(FwdBarrier.EPILOGUE), self.num_wg * 128)
        if const_expr(not self.separate_o):
            if tidx < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        _, mL_cur = self.running_views(io, tile, seqlen)
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen.seqlen_q:
                    mL_cur[row] = lse_r[r]

    @cute.jit
    def epilogue_direct(self, io: Context, ml: Context, tidx: Int32, tile, seqlen: SeqlenInfo):
        """O (or the accumulate-merge) straight from registers to global memory."""
        D = self.head_dim
        acc_O = ml.acc_O
        row_sum = ml.softmax.row_sum
        m_block = tile.block
        seqlen_q = seqlen.seqlen_q
        mO_cur, mL_cur = self.running_views(io, tile, seqlen)
        thr_mma_pv = ml.tiled_mma_pv.get_slice(tidx)
        gO = cute.local_tile(mO_cur, (self.tile_m, D), (m_block, 0))
        tOgO_mn = mn_view(thr_mma_pv.partition_C(gO))
        cO = cute.make_identity_tensor((self.tile_m, D))
        tOcO_mn = mn_view(thr_mma_pv.partition_C(cO))
        acc_mn = mn_view(acc_O)
        is_col0 = tOcO_mn[0, 0][1] == 0
        if const_expr(self.accumulate):
            self.merge_running(ml, tOgO_mn, tOcO_mn, mL_cur, mO_cur.stride[0], m_block, seqlen_q, is_col0)
        else:
            sink = self.row_sink(io, tile)
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                inv, lse = ml.softmax.finalize(r, ml.mask.row_sees_any_key(row), sink)
                if row < seqlen_q:
                    o = cute.make_rmem_tensor_like(acc_mn[r, None], io.mO.element_type)
                    o.store((acc_mn[r, None].load() * inv).to(io.mO.element_type))
                    cute.autovec_copy(o, tOgO_mn[r, None])
                    if is_col0:
                        mL_cur[row] = lse

    @cute.jit
    def epilogue_split(self, io: Context, ml: Context, tidx: Int32, tile, seqlen: SeqlenInfo, blk: Context):
        """A part of a split tile (split_tail): its normalised (out, lse) go to the fp32 scratch slot
        ``blk.split_slot``, then it arrives on the tile's counter (after the tile counter); the part that arrives
        last merges every part's (out, lse) in part order, its own from registers (the values it wrote), and
        writes the tile's out and lse, so that the bits do not depend on which part finishes last."""
        D = self.head_dim
        acc_mn = mn_view(ml.acc_O)
        n_rows = cute.size(ml.softmax.row_sum)
        m_block = tile.block
        thr_mma_pv = ml.tiled_mma_pv.get_slice(tidx)
        tOcO_mn = mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, D))))
        is_col0 = tOcO_mn[0, 0][1] == 0
        sync = int(FwdBarrier.EPILOGUE)
        part_rows = self.tile_m  # scratch rows per slot
        lse_own = cute.make_rmem_tensor_like(ml.softmax.row_sum, Float32)
        tSgS_mn = mn_view(thr_mma_pv.partition_C(cute.local_tile(io.mSplitO, (part_rows, D), (blk.split_slot, 0))))
        first_key = blk.n_block_min * self.tile_n
        for r in cutlass.range_constexpr(n_rows):
            row = m_block * self.tile_m + tOcO_mn[r, 0][0]
            # a causal part may lie wholly above a row's diagonal: (0, -inf) then, which the merge weighs 0 (no
            # window, so a row's keys are a prefix: it sees one of the part's keys iff it sees the first)
            sees = ml.mask.visible(row, first_key) & (blk.n_blocks > 0)
            inv, lse = ml.softmax.finalize(r, sees, None)
            lse_own[r] = lse
            acc_mn[r, None].store(acc_mn[r, None].load() * inv)
            o = cute.make_rmem_tensor_like(acc_mn[r, None], Float32)
            o.store(acc_mn[r, None].load())
            cute.autovec_copy(o, tSgS_mn[r, None])
            if is_col0:
                io.mSplitLSE[blk.split_slot * part_rows + tOcO_mn[r, 0][0]] = lse
        # every consumer thread's part is written: one thread publishes it (release) and learns how many parts
        # arrived before it (acquire: their parts are visible to every thread after the barrier)
        cute.arch.barrier(barrier_id=sync, number_of_threads=self.num_wg * 128)
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            io.sSplit[0] = cute.arch.atomic_add(io.mTileCounter.iterator + 1 + blk.split_tile, Int32(1))
            cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=sync, number_of_threads=self.num_wg * 128)
        if io.sSplit[0] == blk.split_parts - 1:
            mO_cur, mL_cur = self.running_views(io, tile, seqlen)
            tOgO_mn = mn_view(thr_mma_pv.partition_C(cute.local_tile(mO_cur, (self.tile_m, D), (m_block, 0))))
            first_slot = blk.split_slot - blk.split_part
            for r in cutlass.range_constexpr(n_rows):
                r_in = tOcO_mn[r, 0][0]
                m = -Float32.inf
                for p in cutlass.range(blk.split_parts, unroll=1):
                    lse_p = lse_own[r]
                    if p != blk.split_part:
                        lse_p = io.mSplitLSE[(first_slot + p) * part_rows + r_in]
                    m = nan_max(m, lse_p)
                shift = m
                if m == -Float32.inf:  # (no part saw a key: weights 0, out 0, lse -inf)
                    shift = Float32(0.0)
                total = Float32(0.0)
                o = cute.make_rmem_tensor_like(acc_mn[r, None], Float32)
                o.fill(0.0)
                part = cute.make_rmem_tensor_like(acc_mn[r, None], Float32)
                for p in cutlass.range(blk.split_parts, unroll=1):
                    lse_p = lse_own[r]
                    if p == blk.split_part:
                        part.store(acc_mn[r, None].load())
                    else:
                        lse_p = io.mSplitLSE[(first_slot + p) * part_rows + r_in]
                        src = mn_view(thr_mma_pv.partition_C(
                            cute.local_tile(io.mSplitO, (part_rows, D), (first_slot + p, 0))))
                        cute.autovec_copy(src[r, None], part)
                    w = cute.math.exp2((lse_p - shift) * LOG2_E, fastmath=True)
                    total = total + w
                    o.store(o.load() + part.load() * w)
                inv = Float32(0.0)
                if total > Float32(0.0):
                    inv = cute.arch.rcp_approx(total)
                row = m_block * self.tile_m + r_in
                if row < seqlen.seqlen_q:
                    out = cute.make_rmem_tensor_like(acc_mn[r, None], io.mO.element_type)
                    out.store((o.load() * inv).to(io.mO.element_type))
                    cute.autovec_copy(out, tOgO_mn[r, None])
                    if is_col0:
                        mL_cur[row] = shift + cute.math.log2(total, fastmath=True) * LN_2

    @cute.jit
    def merge_running(self, ml: Context, tOgO_mn, tOcO_mn, mL_cur, row_stride, m_block: Int32, seqlen_q: Int32,
                      is_col0):
        """Merge this block's (O / rowsum, lse) into the running fp32 (out, lse) of the tile's rows. Every read
        is issued before the first write (rows past seqlen_q read the last row instead: no branch around the
        loads), so the reads of all rows overlap; the producer has asked L2 for these rows already."""
        acc_mn = mn_view(ml.acc_O)
        row_sum = ml.softmax.row_sum
        n_rows = cute.size(row_sum)
        if const_expr(self.head_dim > 128):
            # hdim 256: the running rows are read one at a time (all of them beside acc_O would spill it)
            self.merge_running_by_row(ml, tOgO_mn, tOcO_mn, mL_cur, row_stride, m_block, seqlen_q, is_col0)
            return
        lse_old = cute.make_rmem_tensor_like(row_sum, Float32)
        o_old = cute.make_rmem_tensor_like(ml.acc_O, Float32)
        o_old_mn = mn_view(o_old)
        for r in cutlass.range_constexpr(n_rows):
            row = m_block * self.tile_m + tOcO_mn[r, 0][0]
            row_in = cutlass.min(row, seqlen_q - 1)
            # the quad leader reads the running lse; the shuffle below hands it to the 3 other lanes of the row
            # and orders that read before the leader's write
            lse_r = Float32(-math.inf)
            if is_col0:
                lse_r = mL_cur[row_in]
            lse_old[r] = lse_r
            src = tOgO_mn[r, None]
            src = cute.make_tensor(src.iterator + (row_in - row) * row_stride, src.layout)
            cute.autovec_copy(src, o_old_mn[r, None])
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(n_rows):
            lse_old[r] = cute.arch.shuffle_sync(lse_old[r], offset=lane & ~3)
        for r in cutlass.range_constexpr(n_rows):
            row = m_block * self.tile_m + tOcO_mn[r, 0][0]
            inv, lse = ml.softmax.finalize(r, ml.mask.row_sees_any_key(row), None)
            w_old, w_new, lse_out = merge_lse(lse_old[r], lse)
            o_new = cute.make_rmem_tensor_like(acc_mn[r, None], Float32)
            if const_expr(self.exact_merge):
                s_new = inv * w_new
                for i in cutlass.range_constexpr(cute.size(o_new)):
                    o_new[i] = mul_rn(acc_mn[r, i], s_new)
                if w_old != Float32(0.0):  # an empty running row may hold anything: 0 * NaN must not leak
                    for i in cutlass.range_constexpr(cute.size(o_new)):
                        o_new[i] = fma_rn(o_old_mn[r, i], w_old, o_new[i])
            else:
                o_blk = acc_mn[r, None].load() * (inv * w_new)
                if w_old == Float32(0.0):  # an empty running row may hold anything: 0 * NaN must not leak
                    o_new.store(o_blk)
                else:
                    o_new.store(o_old_mn[r, None].load() * w_old + o_blk)
            if row < seqlen_q:
                cute.autovec_copy(o_new, tOgO_mn[r, None])
                if is_col0:
                    mL_cur[row] = lse_out

    @cute.jit
    def merge_running_by_row(self, ml: Context, tOgO_mn, tOcO_mn, mL_cur, row_stride, m_block: Int32,
                             seqlen_q: Int32, is_col0):
        """merge_running for wide rows (hdim 256): each of the thread's rows is read, merged and written before the
        next one is read, so that one row of the running O is live beside acc_O instead of all of them, and merged in
        place (a second row of temporaries spilled too). The same merge as merge_running; kept apart because folding
        both into one loop over row groups with the in-place form changed the narrower head dims' PTX (measured
        code, not re-measured)."""
        acc_mn = mn_view(ml.acc_O)
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(ml.softmax.row_sum)):
            row = m_block * self.tile_m + tOcO_mn[r, 0][0]
            row_in = cutlass.min(row, seqlen_q - 1)
            lse_r = Float32(-math.inf)
            if is_col0:
                lse_r = mL_cur[row_in]
            o_old = cute.make_rmem_tensor_like(acc_mn[r, None], Float32)
            src = tOgO_mn[r, None]
            cute.autovec_copy(cute.make_tensor(src.iterator + (row_in - row) * row_stride, src.layout), o_old)
            lse_old = cute.arch.shuffle_sync(lse_r, offset=lane & ~3)
            inv, lse = ml.softmax.finalize(r, ml.mask.row_sees_any_key(row), None)
            w_old, w_new, lse_out = merge_lse(lse_old, lse)
            s_new = inv * w_new
            # merged in place (no second row of temporaries)
            if const_expr(self.exact_merge):
                if w_old == Float32(0.0):  # an empty running row may hold anything: 0 * NaN must not leak
                    for i in cutlass.range_constexpr(cute.size(o_old)):
                        o_old[i] = mul_rn(acc_mn[r, i], s_new)
                else:
                    for i in cutlass.range_constexpr(cute.size(o_old)):
                        o_old[i] = fma_rn(o_old[i], w_old, mul_rn(acc_mn[r, i], s_new))
            elif w_old == Float32(0.0):
                o_old.store(acc_mn[r, None].load() * s_new)
            else:
                o_old.store(o_old.load() * w_old + acc_mn[r, None].load() * s_new)
            if row < seqlen_q:
                cute.autovec_copy(o_old, tOgO_mn[r, None])
                if is_col0:
                    mL_cur[row] = lse_out
