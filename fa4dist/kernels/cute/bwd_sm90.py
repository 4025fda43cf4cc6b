"""Hopper (sm_90a) attention backward main kernel, written in CuTe DSL.

One CTA owns one key tile (tile_n = 128 keys) of one kv head (tile_scheduler.bwd_work_tile) and iterates over
the query tiles of every query head of its GQA group, so K/V stay resident in smem and dK/dV stay in registers
for the whole tile (GQA reduction on chip: no dK/dV atomics, deterministic by construction). With
``persistent_ctas`` (backward.default_persistent_ctas: short fresh-gradient calls, and long dense causal hdim-64
ones) the grid has one CTA per SM, each claiming key tiles from a counter (tile_scheduler.TileClaims; a
deterministic grid claims its first tile too) and walking them with every role's pipeline states running on from
one tile into the next: the MMA warpgroups free K / V after a tile's last step, so the next tile's loads overlap
its dK / dV stores.
With ``det_resident`` (backward.default_det_resident: non-causal fresh gradients) the deterministic orders may
let a key tile wait on tiles launched after it, for sequences whose key tiles all fit on the GPU at once:
non-causal tiles visit their query tiles rotated and add dQ in arrival order (rotation_step, rank_rotated),
causal tiles launch longest first.

  * warpgroup 0, warp 0: producer. TMA loads of K, V (once) and, per (head, query tile), of Q and dO into a
    2-stage ring, plus 1-D bulk copies of the matching lse (log2 units) and dPsum (rowsum(dO * O) *
    softmax_scale) vectors that ride on the same mbarriers.
  * warpgroup 0, warp 1: dQ writer. Takes each MMA warpgroup's fp32 dQ tile from smem and adds it into the fp32
    accumulator scratch in gmem with cp.reduce.async.bulk (.add.f32). In deterministic mode it first waits on a
    per-(query tile, head) semaphore for its turn, so the tiles are added in a fixed key-tile order; the ticket
    is released once the add landed. With the fixed-point dQ (dq_fixed) the tiles arrive as int64 (each row
    times its power-of-two scale, rounded) and are added with .add.u64: integer sums do not depend on their
    order, so there are no tickets, and any split of the key tiles over launches or ranks gives the same sums.
  * warpgroups 1, 2: MMA. Warpgroup w owns keys [64 w, 64 w + 64) of the tile and computes
      S^T = K Q^T, dP^T = V dO^T                        (SS wgmma, accumulators in registers)
      P^T = exp2(S^T * scale_log2 - lse2),  dS^T = P^T * (scale * dP^T - dPsum)   (scale folded in)
      dV += P^T dO,  dK += dS^T Q                       (RS wgmma: P^T / dS^T from registers)
      dS^T -> smem (as dS),  dQ = dS K                   (SS wgmma, split over both warpgroups)
    After a tile's last step they write dK / dV: fresh 16-bit outputs of a dense call go through a staging tile
    in smem (stmatrix) and one TMA store each (tma_store_dkv, store_dkv_tile); fp32, accumulated and packed
    outputs are stored (or added) from registers.

Masking (mask.py in its transposed mode, block_info.py): query tiles that see no key of this key tile are never
visited; tiles entirely visible skip the mask math. Rows whose lse is -inf (or padding rows) carry lse2 = +inf
from the preprocess kernel, so their P is exactly 0: they contribute nothing.

Non-finite values (sanitize.py): a masked pair contributes nothing, whatever K, V, Q or dO hold there. In masked
steps P^T and dS^T are selected (not multiplied) to 0 at masked pairs, which covers S, dP and a NaN lse; what is
left is the tensor cores multiplying those zeros with operand rows. Warps 2-3 of warpgroup 0 (the sanitizer)
therefore see the K tile (once per CTA: dQ = dS K) and, in masked steps and in a packed sequence's last query
tile, the Q and dO tiles before the MMA warpgroups do: those land on separate barriers, rows holding NaN / inf
are zeroed, a bad query row's lse2 becomes NaN (its own gradients and those of the keys it sees are NaN), and
the sanitizer then completes the barriers the MMA warpgroups wait on. A row that sees a non-finite key has a NaN
lse from the forward, so its gradients are NaN through P. Masked steps whose query tile the preprocess found
clean (every row's lse and dPsum finite, which certifies its q and dO rows: bwd_preprocess.py) skip that detour
(clean_tiles): in training every tile is clean, and the detour cost 2-7% of a short causal backward.

The dQ accumulator scratch is laid out per (query tile, head) in the MMA fragment order of
common_sm90.dq_tiled_mma (see dq_chunk_layout); bwd_postprocess.py converts it.

This module imports cutlass at import time: import it lazily.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .barriers import BwdBarrier
from .block_info import WORKLIST_COLUMNS, BlockInfo, SeqlenInfo
from .common_sm90 import (
    Context,
    acc_to_operand_a,
    bulk_reduce_add_f32,
    bulk_reduce_add_u64,
    check_smem,
    descriptor_hoister,
    dq_chunk_layout,
    extend_context,
    dq_tiled_mma,
    dq_wg_cols,
    ld_acquire_gpu,
    mn_view,
    nanosleep,
    red_release_add_gpu,
    select_modes,
    smem_layout_kmajor,
    stage_wait,
    store_acc_rows,
    store_tile_tma,
    tma_pipeline,
    tma_tile_partition,
    to_16bit,
    transpose_smem,
    wgmma_gemm,
)
from .mask import AttentionMask
from .sanitize import block_any, clear_nonfinite_rows, row_is_nonfinite, tile_maybe_nonfinite, zero_row
from .softmax import softcap_grad_fp16, softcap_grad_from_p, softcap_scale_log2, softcap_scores
from .split_plans import launch_items
from .tile_scheduler import TileClaims, bwd_work_tile, parts_first, parts_last


@cute.jit
def rotation_step(tile_m: int, tile_n: int, seqlen: SeqlenInfo, max_key_tiles: int) -> Int32:
    """det_rotate: key tile n of a sequence starts its query tiles at c * n, c = M // N for M query tiles and N key
    tiles (so the starts are distinct and c steps apart); 0 (the ascending order) where N > M or N > max_key_tiles."""
    n_k = cute.ceil_div(seqlen.seqlen_k, tile_n)
    n_q = cute.ceil_div(seqlen.seqlen_q, tile_m)
    c = n_q // cutlass.max(n_k, 1)
    return c if n_k <= n_q and n_k <= max_key_tiles else Int32(0)


@cute.jit
def rank_rotated(n: Int32, m: Int32, n_k: Int32, c: Int32) -> Int32:
    """det_rotate: the turn of key tile n among the N = n_k key tiles adding into query tile m, in the order they
    reach it (key tile n' reaches m after (m - c n') mod M steps). With q = m // c the key tiles n <= q come first,
    from q down (q - n before it), then the others from N - 1 down (q + 1 + N - 1 - n before it). c = 0: ascending."""
    rank = n
    if c > 0:
        q = m // c
        rank = (cutlass.min(q, n_k - 1) - n) if n <= q else (q + n_k - n)
    return rank


class FlashBwdSm90:
    """Static configuration of one compiled backward main-kernel variant."""

    def __init__(
        self,
        dtype,
        head_dim: int,
        *,
        causal: bool,
        varlen: bool,
        accumulate: bool,
        deterministic: bool,
        seg_offsets: bool = False,
        tile_m: int = 64,
        tile_n: int = 128,
        num_stages: int = 2,
        regs_producer: int = 24,  # 24 x 128 + 240 x 256 = 168 x 384, the registers the CTA launches with
        regs_mma: int = 240,
        stmatrix_ds: bool = False,
        det_chunk: int = 0,
        sanitize: bool = True,
        window_left: int = -1,
        softcap: float = 0.0,
        masked_last: bool = False,
        softcap_grad_regs: bool = True,
        grads: str = "all",
        dq_fixed: bool = False,
        worklist: bool = False,
        persistent_ctas: int = 0,
        det_resident: int = 0,
        tma_store_dkv: bool = True,
        early_vectors: bool = False,
        try_waits: bool = False,
        hoist_descriptors: bool = True,
        interleave_lengths: bool = False,
        lpt_over_heads: bool = False,
        lpt_group: int = 0,
        ticket_sleep_ns: int = 32,
        release_fence: bool = False,
        fixed_scales_early: bool = True,
        clean_tiles: bool = True,
        split_keys: bool = False,
    ):
        assert head_dim in (64, 96, 128)
        # a work list: mCuSeqlensQ is the item table (block_info.WORKLIST_COLUMNS), one "sequence" per item with
        # its own query rows, key rows, diagonal and scratch tiles; items of one launch have disjoint key rows (and,
        # deterministic, disjoint scratch tiles: each query tile's tickets count its own item's key tiles)
        assert not worklist or (varlen and not seg_offsets)
        self.worklist = worklist
        # which gradients this variant computes: "all", "dq" (no dV / dK GEMMs, no dK / dV stores) or "dkv" (no
        # dQ GEMM, no dS smem copy, no dQ writer, no tickets): the cp_invariant engine's two passes each need one
        assert grads in ("all", "dq", "dkv"), grads
        self.compute_dq = grads != "dkv"
        self.compute_dkv = grads != "dq"
        # fixed-point dQ (fa4dist.kernels.fixed_point): each step's dQ tile times its rows' power-of-two scales,
        # converted to int64 and added with an integer bulk reduction. Integer sums do not depend on their order,
        # so the result is deterministic without tickets (and the same for any split of the key tiles).
        self.dq_fixed = dq_fixed
        assert not dq_fixed or (self.compute_dq and not deterministic), "fixed-point dQ: no tickets to take"
        self.dq_acc_type = cutlass.Int64 if dq_fixed else Float32
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.varlen = varlen
        self.accumulate = accumulate
        self.deterministic = deterministic
        self.seg_offsets = seg_offsets
        self.tile_m = tile_m
        self.tile_n = tile_n
        assert self.tile_n == 128 and self.tile_m in (64, 128)
        self.num_stages = num_stages
        self.regs_producer = regs_producer
        self.regs_mma = regs_mma
        self.stmatrix_ds = stmatrix_ds  # dS^T -> smem with stmatrix.trans instead of 16-bit stores
        self.num_threads = 384
        # causal + deterministic: shortest-first, i.e. for each query tile the key tiles add their
        # dQ from the diagonal down; CTAs are launched highest key tile first so that a CTA only
        # ever waits on CTAs launched before it (no deadlock whatever the residency).
        self.spt = causal and deterministic
        # deterministic only: launch the key tiles of a head in chunks of det_chunk CTAs, chunks of all heads
        # interleaved, so that a wave holds short ordered chains of many heads instead of one long chain of one
        # head (a CTA still only waits on CTAs launched before it). 0 keeps key-tile-fastest order.
        self.det_chunk = det_chunk if deterministic else 0
        # det_resident > 0: deterministic orders in which a key tile may wait on key tiles of its sequence launched
        # (or claimed) after it, for sequences of at most det_resident key tiles: those fit on the GPU at once, and
        # the hardware dispatches CTAs in order, so they are all resident once the earlier sequences' CTAs finish
        # (make_configs takes half the SM count). Longer sequences keep the orders that wait only on earlier CTAs.
        # - non-causal (det_rotate): key tile n visits its query tiles in a rotated order starting at c * n (c =
        #   query tiles // key tiles), and query tile m takes the key tiles' dQ in the order they reach it
        #   (rank_rotated), so the tiles of a head start without waiting on each other's tickets; in the ascending
        #   order every key tile starts at query tile 0 and key tile n waits n steps (NOTES_BWD.md).
        # - causal (det_lpt): the same dQ order as shortest-first (the diagonal key tile first, already the arrival
        #   order), but the key tiles launched longest first, so the longest ones no longer run in the last wave.
        assert not (det_resident and self.det_chunk), "det_resident needs a sequence's key tiles launched together"
        self.det_rotate = det_resident if deterministic and not causal else 0
        self.det_lpt = det_resident if deterministic and causal else 0
        self.dq_chunk_elems = self.tile_m * head_dim // 2
        assert window_left < 0 or causal, "a sliding window comes with the causal upper edge (see backend.py)"
        self.window_left = window_left
        self.softcap = float(softcap)  # > 0: capped scores; the runtime scale_log2 is then tanh's (softmax.py)
        # the cap's derivative 1 - tanh^2 kept from the S phase in fp16 registers, or recovered from P (softmax.py)
        self.softcap_grad_regs = softcap_grad_regs
        self.block_info = BlockInfo(self.tile_m, self.tile_n, causal, window_left)
        # masked pairs with stored operands exist only with a causal mask or packed sequences (a dense sequence
        # end is zero-filled by TMA)
        self.sanitize = sanitize and (causal or varlen)
        # masked_last (non-deterministic causal; a measurement knob, backward.BwdConfig): a key tile visits its
        # plain query tiles first and the masked causal band after them, so that the band's Q / dO tiles are
        # sanitized while plain steps compute. The deterministic dQ tickets need the ascending order: it keeps it.
        # Every loop over a key tile's steps goes through phases(), so the producer, the sanitizer, the MMA
        # warpgroups and the dQ writer agree.
        self.masked_last = masked_last and self.sanitize and causal and not deterministic
        # A masked step's Q / dO skip the sanitizer when the preprocess found every row of their query tile clean
        # (mClean: finite lse and dpsum certify the rows' q and dO); only tiles with a non-finite row, and a packed
        # sequence's cut last tile (its padding rows are another sequence's), still take the detour. The masked
        # pairs of a clean tile multiply finite rows, so they contribute exactly 0 either way.
        self.clean_tiles = clean_tiles and self.sanitize and causal
        self.fp16 = dtype == cutlass.Float16
        self.sanitizer_threads = 64  # warps 2..3 of warpgroup 0: tile_m / 64 query rows of a tile per thread
        assert self.tile_m % self.sanitizer_threads == 0
        # > 0: a persistent grid of at most this many CTAs (one per SM), each claiming key tiles from a counter in
        # launch order (tile_scheduler.TileClaims), so that the next tile's K / V and first Q / dO loads overlap this
        # tile's last steps and its dK / dV stores, and no CTA pays a launch and prologue per tile. The claims go out
        # in launch order, and a deterministic grid claims its first tiles too, so a deterministic tile only waits
        # on tiles claimed before it, by CTAs that run (no deadlock, resident or not). 0: one CTA per tile.
        self.persistent = persistent_ctas > 0
        self.persistent_ctas = persistent_ctas
        # fresh dK / dV through a staging tile and TMA stores (the output dtype is checked when tracing: __call__);
        # not beside the int64 dQ tile, which leaves no shared memory for it
        self.tma_store_dkv = tma_store_dkv and not accumulate and not varlen and self.compute_dkv and not dq_fixed
        # each step's lse2 / dPsum columns read from smem while its S^T / dP^T GEMMs run (the counters had the lse2
        # subtraction waiting on its shared load; backward.default_early_vectors). 64-row query tiles only: 32
        # more live registers there, 64 on 128-row tiles, which spill ~220 bytes (ptxas, hdim 64)
        self.early_vectors = early_vectors and tile_m == 64
        # the forward's late_pv_wait forms in the step: the Q / dO barriers tried once before the blocking wait,
        # P^T / dS^T converted with inline cvts (common_sm90.convert_to_16bit); the same bits either way
        self.try_waits = try_waits
        self.hoist_descriptors = hoist_descriptors
        # causal, no deterministic order: long and short key tiles alternate in the launch order
        # (tile_scheduler.bwd_work_tile)
        self.interleave_lengths = interleave_lengths and causal and not deterministic
        # causal, not a work list: every (sequence, head)'s longest key tile first, then every one's second
        # longest, ... (the split launches' order, BwdConfig.lpt_over_heads); deterministic (shortest first, not
        # det_chunk's or det_lpt's orders), every head's shortest key tile first: a ticket still waits only on tiles
        # launched before it
        self.lpt_over_heads = lpt_over_heads and causal and not worklist and not (
            deterministic and (self.det_chunk or self.det_lpt))
        # ... within groups of lpt_group (batch, kv head) pairs, one group after another (0: all at once)
        assert lpt_group >= 0, lpt_group
        self.lpt_group = lpt_group if self.lpt_over_heads else 0
        # deterministic dQ tickets: the poll's sleep between reads (0: spin) and the explicit fence before the
        # release (red.release alone already releases); the same order of adds either way
        assert ticket_sleep_ns >= 0, ticket_sleep_ns
        self.ticket_sleep_ns = ticket_sleep_ns
        self.release_fence = release_fence
        # fixed-point dQ: the rows' scales loaded at the start of the step (64-row query tiles without a cap: two
        # registers; 128-row tiles spilled, and beside the cap's derivative the windowed kernel spilled 44 bytes
        # against 28). The same bits; -4% on the int64 kernel at 32k causal hdim 128, the median of three runs
        # (NOTES_BWD.md, twenty-first session, which also measured converting the tile before its buffer's empty
        # barrier: +8% beside this)
        self.fixed_scales_early = fixed_scales_early and dq_fixed and tile_m == 64 and not softcap
        # a launch of few waves: the key tiles that make its tail run as parts over their query tiles, causal the
        # longest, claimed first (split_plans.split_keys_plan), non-causal the last partial wave's, claimed last
        # (split_plans.split_plan); each part writes its fp32 dK / dV to a scratch slot and the part that arrives
        # last sums them in part order and stores the tile (store_split_dkv). Non-deterministic dense fresh calls
        # with every gradient on the persistent grid
        self.split_keys = split_keys
        assert not split_keys or (self.persistent and not deterministic and not varlen and not accumulate
                                  and grads == "all" and not dq_fixed and not worklist and window_left < 0
                                  and self.tma_store_dkv)

    # ------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d) | varlen (t_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d) | varlen (t_k, h_kv, d)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # like q
        mLSE2: cute.Tensor,  # flat fp32, (chunk, h) blocks of tile_m
        mDpsum: cute.Tensor,  # flat fp32, same indexing
        mClean: Optional[cute.Tensor],  # flat int32 (chunk, h): the preprocess's clean query tiles (clean_tiles)
        mdQacc: cute.Tensor,  # flat fp32, (chunk, h) blocks of tile_m * d
        mdK: cute.Tensor,  # like k (k dtype, or fp32 when accumulating)
        mdV: cute.Tensor,
        mSem: Optional[cute.Tensor],  # flat int32 (chunk, h), deterministic only
        mdQscale: Optional[cute.Tensor],  # flat fp32 like mLSE2: the rows' fixed-point scales (dq_fixed only)
        scale: Float32,  # softmax scale
        scale_log2: Float32,  # softmax_scale * log2(e)
        diag: Int32,
        max_seqlen_k: Int32,  # varlen: longest key segment (upper bound is fine)
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSegOffQ: Optional[cute.Tensor],
        mSegOffK: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],  # persistent: (1,) int32, zero at launch (split_keys: 1 + split tiles)
        mSplitDKV: Optional[cute.Tensor],  # split_keys: (2 * parts' slots * tile_n, d) fp32, the parts' dK / dV
        split_edge: Optional[Int32],  # split_keys: causal how many key tiles (the first) are split, else the first
        split_parts: Optional[Int32],  # split_keys: parts per split key tile
        stream,
    ):
        if const_expr(not self.varlen):
            mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, (1, 3, 2, 0)) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        else:
            mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, (0, 2, 1)) for t in (mQ, mK, mV, mdO, mdK, mdV)]

        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        self.sQ_layout = smem_layout_kmajor(self.dtype, tm, D, self.num_stages)
        self.sdO_layout = smem_layout_kmajor(self.dtype, tm, D, self.num_stages)
        # K^T is the dQ GEMM's B operand, its head dim split over the two warpgroups on 64-row query tiles
        # (hdim 96: 48 columns each, which only the 32-byte swizzle atom divides). V takes the same layout: the
        # dK / dV TMA stores share one staging tile (sdKV)
        self.sK_layout = smem_layout_kmajor(self.dtype, tn, D, atom_cols=dq_wg_cols(tm, D))
        self.sV_layout = self.sK_layout
        self.sdS_layout = smem_layout_kmajor(self.dtype, tm, tn, self.num_stages)

        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T and dP^T = V dO^T: M = keys (64 per warpgroup), N = queries, K = head dim
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, tm)
        )
        # dV = P^T dO and dK = dS^T Q: M = keys, N = head dim, K = queries; A from registers
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN_, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, D),
            a_source=warpgroup.OperandSource.RMEM,
        )
        tiled_mma_dq = dq_tiled_mma(self.dtype, tm, D)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.select(self.sQ_layout, mode=[0, 1]), (tm, D), 1
        )
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            g2s, mdO, cute.select(self.sdO_layout, mode=[0, 1]), (tm, D), 1
        )
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK, self.sK_layout, (tn, D), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV, self.sV_layout, (tn, D), 1)
        # fresh 16-bit dK / dV (tma_store_dkv): one staging tile in the K tile's layout, a TMA store atom each
        self.use_tma_dkv = self.tma_store_dkv and mdK.element_type == self.dtype
        tma_atom_dK = tma_dK = tma_atom_dV = tma_dV = None
        if const_expr(self.use_tma_dkv):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(s2g, mdK, self.sK_layout, (tn, D))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(s2g, mdV, self.sV_layout, (tn, D))
        self.bytes_q = cute.size_in_bytes(self.dtype, cute.select(self.sQ_layout, mode=[0, 1]))
        self.bytes_kv = cute.size_in_bytes(self.dtype, self.sK_layout)
        self.bytes_vec = tm * 4

        def smem_tile(dtype, elems):
            return cute.struct.Align[cute.struct.MemRange[dtype, elems], 1024]

        fields = dict(
            mbar_kv=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_q=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            mbar_do=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            # tiles the sanitizer sees first land here
            mbar_kvland=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_qland=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            mbar_doland=cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
        )
        if const_expr(self.persistent):
            # next to the other barriers, in the padding before sLSE's alignment: the hdim-64 fixed-point dQ kernel
            # takes all 227 KB of the SM's shared memory, so these 40 bytes must not come after its tiles
            fields["mbar_tile"] = cute.struct.MemRange[cutlass.Int64, 2 * TileClaims.STAGES]
            fields["sTile"] = cute.struct.MemRange[Int32, TileClaims.STAGES]  # claimed tile indices in flight
        if const_expr(self.split_keys):
            fields["sSplit"] = cute.struct.MemRange[Int32, 1]  # a part's arrival count, for the MMA threads
        fields.update(
            sLSE=cute.struct.Align[cute.struct.MemRange[Float32, tm * self.num_stages], 128],
            sDpsum=cute.struct.Align[cute.struct.MemRange[Float32, tm * self.num_stages], 128],
            sQ=smem_tile(self.dtype, cute.cosize(self.sQ_layout)),
            sdO=smem_tile(self.dtype, cute.cosize(self.sdO_layout)),
            sK=smem_tile(self.dtype, cute.cosize(self.sK_layout)),
            sV=smem_tile(self.dtype, cute.cosize(self.sV_layout)),
            sdS=smem_tile(self.dtype, cute.cosize(self.sdS_layout)),
            sdQ=smem_tile(self.dq_acc_type, tm * D),
        )
        if const_expr(self.use_tma_dkv):
            fields["sdKV"] = smem_tile(self.dtype, cute.cosize(self.sK_layout))
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        check_smem(self.shared_storage)

        num_heads_kv = cute.size(mK.shape[2])
        if const_expr(not self.varlen):
            num_batch = cute.size(mQ.shape[3])
            n_blocks_grid = cute.ceil_div(cute.size(mK.shape[0]), tn)
        else:
            num_batch = cute.size(mCuSeqlensQ.shape[0]) - 1
            if const_expr(self.worklist):
                num_batch = cute.size(mCuSeqlensQ.shape[0]) // WORKLIST_COLUMNS
            n_blocks_grid = cute.ceil_div(max_seqlen_k, tn)
        if const_expr(self.det_chunk > 0):
            num_tiles = cute.ceil_div(n_blocks_grid, self.det_chunk) * self.det_chunk * num_heads_kv * num_batch
        else:
            num_tiles = n_blocks_grid * num_heads_kv * num_batch
        if const_expr(self.split_keys):
            num_tiles = launch_items(self.causal, num_tiles, split_edge, split_parts)
        grid = (num_tiles, 1, 1)
        if const_expr(self.persistent):
            grid = (cutlass.min(num_tiles, Int32(self.persistent_ctas)), 1, 1)

        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, mLSE2, mDpsum, mClean, mdQacc, mdK, mdV, mSem, mdQscale,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
            scale, scale_log2, diag, n_blocks_grid, num_batch, num_tiles,
            mCuSeqlensQ, mCuSeqlensK, mSegOffQ, mSegOffK, mTileCounter, mSplitDKV, split_edge, split_parts,
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.sdS_layout,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,
        mDpsum: cute.Tensor,
        mClean: Optional[cute.Tensor],
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSem: Optional[cute.Tensor],
        mdQscale: Optional[cute.Tensor],
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom,
        tma_dK: Optional[cute.Tensor],
        tma_dV: Optional[cute.Tensor],
        tma_atom_dK: Optional[cute.CopyAtom],
        tma_atom_dV: Optional[cute.CopyAtom],
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        scale: Float32,
        scale_log2: Float32,
        diag: Int32,
        n_blocks_grid: Int32,
        num_batch: Int32,
        num_tiles: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSegOffQ: Optional[cute.Tensor],
        mSegOffK: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        mSplitDKV: Optional[cute.Tensor],
        split_edge: Optional[Int32],
        split_parts: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
    ):
        tm = self.tile_m
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
            cpasync.prefetch_descriptor(tma_atom_dO)
            if const_expr(self.use_tma_dkv):
                cpasync.prefetch_descriptor(tma_atom_dK)
                cpasync.prefetch_descriptor(tma_atom_dV)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        mma_warps = 8
        pipe_kv = tma_pipeline(storage.mbar_kv.data_ptr(), 1, mma_warps, 2 * self.bytes_kv)
        pipe_q = tma_pipeline(storage.mbar_q.data_ptr(), self.num_stages, mma_warps, self.bytes_q + self.bytes_vec)
        pipe_do = tma_pipeline(storage.mbar_do.data_ptr(), self.num_stages, mma_warps, self.bytes_q + self.bytes_vec)
        pipe_kvland = pipe_qland = pipe_doland = None
        san_warps = self.sanitizer_threads // 32 if self.sanitize else 0
        if const_expr(self.sanitize):
            # persistent: the K / V buffers are free for the next tile's loads once the sanitizer and the MMA
            # warpgroups are done with them, so both release the landing stage
            pipe_kvland = tma_pipeline(storage.mbar_kvland.data_ptr(), 1,
                                       san_warps + (mma_warps if self.persistent else 0), 2 * self.bytes_kv)
            pipe_qland = tma_pipeline(storage.mbar_qland.data_ptr(), self.num_stages, san_warps,
                                      self.bytes_q + self.bytes_vec)
            pipe_doland = tma_pipeline(storage.mbar_doland.data_ptr(), self.num_stages, san_warps,
                                       self.bytes_q + self.bytes_vec)
        claims = None
        if const_expr(self.persistent):
            # every warp but the producer reads each claimed tile index
            claims = TileClaims.create(storage.mbar_tile.data_ptr(),
                                       storage.sTile.get_tensor(cute.make_layout(TileClaims.STAGES)), mTileCounter,
                                       mma_warps + san_warps + (1 if self.compute_dq else 0))
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)

        vec_layout = cute.make_layout((tm, self.num_stages), stride=(1, tm))
        io = Context(
            mQ=mQ, mK=mK, mV=mV, mdO=mdO, mLSE2=mLSE2, mDpsum=mDpsum, mClean=mClean, mdQacc=mdQacc, mdK=mdK, mdV=mdV,
            mSem=mSem,
            mdQscale=mdQscale,
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sdO=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            sdS=storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
            sLSE=storage.sLSE.get_tensor(vec_layout),
            sDpsum=storage.sDpsum.get_tensor(vec_layout),
            sdQ=storage.sdQ.get_tensor(dq_chunk_layout(tm, self.head_dim)),
            tma_atom_Q=tma_atom_Q, tma_atom_K=tma_atom_K, tma_atom_V=tma_atom_V, tma_atom_dO=tma_atom_dO,
            pipe_kv=pipe_kv, pipe_q=pipe_q, pipe_do=pipe_do,
            pipe_kvland=pipe_kvland, pipe_qland=pipe_qland, pipe_doland=pipe_doland,
            diag=diag, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, mSegOffQ=mSegOffQ, mSegOffK=mSegOffK,
            claims=claims, tma_dK=tma_dK, tma_dV=tma_dV, tma_atom_dK=tma_atom_dK, tma_atom_dV=tma_atom_dV,
            sdKV=storage.sdKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner) if self.use_tma_dkv else None,
            mTileCounter=mTileCounter, mSplitDKV=mSplitDKV,
            sSplit=storage.sSplit.get_tensor(cute.make_layout(1)) if const_expr(self.split_keys) else None,
        )
        launch = Context(n_blocks_grid=n_blocks_grid, num_batch=num_batch, num_tiles=num_tiles,
                         split_edge=split_edge, split_parts=split_parts)

        # the one work tile of a non-persistent CTA (identical in every warp); a persistent CTA finds its tiles in
        # each role's tile walk (the roles walk the same tiles, so their pipeline states stay in step)
        first = None
        if const_expr(not self.persistent):
            first = self.work_at(io, launch, None)

        pipeline.pipeline_init_wait(cluster_shape_mn=None)

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:
                self.producer_role(io, launch, first)
            if warp_idx == 1:
                if const_expr(self.compute_dq):
                    self.dq_writer_role(io, launch, first)
            if const_expr(self.sanitize):
                if warp_idx >= 2:
                    self.sanitizer_role(io, launch, first, tidx - 64)
        else:
            cute.arch.setmaxregister_increase(self.regs_mma)
            self.mma_role(io, launch, first, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, scale, scale_log2)

    # ------------------------------------------------------------------------
    @cute.jit
    def work_at(self, io: Context, launch: Context, tile_idx):
        """(tile, seqlen, rng) of launch-order tile ``tile_idx`` (None: this CTA's blockIdx.x): the work tile, its
        sequence and the range of query tiles it visits (block_info.BlockInfo.query_tiles). With split_keys,
        some indices are parts, the p-th of ``parts`` runs of a split key tile's query tiles (rng.split_tile: its
        index among the split ones, rng.split_slot = split_tile * parts + p, rng.split_part = p): causal, index
        i * parts + p (i < split_edge) is part p of key tile i in the order longest first over every head (key
        tile 0 of every (batch, kv head), then key tile 1, ...: all of them are in flight at once), claimed first,
        the other key tiles following whole (tile_scheduler.parts_first); non-causal, the key tiles from
        split_edge on (the last partial wave) in parts claimed after every whole one (parts_last)."""
        spt = self.spt
        if const_expr(self.det_lpt):
            spt = launch.n_blocks_grid > self.det_lpt  # every sequence's key tiles fit: longest first
        base_idx = tile_idx
        split_slot = split_tile = None
        if const_expr(self.split_keys):
            decode = parts_first if const_expr(self.causal) else parts_last
            base_idx, split_slot, split_tile = decode(tile_idx, launch.split_edge, launch.split_parts)
        tile = bwd_work_tile(io.mQ, io.mK, launch.n_blocks_grid, launch.num_batch, shortest_first=spt,
                             det_chunk=self.det_chunk, interleave=self.interleave_lengths and not self.split_keys,
                             tile_idx=base_idx,
                             longest_first_over_heads=(self.split_keys and self.causal) or self.lpt_over_heads,
                             heads_per_group=0 if self.split_keys else self.lpt_group)
        seqlen = SeqlenInfo.create(tile.batch, io.mQ, io.mK, io.diag, io.mCuSeqlensQ, io.mCuSeqlensK, io.mSegOffQ,
                                   io.mSegOffK, varlen=self.varlen, seg_offsets=self.seg_offsets,
                                   scratch_tile_m=self.tile_m, worklist=self.worklist)
        has_work, m_min, m_mask_end, m_window_start, m_max = self.block_info.query_tiles(seqlen, tile.block,
                                                                                         tile.valid)
        extra = {}
        if const_expr(self.det_rotate):
            extra["rot"] = rotation_step(self.tile_m, self.tile_n, seqlen, self.det_rotate) * tile.block
        if const_expr(self.split_keys):
            split_part = split_slot - split_tile * launch.split_parts
            if split_slot >= 0:  # the part's run of query tiles, its causal band clipped to it (no window)
                n_all = m_max - m_min
                lo = m_min + split_part * n_all // launch.split_parts
                hi = m_min + (split_part + 1) * n_all // launch.split_parts
                m_mask_end = cutlass.min(cutlass.max(m_mask_end, lo), hi)
                m_window_start = hi
                m_min, m_max = lo, hi
                has_work = has_work and lo < hi
            extra.update(split_slot=split_slot, split_tile=split_tile, split_part=split_part,
                         split_parts=launch.split_parts)
        rng = Context(has_work=has_work, m_min=m_min, m_mask_end=m_mask_end, m_window_start=m_window_start,
                      m_max=m_max, **extra)
        return tile, seqlen, rng

    @cute.jit
    def each_tile(self, io: Context, launch: Context, first, body, state, claimer: bool):
        """One role's tiles: ``state = body(tile, seqlen, rng, state)`` for the CTA's one tile ``first``, or on a
        persistent grid for each tile it claims (``claimer``: the producer warp, which claims each next tile once
        its loads of the current one are out); returns the final state. ``body`` skips a tile without work."""
        if const_expr(not self.persistent):
            return body(*first, state)
        num_ctas = cute.arch.grid_dim()[0]
        # deterministic: every tile claimed, none taken by blockIdx.x, so that a tile only waits on tiles held by
        # running CTAs (TileClaims: no hang when some of the grid's CTAs find no SM)
        return io.claims.walk(lambda t, st: body(*self.work_at(io, launch, t), st), state, launch.num_tiles,
                              num_ctas, claimer, claim_first=self.deterministic)

    # ------------------------------------------------------------------------
    @cute.jit
    def producer_role(self, io: Context, launch: Context, first):
        """Warp 0: the TMA loads of every tile of the CTA."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        n_sanitized = Int32(0)  # landing barriers: stage n % stages, producer phase 1 - (n // stages) % 2
        self.each_tile(io, launch, first, lambda tile, seqlen, rng, st: self.produce(io, tile, seqlen, rng, *st),
                       (kv_state, q_state, n_sanitized), True)

    # ------------------------------------------------------------------------
    @cute.jit
    def produce(self, io: Context, tile, seqlen: SeqlenInfo, rng: Context, kv_state, q_state, n_sanitized: Int32):
        """One tile's loads (none for a tile without work): K and V, then Q / dO of every step; returns the advanced
        (kv_state, q_state, n_sanitized)."""
        if rng.has_work:
            kv_state, q_state, n_sanitized = self.produce_tile(io, tile, seqlen, rng, kv_state, q_state,
                                                               n_sanitized)
        return kv_state, q_state, n_sanitized

    @cute.jit
    def produce_tile(self, io: Context, tile, seqlen: SeqlenInfo, rng: Context, kv_state, q_state,
                     n_sanitized: Int32):
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        head_kv, group, batch = tile.head_kv, tile.group, tile.batch
        num_heads = cute.size(io.mQ.shape[2])
        if const_expr(not self.varlen):
            mK_cur = io.mK[None, None, head_kv, batch]
            mV_cur = io.mV[None, None, head_kv, batch]
        else:
            mK_cur = cute.domain_offset((seqlen.offset_k, 0), io.mK[None, None, head_kv])
            mV_cur = cute.domain_offset((seqlen.offset_k, 0), io.mV[None, None, head_kv])
        gK = cute.local_tile(mK_cur, (tn, D), (tile.block, 0))
        gV = cute.local_tile(mV_cur, (tn, D), (tile.block, 0))
        tKsK, tKgK = tma_tile_partition(io.tma_atom_K, io.sK, gK)
        tVsV, tVgV = tma_tile_partition(io.tma_atom_V, io.sV, gV)
        if const_expr(self.sanitize):
            io.pipe_kvland.producer_acquire(kv_state)  # the sanitizer completes pipe_kv
            bar_kv = io.pipe_kvland.producer_get_barrier(kv_state)
        else:
            io.pipe_kv.producer_acquire(kv_state)
            bar_kv = io.pipe_kv.producer_get_barrier(kv_state)
        cute.copy(io.tma_atom_K, tKgK, tKsK, tma_bar_ptr=bar_kv)
        cute.copy(io.tma_atom_V, tVgV, tVsV, tma_bar_ptr=bar_kv)
        kv_state.advance()

        # lse2 / dPsum vectors: (tm, chunk * h + head)
        n_vec = cute.size(io.mLSE2.shape[0]) // tm
        gLSE_all = cute.make_tensor(io.mLSE2.iterator, cute.make_layout((tm, n_vec), stride=(1, tm)))
        gDps_all = cute.make_tensor(io.mDpsum.iterator, cute.make_layout((tm, n_vec), stride=(1, tm)))
        bulk_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32, num_bits_per_copy=tm * 32)

        for first, end, _ in self.phases(rng):
            for hi in cutlass.range(group, unroll=1):
                head = head_kv * group + hi
                if const_expr(not self.varlen):
                    mQ_cur = io.mQ[None, None, head, batch]
                    mdO_cur = io.mdO[None, None, head, batch]
                else:
                    mQ_cur = cute.domain_offset((seqlen.offset_q, 0), io.mQ[None, None, head])
                    mdO_cur = cute.domain_offset((seqlen.offset_q, 0), io.mdO[None, None, head])
                gQ = cute.local_tile(mQ_cur, (tm, D), (None, 0))
                gdO = cute.local_tile(mdO_cur, (tm, D), (None, 0))
                tQsQ, tQgQ = tma_tile_partition(io.tma_atom_Q, io.sQ, gQ)
                tdOsdO, tdOgdO = tma_tile_partition(io.tma_atom_dO, io.sdO, gdO)
                for i in cutlass.range(first, end, unroll=1):
                    m = self.phase_m(i, first, end, rng)
                    vec_idx = (seqlen.scratch_base + m) * num_heads + head
                    tiles = (tQgQ, tQsQ, tdOgdO, tdOsdO, gLSE_all, gDps_all, bulk_atom)
                    if const_expr(self.sanitize):
                        # the clean flag's load is issued before the stage's wait, its use after it
                        clean = self.tile_clean(io, m, vec_idx, rng)
                        io.pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
                        if self.step_sanitized(m, rng, seqlen, clean):
                            self.land_q_do(io, tiles, q_state, m, vec_idx, n_sanitized)
                            n_sanitized = n_sanitized + 1
                        else:
                            self.load_q_do(io, tiles, q_state, m, vec_idx, q_empty_waited=True)
                    else:
                        self.load_q_do(io, tiles, q_state, m, vec_idx)
                    q_state.advance()
        return kv_state, q_state, n_sanitized

    @cute.jit
    def load_q_do(self, io: Context, tiles, q_state, m: Int32, vec_idx: Int32,
                  q_empty_waited: cutlass.Constexpr[bool] = False):
        """Q tile m (+ its lse2 vector) and dO tile m (+ its dPsum vector) into the stage of q_state
        (``q_empty_waited``: the caller waited for pipe_q's stage to be free)."""
        tQgQ, tQsQ, tdOgdO, tdOsdO, gLSE_all, gDps_all, bulk_atom = tiles
        pipe_q, pipe_do = io.pipe_q, io.pipe_do
        if const_expr(q_empty_waited):
            pipe_q.sync_object_full.arrive(q_state.index, pipe_q.producer_mask)  # arms the stage with the bytes
        else:
            pipe_q.producer_acquire(q_state)
        bar_q = pipe_q.producer_get_barrier(q_state)
        cute.copy(io.tma_atom_Q, tQgQ[None, m], tQsQ[None, q_state.index], tma_bar_ptr=bar_q)
        with cute.arch.elect_one():
            cute.copy(bulk_atom, gLSE_all[None, vec_idx], io.sLSE[None, q_state.index], mbar_ptr=bar_q)
        pipe_do.producer_acquire(q_state)
        bar_do = pipe_do.producer_get_barrier(q_state)
        cute.copy(io.tma_atom_dO, tdOgdO[None, m], tdOsdO[None, q_state.index], tma_bar_ptr=bar_do)
        with cute.arch.elect_one():
            cute.copy(bulk_atom, gDps_all[None, vec_idx], io.sDpsum[None, q_state.index], mbar_ptr=bar_do)

    @cute.jit
    def land_q_do(self, io: Context, tiles, q_state, m: Int32, vec_idx: Int32, n_sanitized: Int32):
        """load_q_do for a sanitized step (the caller waited for pipe_q's stage to be free): the tiles land on the
        sanitizer's barriers (stage n_sanitized % stages), and the sanitizer completes pipe_q / pipe_do of q_state's
        stage once it has checked them."""
        tQgQ, tQsQ, tdOgdO, tdOsdO, gLSE_all, gDps_all, bulk_atom = tiles
        ns = self.num_stages
        land, phase = n_sanitized % ns, 1 - (n_sanitized // ns) % 2
        io.pipe_qland.sync_object_empty.wait(land, phase)
        io.pipe_qland.sync_object_full.arrive(land, None)  # arms the landing barrier with the bytes
        bar_q = io.pipe_qland.sync_object_full.get_barrier(land)
        cute.copy(io.tma_atom_Q, tQgQ[None, m], tQsQ[None, q_state.index], tma_bar_ptr=bar_q)
        with cute.arch.elect_one():
            cute.copy(bulk_atom, gLSE_all[None, vec_idx], io.sLSE[None, q_state.index], mbar_ptr=bar_q)
        io.pipe_do.sync_object_empty.wait(q_state.index, q_state.phase)
        io.pipe_doland.sync_object_empty.wait(land, phase)
        io.pipe_doland.sync_object_full.arrive(land, None)
        bar_do = io.pipe_doland.sync_object_full.get_barrier(land)
        cute.copy(io.tma_atom_dO, tdOgdO[None, m], tdOsdO[None, q_state.index], tma_bar_ptr=bar_do)
        with cute.arch.elect_one():
            cute.copy(bulk_atom, gDps_all[None, vec_idx], io.sDpsum[None, q_state.index], mbar_ptr=bar_do)

    def step_masked(self, m, rng: Context):
        """Whether query tile m is a masked step of the key tile: the causal band or the window's band (a query
        row that does not see a key of the tile)."""
        masked = False
        if const_expr(self.causal):
            masked = m < rng.m_mask_end
        if const_expr(self.block_info.windowed):
            masked = masked | (m >= rng.m_window_start)
        return masked

    @cute.jit
    def tile_clean(self, io: Context, m: Int32, vec_idx: Int32, rng: Context) -> Int32:
        """clean_tiles: the preprocess's flag of query tile m (chunk vec_idx), read for masked steps only; 0
        without clean_tiles (every masked step is sanitized)."""
        clean = Int32(0)
        if const_expr(self.clean_tiles):
            if self.step_masked(m, rng):
                clean = io.mClean[vec_idx]
        return clean

    def step_sanitized(self, m, rng: Context, seqlen: SeqlenInfo, clean):
        """Query tile m's Q / dO go through the sanitizer: masked steps (tile_clean's ``clean`` says whether the
        tile's rows are certified finite, so that they can skip it), and (packed sequences) the tile cut by the
        sequence end, whose padding rows are another sequence's tokens."""
        sanitized = self.step_masked(m, rng)
        if const_expr(self.clean_tiles):
            sanitized = sanitized & (clean == 0)
        if const_expr(self.varlen):
            sanitized = sanitized | ((m + 1) * self.tile_m > seqlen.seqlen_q)
        return sanitized

    @cute.jit
    def phases(self, rng: Context):
        """A key tile's steps as (first query tile, end, masked) ranges in visiting order: ascending (the causal
        band, the plain tiles, the window's band), or with masked_last the plain tiles [m_mask_end, m_window_start)
        first, then the causal band [m_min, m_mask_end), then the window's band [m_window_start, m_max). Every role
        visits phase by phase, within a phase head by head of the GQA group, within a head the range in ascending
        order; so the producer, the sanitizer, the MMA warpgroups and the dQ writer agree on the steps. (The MMA
        warpgroups walk a phase's heads and tiles as one flat loop: with a loop over heads around the tile loops,
        ptxas spilled dK / dV and serialized the wgmmas at hdim 64 with 128-row query tiles; NOTES_BWD.md.)"""
        band = (rng.m_min, rng.m_mask_end, True)
        plain = (rng.m_mask_end, rng.m_window_start, False)
        out = [plain, band] if self.masked_last else [band, plain]
        if const_expr(self.block_info.windowed):
            out.append((rng.m_window_start, rng.m_max, True))
        return out

    @cute.jit
    def phase_m(self, i: Int32, first: Int32, end: Int32, rng: Context):
        """The query tile of loop index i in [first, end) of a phase: i itself, or with det_rotate the phase
        rotated to start at first + rng.rot (rot < end - first in the one non-empty phase of a non-causal tile)."""
        m = i
        if const_expr(self.det_rotate):
            m = i + rng.rot
            m = m - (end - first) if m >= end else m
        return m

    # ------------------------------------------------------------------------
    @cute.jit
    def sanitizer_role(self, io: Context, launch: Context, first, tid: Int32):
        """Warps 2-3 of warpgroup 0: every tile's K and its sanitized steps' Q / dO tiles."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        # plain counters instead of two pipeline states: this warpgroup runs on 24 registers
        step = Int32(0)  # every step: the smem stage of Q / dO
        n_sanitized = Int32(0)  # sanitized steps: the stage and phase of the landing barriers
        self.each_tile(io, launch, first,
                       lambda tile, seqlen, rng, st: self.sanitizer(io, tile, seqlen, rng, tid, *st),
                       (kv_state, step, n_sanitized), False)

    @cute.jit
    def sanitizer(self, io: Context, tile, seqlen: SeqlenInfo, rng: Context, tid: Int32, kv_state, step: Int32,
                  n_sanitized: Int32):
        """One tile's sanitizer work (none for a tile without work); returns the advanced (kv_state, step,
        n_sanitized)."""
        if rng.has_work:
            kv_state, step, n_sanitized = self.sanitize_tile(io, tile, seqlen, rng, tid, kv_state, step, n_sanitized)
        return kv_state, step, n_sanitized

    @cute.jit
    def sanitize_tile(self, io: Context, tile, seqlen: SeqlenInfo, rng: Context, tid: Int32, kv_state, step: Int32,
                      n_sanitized: Int32):
        """The K tile once, then the Q / dO tiles of the sanitized steps (same order as the producer): zero rows
        holding NaN / inf (a bad query row also gets lse2 = NaN), then complete the barriers the MMA warpgroups wait
        on."""
        nthr, fp16 = self.sanitizer_threads, self.fp16
        bar = int(BwdBarrier.SANITIZE)
        io.pipe_kvland.consumer_wait(kv_state)
        if block_any(tile_maybe_nonfinite(io.sK.iterator, self.tile_n * self.head_dim, Int32(0), tid, nthr, fp16),
                     bar, nthr):
            clear_nonfinite_rows(io.sK, tid, nthr, fp16)
            cute.arch.fence_view_async_shared()  # zeroed rows -> wgmma (async proxy)
            cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
        if tid == 0:
            cute.arch.mbarrier_arrive(io.pipe_kv.sync_object_full.get_barrier(0))
        if const_expr(self.persistent):
            io.pipe_kvland.consumer_release(kv_state)  # (the MMA warpgroups release it too, after their last step)
        kv_state.advance()

        ns = self.num_stages
        num_heads = cute.size(io.mQ.shape[2])
        for first, end, _ in self.phases(rng):
            for hi in cutlass.range(tile.group, unroll=1):
                head = tile.head_kv * tile.group + hi
                for i in cutlass.range(first, end, unroll=1):
                    m = self.phase_m(i, first, end, rng)
                    clean = self.tile_clean(io, m, (seqlen.scratch_base + m) * num_heads + head, rng)
                    if self.step_sanitized(m, rng, seqlen, clean):
                        self.sanitize_q_do(io, seqlen, m, step % ns, n_sanitized, tid)
                        n_sanitized = n_sanitized + 1
                    step = step + 1
        return kv_state, step, n_sanitized

    @cute.jit
    def sanitize_q_do(self, io: Context, seqlen: SeqlenInfo, m: Int32, stage: Int32, n_sanitized: Int32, tid: Int32):
        """One sanitized step: wait for Q / dO tile m on the landing barriers, zero the rows holding NaN / inf
        (tile_m / 64 rows per thread; a bad query row's lse2 becomes NaN), then complete pipe_q / pipe_do of the
        smem stage and free the landing stage."""
        nthr, fp16, tm, ns = self.sanitizer_threads, self.fp16, self.tile_m, self.num_stages
        bar = int(BwdBarrier.SANITIZE)
        land, phase = n_sanitized % ns, (n_sanitized // ns) % 2
        io.pipe_qland.sync_object_full.wait(land, phase)
        io.pipe_doland.sync_object_full.wait(land, phase)
        n_elems = tm * self.head_dim
        maybe = tile_maybe_nonfinite(io.sQ.iterator, n_elems, stage, tid, nthr, fp16)
        maybe = maybe | tile_maybe_nonfinite(io.sdO.iterator, n_elems, stage, tid, nthr, fp16)
        if block_any(maybe, bar, nthr):
            sQ, sdO = io.sQ[None, None, stage], io.sdO[None, None, stage]
            for k in cutlass.range_constexpr(tm // nthr):
                r = tid + k * nthr
                if row_is_nonfinite(sQ, r, fp16) | row_is_nonfinite(sdO, r, fp16):
                    zero_row(sQ, r)
                    zero_row(sdO, r)
                    if m * tm + r < seqlen.seqlen_q:  # a padding row keeps lse2 = +inf: P = 0
                        io.sLSE[r, stage] = Float32.nan
            cute.arch.fence_view_async_shared()  # zeroed rows -> wgmma (async proxy)
            cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
        if tid == 0:
            cute.arch.mbarrier_arrive(io.pipe_q.sync_object_full.get_barrier(stage))
            cute.arch.mbarrier_arrive(io.pipe_do.sync_object_full.get_barrier(stage))
        if tid % 32 == 0:  # one arrival per sanitizer warp frees the landing stage
            cute.arch.mbarrier_arrive(io.pipe_qland.sync_object_empty.get_barrier(land))
            cute.arch.mbarrier_arrive(io.pipe_doland.sync_object_empty.get_barrier(land))

    # ------------------------------------------------------------------------
    @cute.jit
    def dq_writer_role(self, io: Context, launch: Context, first):
        """Warp 1 of warpgroup 0: every tile's dQ adds, then the wait for their smem reads (smem stays allocated
        until the last add has read it)."""
        self.each_tile(io, launch, first, lambda tile, seqlen, rng, st: self.dq_writer(io, tile, seqlen, rng, st),
                       Int32(0), False)
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def dq_writer(self, io: Context, tile, seqlen: SeqlenInfo, rng: Context, state):
        """One tile's dQ adds (none for a tile without work); the state is not used (a walk's body returns one)."""
        if rng.has_work:
            self.dq_writer_tile(io, tile, seqlen, rng)
        return state

    @cute.jit
    def dq_writer_tile(self, io: Context, tile, seqlen: SeqlenInfo, rng: Context):
        tm, tn = self.tile_m, self.tile_n
        D = self.head_dim
        head_kv, group, num_heads, n_block = tile.head_kv, tile.group, tile.num_heads, tile.block
        lane = cute.arch.lane_idx()
        n_chunks = cute.size(io.mdQacc.shape[0]) // (tm * D)
        gdQ = cute.make_tensor(io.mdQacc.iterator, dq_chunk_layout(tm, D, n_chunks))
        chunk_bytes = self.dq_chunk_elems * (8 if self.dq_fixed else 4)
        n_blocks_k = cute.ceil_div(seqlen.seqlen_k, tn)
        wr = Context(gdQ=gdQ, chunk_bytes=chunk_bytes, n_blocks_k=n_blocks_k, lane=lane)
        for first, end, _ in self.phases(rng):
            for hi in cutlass.range(group, unroll=1):
                head = head_kv * group + hi
                for i in cutlass.range(first, end, unroll=1):
                    m = self.phase_m(i, first, end, rng)
                    self.add_dq_tile(io, wr, seqlen, n_block, m, (seqlen.scratch_base + m) * num_heads + head)

    @cute.jit
    def add_dq_tile(self, io: Context, wr: Context, seqlen: SeqlenInfo, n_block: Int32, m: Int32, chunk: Int32):
        """The dQ writer's step: free each warpgroup's smem buffer once its previous add has read it, (deterministic)
        wait for this key tile's turn on query tile m, add both halves of the tile into scratch chunk `chunk`, and
        (deterministic) release the ticket once the adds landed."""
        lane, gdQ, sdQ, mSem, chunk_bytes = wr.lane, wr.gdQ, io.sdQ, io.mSem, wr.chunk_bytes
        for w in cutlass.range_constexpr(2):
            if lane == 0:
                # the previous add of this warpgroup's buffer has finished reading smem
                cute.arch.cp_async_bulk_wait_group(1 - w, read=True)
            cute.arch.sync_warp()
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY_WG0) + w, number_of_threads=160)
        if const_expr(self.deterministic):
            rank = n_block
            if const_expr(self.causal):
                # key tiles add from the diagonal down: rank 0 is the last key tile this query tile sees
                n_hi = self.block_info.n_block_max(seqlen, m, wr.n_blocks_k)
                rank = n_hi - 1 - n_block
            if const_expr(self.det_rotate):
                c = rotation_step(self.tile_m, self.tile_n, seqlen, self.det_rotate)
                rank = rank_rotated(n_block, m, wr.n_blocks_k, c)
            if lane == 0:
                sem_ptr = mSem.iterator + chunk
                cur = ld_acquire_gpu(sem_ptr)
                while cur != rank:
                    if const_expr(self.ticket_sleep_ns > 0):
                        nanosleep(self.ticket_sleep_ns)
                    cur = ld_acquire_gpu(sem_ptr)
            cute.arch.sync_warp()
        for w in cutlass.range_constexpr(2):
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL_WG0) + w, number_of_threads=160)
            if lane == 0:
                add = bulk_reduce_add_u64 if const_expr(self.dq_fixed) else bulk_reduce_add_f32
                add(sdQ[None, None, None, w].iterator, gdQ[None, None, None, w, chunk].iterator, chunk_bytes)
                cute.arch.cp_async_bulk_commit_group()
            cute.arch.sync_warp()
        if const_expr(self.deterministic):
            # release the ticket once the adds landed in gmem. (Releasing it one step later, after the
            # next step's adds, was measured: 0.6-0.9x, each CTA of a chain then lags one more step.)
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                if const_expr(self.release_fence):
                    cute.arch.fence_acq_rel_gpu()
                red_release_add_gpu(mSem.iterator + chunk, 1)
            cute.arch.sync_warp()

    # ------------------------------------------------------------------------
    @cute.jit
    def gemm(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        tA: cute.Tensor,
        tB: cute.Tensor,
        zero_init: cutlass.Constexpr[bool],
    ):
        """Issue one warpgroup GEMM (all K blocks) as one wgmma commit group; does not wait."""
        wgmma_gemm(tiled_mma, acc, tA, tB, zero_init)

    # ------------------------------------------------------------------------
    @cute.jit
    def mma_role(
        self,
        io: Context,
        launch: Context,
        first,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        scale: Float32,
        scale_log2: Float32,
    ):
        """Warpgroups 1, 2: every tile's steps and its dK / dV epilogue."""
        mm = self.mma_operands(io, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, scale, scale_log2)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        self.each_tile(io, launch, first, lambda tile, seqlen, rng, st: self.mma_tile(io, mm, tile, seqlen, rng, *st),
                       (kv_state, q_state), False)
        if const_expr(self.use_tma_dkv):
            tidx, _, _ = cute.arch.thread_idx()
            if tidx - 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the staging tile stays allocated until read

    @cute.jit
    def mma_operands(
        self,
        io: Context,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        scale: Float32,
        scale_log2: Float32,
    ):
        """What the MMA threads bind once: operand fragments, partitions and copy atoms (the same for every tile)."""
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_layout = cute.make_layout(2, stride=128)
        wg_sdp = tiled_mma_sdp.get_slice(wg_layout(wg))
        wg_dkv = tiled_mma_dkv.get_slice(wg_layout(wg))
        wg_dq = tiled_mma_dq.get_slice(wg_layout(wg))
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dkv = tiled_mma_dkv.get_slice(tidx)
        sQ, sdO, sK, sdS = io.sQ, io.sdO, io.sK, io.sdS

        # operands. The streamed ones' descriptor bases (Q, dO, dS and their transposes) are computed once
        # (loop_invariant_descriptors: 377 -> 360 instructions per step at hdim 128); K's, V's and K^T's are left to
        # the DSL: held across the loop too, they spill hdim 128's deterministic and packed accumulating variants
        hoist = descriptor_hoister(self.hoist_descriptors)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = hoist(wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)))
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(io.sV))
        tdPrdO = hoist(wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)))
        tdVrdOt = hoist(wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdO))))  # (D, tm, stages)
        tdKrQt = hoist(wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sQ))))
        tdQrdS = hoist(wg_dq.make_fragment_A(wg_dq.partition_A(sdS)))  # (tm, tn, stages)
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))  # (D, tn)
        sdSt = transpose_smem(sdS)  # (tn, tm, stages)

        s_shape = wg_sdp.partition_shape_C((tn, tm))
        dq_shape = wg_dq.partition_shape_C((tm, D))

        # coordinates of this thread's S^T elements: (key in tile, query in tile)
        cS = cute.make_identity_tensor((tn, tm))
        tScS_mn = mn_view(thr_sdp.partition_C(cS))
        t0ScS_mn = mn_view(tiled_mma_sdp.get_slice(0).partition_C(cS))

        # fragment-order view of this thread's dQ accumulator (matches dq_chunk_layout)
        t_in_wg = tidx - wg * 128
        tdQsdQ = io.sdQ[None, t_in_wg, None, wg]
        # fixed-point dQ: the query row (in its tile) of each row of this thread's dQ fragment
        tdQcdQ_mn = None
        if const_expr(self.dq_fixed):
            tdQcdQ_mn = mn_view(tiled_mma_dq.get_slice(tidx).partition_C(cute.make_identity_tensor((tm, D))))

        # dS^T register fragment -> sdS store: stmatrix.trans (keys are the contiguous smem dim)
        r2s_dS = None
        if const_expr(self.stmatrix_ds):
            stm_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), self.dtype)
            r2s_dS = cute.make_tiled_copy_S(stm_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma_sdp))

        return Context(
            tiled_mma_sdp=tiled_mma_sdp, tiled_mma_dkv=tiled_mma_dkv, tiled_mma_dq=tiled_mma_dq,
            tSrK=tSrK, tSrQ=tSrQ, tdPrV=tdPrV, tdPrdO=tdPrdO, tdVrdOt=tdVrdOt, tdKrQt=tdKrQt, tdQrdS=tdQrdS,
            tdQrKt=tdQrKt, sdSt=sdSt, thr_sdp=thr_sdp, thr_dkv=thr_dkv, wg_dkv=wg_dkv, r2s_dS=r2s_dS,
            s_shape=s_shape, dq_shape=dq_shape, tScS_mn=tScS_mn, t0ScS_mn=t0ScS_mn, tdQsdQ=tdQsdQ,
            tdQcdQ_mn=tdQcdQ_mn, scale=scale, scale_log2=scale_log2, wg=wg,
        )

    @cute.jit
    def mma_tile(self, io: Context, mm: Context, tile, seqlen: SeqlenInfo, rng: Context, kv_state, q_state):
        """One tile's steps (none for a tile without work) and its dK / dV epilogue; returns the advanced
        (kv_state, q_state)."""
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        acc_dK = cute.make_rmem_tensor(mm.wg_dkv.partition_shape_C((tn, D)), Float32)
        acc_dV = cute.make_rmem_tensor(mm.wg_dkv.partition_shape_C((tn, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # the phase of this tile's K / V (a one-CTA-per-tile kernel has one tile: phase 0)
        kv_phase = 0
        if const_expr(self.persistent):
            kv_phase = kv_state.phase
        st = extend_context(
            mm, acc_dK=acc_dK, acc_dV=acc_dV, sLSE=io.sLSE, sDpsum=io.sDpsum, pipe_q=io.pipe_q, pipe_do=io.pipe_do,
            n_block=tile.block, pipe_kv=io.pipe_kv, kv_phase=kv_phase, mdQscale=io.mdQscale,
            scratch_base=seqlen.scratch_base, num_heads=cute.size(io.mQ.shape[2]),
            mask=AttentionMask(tm, tn, self.causal, seqlen.seqlen_k, seqlen.diag, mm.tScS_mn, mm.t0ScS_mn,
                               self.window_left),
        )

        if rng.has_work:
            if const_expr(self.sanitize):
                # S^T / dP^T may read K and V as they landed (a bad key's scores are masked or its rows' lse is
                # NaN); the dQ GEMM waits for the sanitized K (mma_step), which hides the K check
                io.pipe_kvland.consumer_wait(kv_state)
            else:
                io.pipe_kv.consumer_wait(kv_state)
            for first, end, masked in self.phases(rng):
                # one flat loop over the phase's (head, tile) steps: see phases()
                head = tile.head_kv * tile.group
                if const_expr(self.det_rotate):
                    m_start = self.phase_m(first, first, end, rng)
                    m = m_start
                    for _ in cutlass.range(tile.group * (end - first), unroll=1):
                        q_state = self.mma_step(st, q_state, m, head, masked)
                        m = m + 1
                        m = first if m == end else m
                        head = head + (1 if m == m_start else 0)  # the rotated phase is done: the next head
                else:  # (the rotated loop with m_start = first; kept apart: the PTX measured on the GPU)
                    m = first
                    for _ in cutlass.range(tile.group * (end - first), unroll=1):
                        q_state = self.mma_step(st, q_state, m, head, masked)
                        m = m + 1
                        wrap = m == end
                        head = head + (1 if wrap else 0)
                        m = first if wrap else m
            if const_expr(self.persistent):
                # every GEMM of the tile has completed (mma_step waits for all): K / V may be overwritten by the
                # next tile's loads while this one stores its dK / dV
                if const_expr(self.sanitize):
                    io.pipe_kvland.consumer_release(kv_state)
                else:
                    io.pipe_kv.consumer_release(kv_state)
            kv_state.advance()

        # ---------------- dK / dV epilogue ----------------
        if const_expr(self.compute_dkv):
            self.store_dkv(io, st, mm.thr_dkv, tile, seqlen, rng)
        return kv_state, q_state

    @cute.jit
    def store_dkv(self, io: Context, st: Context, thr_dkv, tile, seqlen: SeqlenInfo, rng: Context):
        acc_dK, acc_dV, tn = st.acc_dK, st.acc_dV, self.tile_n
        n_block, seqlen_k = tile.block, seqlen.seqlen_k
        write = rng.has_work
        if const_expr(not self.accumulate):
            write = n_block * tn < seqlen_k  # fresh outputs: key tiles without work get zeros
            if const_expr(self.det_chunk > 0):
                write = write and tile.valid
        if const_expr(self.split_keys):
            if rng.split_slot >= 0:  # a part: the last to arrive stores the tile, its parts' sum
                self.store_split_dkv(io, st, thr_dkv, tile, rng)
                write = False
        if const_expr(self.use_tma_dkv):
            if write:
                self.store_dkv_tile(io, st.tiled_mma_dkv, acc_dV, io.tma_atom_dV, io.tma_dV, tile)
                self.store_dkv_tile(io, st.tiled_mma_dkv, acc_dK, io.tma_atom_dK, io.tma_dK, tile)
        elif write:
            if const_expr(not self.varlen):
                mdK_cur = io.mdK[None, None, tile.head_kv, tile.batch]
                mdV_cur = io.mdV[None, None, tile.head_kv, tile.batch]
            else:
                # the key offset read again rather than kept in a register through the MMA loop, which at hdim 64
                # with 128-row query tiles uses all of the warpgroups' 240
                offset_k = SeqlenInfo.create(tile.batch, io.mQ, io.mK, io.diag, io.mCuSeqlensQ, io.mCuSeqlensK,
                                             io.mSegOffQ, io.mSegOffK, varlen=True, seg_offsets=self.seg_offsets,
                                             worklist=self.worklist).offset_k
                mdK_cur = cute.domain_offset((offset_k, 0), io.mdK[None, None, tile.head_kv])
                mdV_cur = cute.domain_offset((offset_k, 0), io.mdV[None, None, tile.head_kv])
            kv_tile = (self.tile_n, self.head_dim)
            if const_expr((self.dq_fixed or self.worklist) and not self.accumulate):
                # the written forms of cp_invariant and of a work list's fresh dK / dV: the accumulating one's
                # bits, which add the tile into zeros (-0 + 0 = +0), so the two routes agree on a signed zero too
                for acc in (acc_dK, acc_dV):
                    acc.store(acc.load() + Float32(0.0))
            store_acc_rows(acc_dK, mdK_cur, thr_dkv, kv_tile, n_block, seqlen_k, self.accumulate)
            store_acc_rows(acc_dV, mdV_cur, thr_dkv, kv_tile, n_block, seqlen_k, self.accumulate)

    @cute.jit
    def store_split_dkv(self, io: Context, st: Context, thr_dkv, tile, rng: Context):
        """A part of a split key tile (split_keys): its fp32 dK / dV go to scratch slot ``rng.split_slot`` (rows
        2 * slot * tile_n on: dK, then dV), then it arrives on the tile's counter (after the tile counter); the part
        that arrives last sums every part's from the scratch in part order (the bits do not depend on which part
        finishes last) and stores the tile. (The accumulators are only read here: a register tensor written under
        the run-time branches would be carried through them whole, which spilled.)"""
        tn, D = self.tile_n, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        sync = int(BwdBarrier.DKV_EPILOGUE)
        accs = (st.acc_dK, st.acc_dV)
        for i in cutlass.range_constexpr(2):
            store_acc_rows(accs[i], io.mSplitDKV, thr_dkv, (tn, D), 2 * rng.split_slot + i,
                           (2 * rng.split_slot + i + 1) * tn, False)
        # every MMA thread's part is written: one thread publishes it (release) and learns how many parts arrived
        # before it (acquire: their parts are visible to every thread after the barrier)
        cute.arch.barrier(barrier_id=sync, number_of_threads=256)
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            io.sSplit[0] = cute.arch.atomic_add(io.mTileCounter.iterator + 1 + rng.split_tile, Int32(1))
            cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=sync, number_of_threads=256)
        if io.sSplit[0] == rng.split_parts - 1:
            first_slot = rng.split_slot - rng.split_part
            # dV first, then dK, as store_dkv stores them
            for i, tma_atom, mdst in ((1, io.tma_atom_dV, io.tma_dV), (0, io.tma_atom_dK, io.tma_dK)):
                out = cute.make_rmem_tensor_like(accs[i], self.dtype)
                out_mn = mn_view(out)
                for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
                    total = cute.make_rmem_tensor_like(out_mn[r, None], Float32)
                    total.fill(0.0)
                    part = cute.make_rmem_tensor_like(out_mn[r, None], Float32)
                    for p in cutlass.range(rng.split_parts, unroll=1):
                        src = mn_view(thr_dkv.partition_C(cute.local_tile(
                            io.mSplitDKV, (tn, D), (2 * (first_slot + p) + i, 0))))
                        cute.autovec_copy(src[r, None], part)
                        total.store(total.load() + part.load())
                    out_mn[r, None].store(total.load().to(self.dtype))
                self.store_dkv_converted(io, st.tiled_mma_dkv, out, tma_atom, mdst, tile)

    @cute.jit
    def store_dkv_tile(self, io: Context, tiled_mma_dkv, acc: cute.Tensor, tma_atom, mdst: cute.Tensor, tile):
        """One fresh dK or dV tile through the staging tile and a TMA store, once the previous store has read it."""
        r = cute.make_rmem_tensor_like(acc, self.dtype)
        r.store(acc.load().to(self.dtype))
        self.store_dkv_converted(io, tiled_mma_dkv, r, tma_atom, mdst, tile)

    @cute.jit
    def store_dkv_converted(self, io: Context, tiled_mma_dkv, r: cute.Tensor, tma_atom, mdst: cute.Tensor, tile):
        """store_dkv_tile of a tile already in the output dtype (this thread's accumulator fragment)."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        if tidx < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=int(BwdBarrier.DKV_EPILOGUE), number_of_threads=256)
        store_tile_tma(tiled_mma_dkv, r, io.sdKV, tma_atom, mdst[None, None, tile.head_kv, tile.batch],
                       (self.tile_n, self.head_dim), (tile.block, 0), tidx, int(BwdBarrier.DKV_EPILOGUE), 256)

    # ------------------------------------------------------------------------
    @cute.jit
    def store_ds(self, st: Context, rdS: cute.Tensor, stage: Int32):
        if const_expr(self.stmatrix_ds):
            tidx, _, _ = cute.arch.thread_idx()
            thr = st.r2s_dS.get_slice(tidx - 128)
            dst = thr.partition_D(st.sdSt[None, None, stage])  # ((8, 1), 1, 4): 4 stmatrix.x4 per thread
            src = st.r2s_dS.retile(rdS)  # ((8, 4), 1, 1): the same values, iterations folded into mode 0
            src = cute.make_tensor(src.iterator, cute.composition(src.layout, cute.make_layout(dst.shape)))
            cute.copy(st.r2s_dS, src, dst)
        else:
            cute.autovec_copy(rdS, st.thr_sdp.partition_C(st.sdSt[None, None, stage]))

    # ------------------------------------------------------------------------
    @cute.jit
    def mma_step(self, st: Context, q_state, m_block: Int32, head: Int32, masked: cutlass.Constexpr[bool]):
        """One (query tile, key tile) step of both MMA warpgroups: S^T, dP^T, P^T, dS^T, dV, dK, and the dQ tile
        handed to the writer warp."""
        stage = q_state.index
        tScS_mn, scale = st.tScS_mn, st.scale
        row_scales = None
        if const_expr(self.dq_fixed and self.fixed_scales_early):
            # loaded now, so that their global-load latency hides behind the whole S / dS phase (loaded under the
            # dQ GEMM, the first scaling multiply waited on them: the int64 kernel's largest single stall)
            row_scales = self.load_row_scales(st, m_block, head)
        # (1) S^T = K Q^T ; (2) dP^T = V dO^T
        stage_wait(st.pipe_q, q_state, self.try_waits)
        acc_S = cute.make_rmem_tensor(st.s_shape, Float32)
        self.gemm(st.tiled_mma_sdp, acc_S, st.tSrK, st.tSrQ[None, None, None, stage], True)
        stage_wait(st.pipe_do, q_state, self.try_waits)
        acc_dP = cute.make_rmem_tensor(st.s_shape, Float32)
        self.gemm(st.tiled_mma_sdp, acc_dP, st.tdPrV, st.tdPrdO[None, None, None, stage], True)
        acc_S_mn = mn_view(acc_S)
        n_rows = cute.size(acc_S_mn, mode=[0])
        n_cols = cute.size(acc_S_mn, mode=[1])
        lse_early = dps_early = None
        if const_expr(self.early_vectors):
            # the columns' lse2 and dPsum read while the GEMMs run (both landed with Q / dO), not at their use
            lse_early = cute.make_rmem_tensor(n_cols, Float32)
            dps_early = cute.make_rmem_tensor(n_cols, Float32)
            for c in cutlass.range_constexpr(n_cols):
                lse_early[c] = st.sLSE[tScS_mn[0, c][1], stage]
                dps_early[c] = st.sDpsum[tScS_mn[0, c][1], stage]
        warpgroup.wait_group(1)  # S^T done

        # (3) P^T = exp2(S^T * scale_log2 - lse2[query]), 0 at masked pairs
        cap_grad = None
        if const_expr(self.softcap > 0):
            softcap_scores(acc_S, st.scale_log2)  # tanh(s * softmax_scale / c); the exponential scales by c log2 e
            if const_expr(self.softcap_grad_regs):
                cap_grad = mn_view(softcap_grad_fp16(acc_S))  # 1 - tanh^2, for dS below
        exp_scale_log2 = st.scale_log2
        if const_expr(self.softcap > 0):
            exp_scale_log2 = Float32(softcap_scale_log2(self.softcap))
        for c in cutlass.range_constexpr(n_cols):
            lse_c = lse_early[c] if const_expr(self.early_vectors) else st.sLSE[tScS_mn[0, c][1], stage]
            for r in cutlass.range_constexpr(n_rows):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * exp_scale_log2 - lse_c, fastmath=True)
        if const_expr(masked):
            st.mask.apply_transposed(acc_S, m_block, st.n_block, 0.0)
        warpgroup.wait_group(0)  # dP^T done

        # (5) dS^T = P^T * (scale * dP^T - dPsum_scaled[query])
        acc_dP_mn = mn_view(acc_dP)
        inv_exp_scale = Float32(1.0 / softcap_scale_log2(self.softcap)) if self.softcap > 0 else None
        for c in cutlass.range_constexpr(n_cols):
            dps_c = dps_early[c] if const_expr(self.early_vectors) else st.sDpsum[tScS_mn[0, c][1], stage]
            u_offset = None
            if const_expr(self.softcap > 0 and not self.softcap_grad_regs):
                u_offset = st.sLSE[tScS_mn[0, c][1], stage] * inv_exp_scale
            for r in cutlass.range_constexpr(n_rows):
                p = acc_S_mn[r, c]
                ds = p * (acc_dP_mn[r, c] * scale - dps_c)
                if const_expr(self.softcap > 0):  # the chain rule through the cap
                    if const_expr(self.softcap_grad_regs):
                        ds = ds * Float32(cap_grad[r, c])
                    else:
                        ds = ds * softcap_grad_from_p(p, u_offset, inv_exp_scale)
                if const_expr(masked):
                    # P is exactly 0 at masked pairs, but 0 * NaN (dP of a bad V row, dPsum of a bad row) is not
                    ds = ds if p != Float32(0.0) else Float32(0.0)
                acc_dP_mn[r, c] = ds
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        to_16bit(acc_dP, rdS, self.try_waits)
        if const_expr(self.compute_dkv):
            # (4) dV += P^T dO, issued after dS is computed (GPU run 1: 4-15 % faster than before it, fewer live
            # registers)
            # P^T and dS^T as the register A operands, made in this step (not loop-carried: registers are live
            # only while their GEMM is in flight)
            rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
            to_16bit(acc_S, rP, self.try_waits)
            self.gemm(st.tiled_mma_dkv, st.acc_dV, acc_to_operand_a(rP), st.tdVrdOt[None, None, None, stage], False)
        acc_dQ = None
        if const_expr(self.compute_dq):
            # dS^T -> smem, as the (tm, tn) K-major A operand of dQ = dS K
            self.store_ds(st, rdS, stage)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(BwdBarrier.PDS), number_of_threads=256)
            # (6) dQ = dS K
            if const_expr(self.sanitize):
                st.pipe_kv.sync_object_full.wait(0, st.kv_phase)  # the sanitized K (once done: returns at once)
            acc_dQ = cute.make_rmem_tensor(st.dq_shape, Float32)
            self.gemm(st.tiled_mma_dq, acc_dQ, st.tdQrdS[None, None, None, stage], st.tdQrKt, True)
            if const_expr(self.dq_fixed and not self.fixed_scales_early):
                # loaded under the dQ and dK GEMMs (at the start of the step they held registers through its
                # S / dS phase, which spilled at hdim 64 with 128-row query tiles)
                row_scales = self.load_row_scales(st, m_block, head)
        if const_expr(self.compute_dkv):
            # (7) dK += dS^T Q
            self.gemm(st.tiled_mma_dkv, st.acc_dK, acc_to_operand_a(rdS), st.tdKrQt[None, None, None, stage], False)
            warpgroup.wait_group(1)  # dV (and dQ) done: only dK may be in flight
        else:
            warpgroup.wait_group(0)  # dQ done
        st.pipe_do.consumer_release(q_state)

        if const_expr(self.compute_dq):
            # dQ tile -> smem (fragment order) for the writer warp
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY_WG0) + st.wg, number_of_threads=160)
            if const_expr(self.dq_fixed):
                acc_dQ = self.to_fixed(st, acc_dQ, row_scales)
            rdQ = cute.make_tensor(acc_dQ.iterator, cute.make_layout(st.tdQsdQ.shape))
            cute.autovec_copy(rdQ, st.tdQsdQ)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_FULL_WG0) + st.wg, number_of_threads=160)

        warpgroup.wait_group(0)  # dK done
        st.pipe_q.consumer_release(q_state)
        q_state.advance()
        return q_state

    @cute.jit
    def load_row_scales(self, st: Context, m_block: Int32, head: Int32):
        """The fixed-point scales (fixed_point.dq_scale) of this thread's dQ fragment rows in query tile m_block."""
        chunk = (st.scratch_base + m_block) * st.num_heads + head
        gscale = cute.make_tensor(st.mdQscale.iterator + chunk * self.tile_m, cute.make_layout(self.tile_m))
        n_dq_rows = cute.size(st.tdQcdQ_mn, mode=[0])
        row_scales = cute.make_rmem_tensor((n_dq_rows,), Float32)
        for r in cutlass.range_constexpr(n_dq_rows):
            row_scales[r] = gscale[st.tdQcdQ_mn[r, 0][0]]
        return row_scales

    @cute.jit
    def to_fixed(self, st: Context, acc_dQ: cute.Tensor, row_scales: cute.Tensor):
        """dQ * 2^s (exact: a power of two) truncated to int64 registers; |sum| < 2^62 (fixed_point.py)."""
        acc_dQ_mn = mn_view(acc_dQ)
        for r in cutlass.range_constexpr(cute.size(acc_dQ_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_dQ_mn, mode=[1])):
                acc_dQ_mn[r, c] = acc_dQ_mn[r, c] * row_scales[r]
        fixed = cute.make_rmem_tensor(st.dq_shape, cutlass.Int64)
        fixed.store(acc_dQ.load().to(cutlass.Int64))
        return fixed
