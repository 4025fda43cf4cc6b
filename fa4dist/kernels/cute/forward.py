"""Python entry point of the Hopper forward (fwd_sm90.py): configs, support check, launch.

``supports(q, k, v, causal=...)`` returns ``(ok, reason)``; ``forward(q, k, v, out, lse, *, softmax_scale, causal,
q_offset=0, k_offset=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
accumulate=False)`` writes out / lse in place (or, with accumulate=True, merges this block into a running fp32
(out, lse)).  Packed input's ``max_seqlen_q`` / ``max_seqlen_k`` size the grid without a host synchronisation: at
least the longest segment (a smaller value leaves the rows past it unwritten; the kernel contract passes the
exact values, from its checked cu_seqlens).  Compile cache, AOT objects, fake arguments and offsets come from
host.py, shared with the backward.  Everything that touches cutlass is imported lazily, so ``import fa4dist`` works
without it.
``FA4DIST_FWD_OVERRIDE="tile_m=128,persistent_ctas=0"`` (development hook, read at import) forces FwdConfig fields
for every call; a bad field or value raises naming it (host.py lists the environment variables).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import host, split_plans
from .split_plans import causal_split_plan, split_plan

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)


class FwdKernelArgs(NamedTuple):
    """The forward kernel's runtime arguments by name, in the order of ``fwd_sm90.FlashFwdSm90.__call__`` (before
    the stream): every launch and the compile's fake arguments build one (the backward's: BwdKernelArgs)."""

    q: Any
    k: Any
    v: Any
    out: Any  # q's dtype, or the fp32 running output (accumulate / out_fp32)
    lse: Any  # fp32
    scale_log2: Any  # the scores' scale in log2 units (host.score_scale)
    diag: Any  # q_offset - k_offset (per-segment offsets in seg_off_q / seg_off_k)
    max_seqlen_q: Any  # packed: the longest query segment (sizes the grid); dense: ignored
    cu_seqlens_q: Any = None  # packed; a work list: its item table
    cu_seqlens_k: Any = None
    seg_off_q: Any = None
    seg_off_k: Any = None
    sinks: Any = None  # (h,) fp32 sink logits
    tile_counter: Any = None  # dynamic tiles: (1,) int32, zero at launch (split_tail: 1 + split tiles)
    split_o: Any = None  # split_tail: the parts' fp32 out scratch
    split_lse: Any = None  # split_tail: their lse
    split_edge: Any = None  # split_tail: non-causal the first split tile, causal how many (split_plans)
    split_parts: Any = None  # split_tail: parts per split tile


@dataclass(frozen=True)
class FwdConfig:
    """Every static parameter of one compiled forward variant (the compile-cache key)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    causal: bool
    varlen: bool
    accumulate: bool
    seg_offsets: bool  # per-sequence / per-segment q/k offset tensors (int32, (nseg,))
    out_fp32: bool  # non-accumulate only: write out as fp32 instead of q's dtype
    tile_m: int
    tile_n: int
    num_stages: int
    intra_wg_overlap: bool = True
    sched_barrier: bool = True
    # > 0: keep a stale row max until it grows by more than this (log2 units) and skip the O rescale when no
    # row of the warp moved (vote.any); 0: exact max, always rescale (no vote, no branch), the default everywhere:
    # measured faster on the H200 (2026-11-30, run b: hdim 128 +4-11% non-causal, +1-4% causal; hdim 64 non-causal
    # +2-4%); hdim 64 causal, within noise then, kept 8 until its row sum started from the old one (sum_from_old,
    # 2026-12-02): the unconditional rescale then interleaves with the exponentials (the vote's branch keeps it
    # after them), +3% / +7% at 4k / 16k against 8 with the same sum. > 0 is a measurement knob (NOTES_FWD.md)
    rescale_threshold: float = 0.0
    # the online softmax's row sum starts from the old, rescaled sum (softmax.OnlineSoftmax.online): ptxas then
    # interleaves the O rescale with the exponentials. Changes the sum's rounding order. Default from
    # default_sum_from_old (measured, NOTES_FWD.md)
    sum_from_old: bool = False
    # the row max in flash-attn-4's form: max.f32 in four interleaved chains (softmax.max_chains) instead of the
    # max.NaN.f32 tree; the same bits for rows without a NaN score (NaN rows stay NaN). Default from
    # chained_max_launch (long dense non-causal hdim-128 launches; measured, NOTES_FWD.md eighteenth session)
    chained_max: bool = False
    # flash-attn-4's forms in the overlapped step (each K / V barrier tried once before the blocking wait, P
    # converted with inline cvts): ptxas then places the PV wait after ~10 exponentials instead of before the first
    # (NOTES_FWD.md, fourteenth session). The same bits either way. Default from default_late_pv_wait (measured)
    late_pv_wait: bool = False
    # the smem operands' descriptor bases computed once per tile instead of in every step
    # (common_sm90.loop_invariant_descriptors; the same bits). False: a measurement knob
    hoist_descriptors: bool = True
    # with hoist_descriptors: each of Q's K-block slices its own loop-invariant descriptor (False: the base only, the
    # slices' offsets added in every step; a measurement knob, the same bits)
    hoist_q_slices: bool = True
    tma_store_o: bool = True  # dense non-accumulate 16-bit out: O via smem + TMA store (else direct stores)
    # masked V tiles through the sanitizer warps (masked keys contribute nothing even if non-finite). False is a
    # measurement knob only (the cost of the guarantee): NaN / inf at masked positions then leak.
    sanitize: bool = True
    # with the sanitizer and intra_wg_overlap: a masked block's rows that see a NaN / inf V row are marked at the end
    # of the step that issues its PV instead of right after its softmax, where the consumer waited for the sanitized
    # V before the next block's S GEMM could issue. The same bits. Default from default_defer_v_marks
    defer_v_marks: bool = True
    # >= 0 (causal only): a sliding window's lower edge, keys more than this far below the diagonal are masked
    # and their blocks never loaded (backend.py folds a window's right edge into the diagonal)
    window_left: int = -1
    # > 0: soft-capped scores (softcap * tanh(scale * s / softcap)); the launch then passes tanh's scale
    softcap: float = 0.0
    # a (heads_q,) fp32 tensor of sink logits joins each row's denominator in the epilogue (non-accumulate)
    sinks: bool = False
    # softcap with bf16 and c <= 50: a constant row max instead of the running one (scores are bounded: no max
    # reductions, no O rescale). False is a measurement knob (the running max, as without softcap)
    softcap_fixed_max: bool = True
    # one launch over a work list (packed tensors; the item table of block_info.WORKLIST_COLUMNS replaces
    # cu_seqlens, and its diagonal column the offsets): forward_worklist
    worklist: bool = False
    # accumulate: the producer prefetches the running (out, lse) rows into L2 before the epilogue merges into them.
    # False is a measurement knob (the epilogue then waits on HBM for them)
    prefetch_running: bool = True
    # registers per thread of the producer warpgroup (0: the split of the warpgroup count; fwd_sm90.FlashFwdSm90).
    # Default from default_regs_producer (32 for hdim 96's causal persistent kernel, which spills on 24 / 240)
    regs_producer: int = 0
    # CTAs the launch asks to keep resident per SM (registers and shared memory split among them): 2 with tile_m =
    # 64 runs two independent 64-row tiles per SM, as cuDNN's short causal forward does with its two consumers.
    # Default from short_two_ctas (NOTES_FWD.md, twenty-seventh session)
    ctas_per_sm: int = 1
    # > 0: a persistent grid of at most this many CTAs (the SM count), each walking tiles in launch order, so that a
    # tile's epilogue overlaps the next tile's loads (packed launches only with dynamic_tiles); 0: one CTA per tile.
    # Default from default_persistent_ctas (measured, NOTES_FWD.md)
    persistent_ctas: int = 0
    # persistent only: CTAs take their next tile from a global counter (greedy, as the hardware's block scheduler
    # balances tiles of different lengths, and a CTA delayed by another kernel on its SM claims fewer) instead of
    # the static walk (False: a measurement knob); the launch passes a zeroed int32 counter
    dynamic_tiles: bool = True
    # dynamic_tiles: the launch's last claim sets the tile counter back to 0 (tile_scheduler.TileClaims.
    # reset_after_last), and the host passes the stream's own counter instead of a fresh zeroed one
    # (host.tile_counter: no allocation and no fill launch per call, ~15-20 us of host time on CUDA by the
    # forty-second session's profile). The same bits. Default since the forty-seventh session: its GPU suites
    # pass with it on, do_bench's short forwards +0-1%, 3 us less host per forward call (bench/RESULTS.md)
    reset_counter: bool = True
    # accumulate: the merge with fixed roundings (fwd_sm90.merge_running), the same bits in every compiled variant
    # (persistent or not; without it they may differ by 1-2 ulp); off while merges are not persistent by default
    exact_merge: bool = False
    # dense causal: the K + V rows (of all heads in a group) that the launch order keeps resident in L2 together
    # (tile_scheduler.fwd_work_tile's head groups); 0: the kernel's default, 16 MB worth at hdim 128 and 24 MB
    # below (NOTES_FWD.md, thirteenth session). A measurement knob
    l2_rows: int = 0
    # causal: the launch order alternates long and short query tiles (longest, shortest, ...) instead of longest
    # first (tile_scheduler.causal_m_block). Only the order of tiles changes, never a sum's. Default from
    # interleaved_launch (short dense sequences)
    interleave_lengths: bool = False
    # dense launches on the dynamic persistent grid writing a fresh 16-bit out: the tiles that make a few-wave
    # launch's tail are split over their key blocks, non-causal the last partial wave's (split_plan), causal the
    # longest (causal_split_plan); each part's (out, lse) goes to an fp32 scratch and the part that finishes last
    # merges them, in part order. A split tile's bits differ from an unsplit one's (a merge of partial softmaxes),
    # the same from run to run. Default from default_split_tail; a launch that its plan does not split runs the
    # variant without it (forward.forward)
    split_tail: bool = False
    # programmatic dependent launch (one CTA per tile only): the launch may start while the kernel before it in the
    # stream finishes, and its epilogue waits for that kernel before it touches out / lse (fwd_sm90). The same bits.
    # For a caller whose previous kernel wrote none of q, k, v and the table (forward_worklist's overlap_previous)
    pdl: bool = False
    # the overlapped step's K / V releases by the elect.sync winner (common_sm90.stage_release) instead of the lane-0
    # predicate ptxas recomputes from %tid in every step (one S2R a step; flash-attn-4's loop has none). The same
    # bits. Default from default_elect_release (measured)
    elect_release: bool = False
    # the same releases by elect.sync's winner taken once per tile (a predicate held through the loop), and the K
    # release after the step's softmax, predicated on one of its exponentials too (common_sm90.true_after): with a
    # winner ready from the tile's start ptxas hoists that release, and the PV wait after it, before the step's
    # first exp2; this keeps both among the exponentials, where the lane-0 form's late S2R put them. The same bits.
    # Default from default_late_k_release (measured); where both are on, this one decides
    late_k_release: bool = False

    def build(self):
        from .fwd_sm90 import FlashFwdSm90

        return FlashFwdSm90(
            host.cutlass_dtype(self.dtype), self.head_dim, causal=self.causal, varlen=self.varlen,
            accumulate=self.accumulate, seg_offsets=self.seg_offsets, tile_m=self.tile_m, tile_n=self.tile_n,
            num_stages=self.num_stages, intra_wg_overlap=self.intra_wg_overlap, sched_barrier=self.sched_barrier,
            rescale_threshold=self.rescale_threshold, sum_from_old=self.sum_from_old, late_pv_wait=self.late_pv_wait,
            chained_max=self.chained_max,
            hoist_descriptors=self.hoist_descriptors, hoist_q_slices=self.hoist_q_slices,
            tma_store_o=self.tma_store_o, sanitize=self.sanitize, defer_v_marks=self.defer_v_marks,
            window_left=self.window_left, softcap=self.softcap,
            sinks=self.sinks, softcap_fixed_max=self.softcap_fixed_max, worklist=self.worklist,
            prefetch_running=self.prefetch_running, persistent_ctas=self.persistent_ctas if self.persistent else 0,
            dynamic_tiles=self.takes_tile_counter, reset_counter=self.reset_counter,
            exact_merge=self.exact_merge, regs_producer=self.regs_producer,
            ctas_per_sm=self.ctas_per_sm,
            l2_rows=self.l2_rows or None, interleave_lengths=self.interleave_lengths, split_tail=self.split_tail,
            pdl=self.pdl, elect_release=self.elect_release, late_k_release=self.late_k_release,
        )

    @property
    def persistent(self) -> bool:
        """Whether the kernel runs on a persistent grid: packed launches only with dynamic_tiles (their producer
        warp needs more than its 24 registers for the static walk, which setmaxnreg cannot give it, 24 + 2 x 240
        being the CTA's whole allocation; the dynamic walk fits)."""
        return self.persistent_ctas > 0 and (not self.varlen or self.dynamic_tiles)

    @property
    def takes_tile_counter(self) -> bool:
        """Whether the launch passes a zeroed (1,) int32 tile counter (a dynamic persistent grid)."""
        return self.dynamic_tiles and self.persistent

    def fake_args(self):
        """Fake tensors describing every runtime argument of the variant (no GPU needed)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        dt = host.cutlass_dtype(self.dtype)
        out_fp32 = self.accumulate or self.out_fp32
        out_dt, out_div = (cutlass.Float32, 4) if out_fp32 else (dt, 8)
        qs, ks, ls = host.qkv_shapes(self.varlen, self.head_dim)
        q, k, v = host.fake_tensor(dt, qs, 8), host.fake_tensor(dt, ks, 8), host.fake_tensor(dt, ks, 8)
        o = host.fake_tensor(out_dt, qs, out_div)
        lse = host.fake_tensor(cutlass.Float32, ls, 1)
        cu_q = cu_k = off_q = off_k = None
        if self.worklist:
            cu_q = host.fake_i32()  # the item table
        elif self.varlen:
            nb1 = cute.sym_int()
            cu_q = make_fake_tensor(cutlass.Int32, (nb1,), stride=(1,), assumed_align=4)
            cu_k = make_fake_tensor(cutlass.Int32, (nb1,), stride=(1,), assumed_align=4)
        if self.seg_offsets:
            nb = cute.sym_int()
            off_q, off_k = host.fake_i32(nb), host.fake_i32(nb)
        sinks = None
        if self.sinks:
            sinks = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        counter = host.fake_i32(1) if self.takes_tile_counter else None
        split = {}
        if self.split_tail:  # the parts' fp32 (out, lse) scratch, the first split tile and the parts per tile
            counter = host.fake_i32()  # (and one arrival counter per split tile after the tile counter)
            split = dict(split_o=host.fake_tensor(cutlass.Float32, (cute.sym_int(), self.head_dim), 4),
                         split_lse=host.fake_flat(cutlass.Float32), split_edge=cutlass.Int32(0),
                         split_parts=cutlass.Int32(1))
        args = FwdKernelArgs(q=q, k=k, v=v, out=o, lse=lse, scale_log2=cutlass.Float32(1.0), diag=cutlass.Int32(0),
                             max_seqlen_q=cutlass.Int32(1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seg_off_q=off_q,
                             seg_off_k=off_k, sinks=sinks, tile_counter=counter, **split)
        return (*args, host.fake_stream())


# hdim 64 causal plain launches of at most this many query rows (dense) or rows a document (packed) take short tiles
# (short_queries, short_documents)
SHORT_CAUSAL_ROWS = 1024


def short_queries(head_dim: int, causal: bool, dense_plain: bool, seqlen_q: int) -> bool:
    """Whether a launch takes the short-sequence tiles of default_tiles: hdim 64, causal, a dense launch writing a
    16-bit out (the family measured; merge and fp32 launches keep the usual tiles, packed ones: short_documents),
    at most SHORT_CAUSAL_ROWS query rows. 128-row tiles measured 1.13 / 1.10 / 1.00 / 0.95 / 0.96x the 192-row ones at
    512 / 1024 / 1280 / 2048 / 2560 rows causal (H200, 2026-12-01, ninth session): a 192-row tile on the diagonal
    computes more masked scores, which a short causal sequence is mostly made of. Non-causal, 192 rows measured
    never slower (1.00-1.12x)."""
    return head_dim <= 64 and causal and dense_plain and seqlen_q <= SHORT_CAUSAL_ROWS


def default_tiles(head_dim: int, causal: bool, short: bool = False) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_stages) for a head dim (``short``: see short_queries; short_two_ctas may then halve
    the rows)."""
    if head_dim <= 64 and not short:
        return 192, 128, 2
    if head_dim > 128:
        # hdim 256 (Gemma 2 / 3): Q 64 KB and two stages of 64-key K / V tiles (32 KB each) fill the shared memory;
        # 128 x 128 K / V tiles would need 256 KB for two stages
        return 128, 64, 2
    return 128, 128, 2


def short_two_ctas(head_dim: int, short: bool, window_left: int, softcap: float, sinks: bool) -> bool:
    """Whether a short_queries launch takes 64-row tiles with two CTAs resident per SM (FwdConfig.ctas_per_sm):
    two independent tiles per SM, each with its own K / V stream, the shape of cuDNN's short causal forward. hdim
    64 without window, soft-cap or sinks (the family measured). Measured on the H200 against the 128-row tiles in
    the same rounds (2026-12-03, twenty-seventh session, bench/sessions/gpu_session_28.sh 4 and 5; 264 CTAs on
    the persistent grid): +5.5% at 512, +5.7 / +4.8% at 1024, -4.8% at 1536, -6% at 2048 rows (so only
    short_queries' launches); one 64-row tile per SM lost 20-25%."""
    return head_dim <= 64 and short and window_left < 0 and not softcap and not sinks


def short_documents(head_dim: int, causal: bool, packed_plain: bool, max_seqlen_q: int, window_left: int,
                    softcap: float, sinks: bool) -> bool:
    """Whether a packed launch writing a 16-bit out takes short_two_ctas' tiles (two 64-row CTAs per SM): hdim 64,
    causal, documents of at most SHORT_CAUSAL_ROWS query rows (``max_seqlen_q``), without window, soft-cap or sinks
    (the family measured; such packed launches keep the 192-row tiles otherwise). Measured on the H200 against the
    192-row tiles in the same rounds (2026-12-03, twenty-eighth session, bench/sessions/gpu_session_29.sh 3 and 5,
    bench/packed_tiles.py over 65536 tokens, device time): +54 / +12.5 / +14% at 256 / 512 / 1024-token documents,
    equal at 2048 with 192-row tiles (the two-CTA tiles there -13%, so only short documents); +5.8% over 122
    documents of 124-1017 tokens (host-inclusive timing, a lower bound); 128-row tiles lost 5-7%."""
    return (packed_plain and short_queries(head_dim, causal, True, max_seqlen_q)
            and short_two_ctas(head_dim, True, window_left, softcap, sinks))


# two-CTA short launches of at most this many query rows (a document's, packed) take 64-key tiles in three stages
TINY_CAUSAL_ROWS = 512


def tiny_tiles(short_two: bool, rows: int) -> bool:
    """Whether a launch on short_two_ctas' 64-row tiles also takes 64-key tiles with three K / V stages (the same
    shared memory as two 128-key stages): at most TINY_CAUSAL_ROWS query rows (dense) or rows a document (packed,
    max_seqlen_q). A short causal diagonal wastes less on 64-key tiles. Measured on the H200 against 128-key tiles
    (2026-12-03, twenty-eighth session, bench/sessions/gpu_session_29.sh 1, 4 and 5; device time): dense +30 / +8%
    at 256 rows (two runs), +4 / +5 / +4% at 512, -2% at 1024, 0% at 768; packed documents +5% at 256 tokens,
    +1.5% at 512, -3% at 1024."""
    return short_two and rows <= TINY_CAUSAL_ROWS


def default_sum_from_old(head_dim: int) -> bool:
    """True for hdim <= 64 (3 consumer warpgroups, where the MUFU queue binds). H200, 2026-12-02, fourteenth session,
    against the previous kernels in the same rounds: hdim 64 +2.5 / +3 / 0% non-causal and +3 / +3 / +1.5% causal
    at 1k / 4k / 16k (an earlier run: causal +4 / +5% at 4k / 16k); hdim 128 lost 2-5% at 4k-16k (its tensor pipe
    binds, and the FMULs then delay its P). A function of the head dim only, so that every
    variant of one head dim (persistent or not, work list or per-item, merge or plain) sums in one order."""
    return head_dim <= 64


def default_late_pv_wait(head_dim: int, causal: bool) -> bool:
    """Off only for hdim <= 64 causal. H200, 2026-12-02, fifteenth session (bench/sessions/gpu_session_15.sh 1 and
    a 5-round rerun, in the same rounds as the kernels without it): hdim 128 +1 / +1 / +2.5 / +1 / +1% non-causal
    and +2 / +1.5 / +3 / 0 / +2% causal at 2k / 4k / 8k / 16k / 32k (the first run: +6% non-causal at 16k); hdim 64
    non-causal +1 / 0 / 0.5 / 1.5 / 2%, hdim 64 causal 0 to -0.6% (its PV wait already sat among the exponentials
    with sum_from_old). The bits do not depend on it (test_schedule_fields_give_the_same_bits)."""
    return not (head_dim <= 64 and causal)


def default_elect_release(head_dim: int, causal: bool) -> bool:
    """On for hdim <= 64 causal. H100, 2026-12-07, sixty-seventh session (bench/RESULTS.md; two runs, 5 and 7 rounds,
    beside the default in the same rounds): hdim 64 causal +1.1 / +2.0% and +0.9 / +1.2 / +1.0% at 16k / 32k and
    8k / 16k / 32k (at 1k / 4k / 16k: 0 / +0.6 / +1.1%); hdim 64 non-causal -0.4 to -1.0% in both; hdim 128 -1.1
    to +0.1%. The bits do not depend on it (test_schedule_fields_give_the_same_bits)."""
    return head_dim <= 64 and causal


def default_late_k_release(head_dim: int, causal: bool) -> bool:
    """On for hdim <= 64 non-causal. H100, 2026-12-08, sixty-ninth session (bench/RESULTS.md; two runs, 5 and 7
    rounds, beside the default in the same rounds): hdim 64 non-causal +1.3 / +1.8 / +1.7% at 1k / 4k / 16k and
    +1.2 / +1.6 / +1.8 / +1.6 / +1.1% at 1k / 4k / 8k / 16k / 32k; hdim 64 causal +0.4 / -4.5 / -4.9% at 1k / 4k /
    16k against its elect_release default (the PV wait it moves back among the exponentials was better before them
    there); hdim 128 -0.4 to +0.7% (off: no gain to measure). The bits do not depend on it
    (test_schedule_fields_give_the_same_bits; the whole forward GPU suite passed with it forced on)."""
    return head_dim <= 64 and not causal


# hdim 96's causal kernel spills 16 bytes on the persistent grid with the default 24 / 240 register split (ptxas,
# every dtype and option); with 32 / 232 (default_regs_producer) it does not
PERSISTENT_CAUSAL_HEAD_DIMS = (64, 96, 128)


def default_regs_producer(cfg: FwdConfig) -> int:
    """32 for hdim 96's causal kernel on the persistent grid: spill-free there (24 / 240 spills 16 bytes), and
    measured on the H200 (2026-12-01, eleventh session, bench/sessions/gpu_session_persistent_bwd.sh 3) 1.16x / 1.03x /
    0.99x the one-CTA-per-tile kernel at 1k / 4k / 16k (1.06x / 1.00x / 0.92x flash-attn-4). 32 too for causal
    hdim-128 kernels on key tiles wider than 128 (wide_tiles_launch): the unsplit persistent kernel spills 4 bytes
    on the default split and none on 32 (ptxas, 160- and 176-key tiles). Else 0 (the split of the warpgroup
    count)."""
    wide_causal = cfg.head_dim == 128 and cfg.tile_n > 128
    return 32 if cfg.persistent and cfg.causal and (cfg.head_dim == 96 or wide_causal) else 0


def default_defer_v_marks(cfg: FwdConfig) -> bool:
    """defer_v_marks for kernels of one or two consumer warpgroups. Measured on an H100 (forty-fifth session, two
    calls, device time): causal 1k +1% / +2% (hdim 64's two 64-row CTAs per SM / hdim 128), packed 512 / 1024-token
    documents at hdim 64 +2% / +1.6%, hdim 128 at 4k / 16k +0.7% / +0.2%. Three consumer warpgroups (hdim <= 64's
    192-row tiles, 160 registers a thread) lost 1.2% at 4k and 16k in both calls, and spill 24-84 bytes with
    softcap (ptxas): they keep the mark right after the softmax."""
    return cfg.tile_m // 64 < 3


def default_persistent_ctas(cfg: FwdConfig) -> int:
    """For a variant's other fields: the SM count for launches that write a 16-bit out, dense or packed, causal or
    not, on the dynamic walk. Measured on the H200 (2026-12-01, ninth session): dense 1.01-1.15x the one-CTA-per-
    tile kernel causal and 1.0-1.12x non-causal (hdim 64 and 128, 512-16k); packed causal documents 1.11-1.25x at
    hdim 64 (512-2048-token documents) and 1.03-1.08x at hdim 128. Else 0 (one CTA per tile): merges measured no
    faster persistent in a single launch (0.98-1.03x at 4k-16k; +1-3% in the ring simulation, within its noise),
    and the work lists promise the bits of their per-item calls, which merge or write fp32; and three variant
    families spill there (ptxas): causal hdim 96 unless its producer takes 32 registers (default_regs_producer),
    the non-overlapped consumer
    (intra_wg_overlap False, a measurement knob), and packed windows (fp16 hdim 64 with softcap and sinks spills 8
    bytes; the producer's claim hand-off in both). hdim 256 has no room for the persistent grid's own O staging
    tile beside Q and its K / V stages (its O goes through Q's buffer), and its causal grid is not measured."""
    if cfg.accumulate or cfg.out_fp32 or not cfg.intra_wg_overlap or (cfg.varlen and cfg.window_left >= 0):
        return 0
    if cfg.causal and cfg.head_dim not in PERSISTENT_CAUSAL_HEAD_DIMS:
        return 0
    if cfg.head_dim > 128 and cfg.tma_store_o:  # (the persistent grid's own O staging tile does not fit at hdim 256)
        return 0
    return host.sm_count() * cfg.ctas_per_sm


# dense causal plain launches of at most this many query rows alternate long and short tiles (interleaved_launch)
INTERLEAVE_MAX_ROWS = 2048


def interleaved_launch(head_dim: int, causal: bool, dense_plain: bool, seqlen_q: int, window_left: int = -1) -> bool:
    """Whether a launch alternates long and short causal tiles (FwdConfig.interleave_lengths): dense causal launches
    writing a 16-bit out, no window, at most INTERLEAVE_MAX_ROWS query rows, not on short_queries' tiles. Measured
    on the H200 against longest first in the same rounds (2026-12-02, seventeenth session,
    bench/sessions/gpu_session_17.sh 1 and 2): hdim 128 +8 / +10% at 1k, +3% at 2k; hdim 64 +6% at 2k, -1.2 / -0.6%
    at 1k (its 128-row short tiles: left out); at 4k -2% / +1%, at 16k -6% / -2.4% (hdim 128 / 64). Packed causal
    documents of 512-2048 tokens lost 4-7%, and the 4k causal merge (the lead it was built for: +15.7% over a plain
    forward against +12.9%) lost too, so those keep longest first."""
    return (causal and dense_plain and window_left < 0 and seqlen_q <= INTERLEAVE_MAX_ROWS
            and not short_queries(head_dim, causal, dense_plain, seqlen_q))


def _long_plain_hdim128(head_dim: int, dense_plain: bool, seqlen_k: int, min_keys: int, window_left: int,
                        softcap: float, sinks: bool) -> bool:
    """The family the long-sequence schedule rules below were measured on: dense hdim-128 launches writing a 16-bit
    out, of at least ``min_keys`` keys, without a window, soft-cap or sinks."""
    return (head_dim == 128 and dense_plain and seqlen_k >= min_keys and window_left < 0 and not softcap
            and not sinks)


# dense non-causal hdim-128 launches of at least this many keys take the row max in chains (chained_max_launch)
CHAINED_MAX_MIN_KEYS = 8192


def chained_max_launch(head_dim: int, causal: bool, dense_plain: bool, seqlen_k: int, window_left: int = -1,
                       softcap: float = 0.0, sinks: bool = False) -> bool:
    """Whether a launch takes the row max in flash-attn-4's chained form (FwdConfig.chained_max): dense non-causal
    hdim-128 launches writing a 16-bit out, of at least CHAINED_MAX_MIN_KEYS keys, without a window, soft-cap or
    sinks. Measured on the H200 against the tree in the same rounds (2026-12-02, eighteenth session,
    bench/sessions/gpu_session_18.sh 1, 4, 5): hdim 128 non-causal +1.1 / +2.2 / +2.3% at 16k and +1.6 / +1.9 /
    +1.2% at 32k, +0.9% at 8k, -0.2 / -0.2% at 4k, -0.9% at 1k; causal hdim 128 -1.4 / +0.7% at 4k, -0.5 / 0% at
    16k, -0.6 / -1.6% at 32k; hdim 64 within +-1.5% either way. The row max is exact in both forms, so the bits
    are the same (test_schedule_fields_give_the_same_bits)."""
    return not causal and _long_plain_hdim128(head_dim, dense_plain, seqlen_k, CHAINED_MAX_MIN_KEYS, window_left,
                                              softcap, sinks)


# dense hdim-128 launches of at least this many keys take key tiles wider than 128 (wide_tiles_launch)
WIDE_TILES_MIN_KEYS = 16384


def wide_tiles_launch(head_dim: int, causal: bool, dense_plain: bool, seqlen_k: int, window_left: int = -1,
                      softcap: float = 0.0, sinks: bool = False) -> bool:
    """Whether a launch takes key tiles wider than 128 (their fields: wide_tile_fields): dense hdim-128 launches
    writing a 16-bit out, of at least WIDE_TILES_MIN_KEYS keys, without a window, soft-cap or sinks (the family
    measured). Fewer, longer steps: 463 / 434 / 419 main-loop instructions per 128 keys on 128 / 160 / 176-key
    tiles (bench/sass_softmax.py --ops). Measured on one H100 against the 128-key tiles in the same rounds:
    - non-causal, 176 keys (2026-12-06, fifty-seventh session, gpu_session_57.sh fwd_grid, fwd176 and wide_ab;
      fifty-eighth, gpu_session_58.sh wide): +0.9 / +0.9 / +1.1 / +0.9% at 16k, +1.7 / +1.3 / +1.8% at 32k,
      +0.4 / 0% at 8k, -2.2% at 4k; 160 keys read the same at 16k and less at 32k;
    - causal, 160 keys (fifty-eighth session, gpu_session_58.sh wide twice and causal160): +1.1 / +1.2 / +1.7% at
      16k, +1.9 / +1.9 / +2.2% at 32k, 0 / 0 / 0% at 8k; 176 keys lost 1.3-1.8% at 8k, and 192 keys trailed the
      best tile at every length, causal or not.
    Against the fp64 oracle the 128- and 176-key tiles read the same error (bench/fwd_error.py: 16k and 32k, within
    0.2%): another tiling changes the bits (the sums' order), not their accuracy. On the H200 the sixteenth
    session's kernel measured -3 to +0.5% non-causal on 176-key tiles; the H200 table checks it again."""
    return _long_plain_hdim128(head_dim, dense_plain, seqlen_k, WIDE_TILES_MIN_KEYS, window_left, softcap, sinks)


def wide_tile_fields(causal: bool) -> dict:
    """The FwdConfig fields of a wide_tiles_launch: FA3's 176-key tiles non-causal, with O stored directly (its
    staging tile does not fit beside two 176-key K / V stages); 160-key tiles causal, O staged as on 128-key tiles
    (176 lost at 8k causal; default_regs_producer gives the causal kernel 32 producer registers)."""
    return dict(tile_n=160) if causal else dict(tile_n=176, tma_store_o=False)


def split_tail_fits(cfg: FwdConfig) -> bool:
    """Whether a variant can split the tiles of a few-wave launch's tail (FwdConfig.split_tail): dense, causal or
    not, writing a fresh 16-bit out on the dynamic persistent grid, one CTA per SM, no window (a part's rows then
    see a prefix of its keys) or sinks (a sink joins a row once, in the merge; not built), hdim <= 128 (hdim 256
    runs one CTA per tile)."""
    return (cfg.persistent and cfg.takes_tile_counter and not cfg.varlen and not cfg.accumulate
            and not cfg.out_fp32 and not cfg.worklist and not cfg.sinks and cfg.window_left < 0
            and cfg.ctas_per_sm == 1 and cfg.intra_wg_overlap and cfg.head_dim <= 128)


def default_split_tail(cfg: FwdConfig) -> bool:
    """Every variant that can (split_tail_fits); the launch's split_plan decides whether a call splits."""
    return split_tail_fits(cfg)


_FIELDS = {
    "tile_m": host.parse_positive, "tile_n": host.parse_positive, "num_stages": host.parse_positive,
    "intra_wg_overlap": host.parse_bool,
    "sched_barrier": host.parse_bool, "rescale_threshold": host.parse_threshold, "sum_from_old": host.parse_bool,
    "chained_max": host.parse_bool,
    "late_pv_wait": host.parse_bool, "hoist_descriptors": host.parse_bool,
    "hoist_q_slices": host.parse_bool, "tma_store_o": host.parse_bool,
    "sanitize": host.parse_bool,
    "defer_v_marks": host.parse_bool,
    "softcap_fixed_max": host.parse_bool, "prefetch_running": host.parse_bool,
    "persistent_ctas": host.parse_count, "dynamic_tiles": host.parse_bool, "exact_merge": host.parse_bool,
    "reset_counter": host.parse_bool,
    "regs_producer": host.parse_count, "ctas_per_sm": host.parse_positive,
    "l2_rows": host.parse_count, "interleave_lengths": host.parse_bool, "split_tail": host.parse_bool,
    "elect_release": host.parse_bool, "late_k_release": host.parse_bool,
}
# the fields a work-list launch must share with the per-item calls it replaces to give their bits (all but these)
_LAUNCH_SHAPE_FIELDS = ("varlen", "seg_offsets", "worklist", "tma_store_o", "persistent_ctas", "dynamic_tiles")
# fields that move instructions or tiles, not results (each one's bits test compares the bytes both ways)
_SCHEDULE_FIELDS = ("late_pv_wait", "hoist_descriptors", "hoist_q_slices", "interleave_lengths", "chained_max",
                    "defer_v_marks", "reset_counter", "elect_release", "late_k_release")
# development hook: FA4DIST_FWD_OVERRIDE="rescale_threshold=0,tile_m=128" (tests and benches run a variant)
_OVERRIDE: dict = host.env_overrides("FA4DIST_FWD_OVERRIDE", _FIELDS)


def parse_overrides(text: str) -> dict:
    """``"tile_m=128,persistent_ctas=0"`` -> FwdConfig field overrides, typed (benches' variant rows)."""
    return host.parse_overrides(text, _FIELDS, "forward overrides")


def set_override(**kw) -> None:
    """Development hook: force fields of FwdConfig (tile_m=..., intra_wg_overlap=..., ...)."""
    _OVERRIDE.clear()
    _OVERRIDE.update(kw)
    _FAST.clear()


def make_config(dtype, head_dim, *, causal, varlen, accumulate, seg_offsets=False, out_fp32=False,
                window_left=-1, softcap=0.0, sinks=False, worklist=False, short=False, tiny=False, interleave=False,
                chained=False, wide=False, **overrides) -> FwdConfig:
    """The FwdConfig of a call: the defaults for its fields, then FA4DIST_FWD_OVERRIDE, then ``overrides``.
    ``short`` / ``tiny`` / ``interleave`` / ``chained`` / ``wide``: the launch-size choices the caller made
    (short_queries or short_documents, tiny_tiles, interleaved_launch, chained_max_launch, wide_tiles_launch)."""
    tm, tn, st = default_tiles(head_dim, causal, short)
    kw = dict(
        dtype=host.dtype_name(dtype), head_dim=head_dim, causal=bool(causal), varlen=bool(varlen),
        accumulate=bool(accumulate), seg_offsets=bool(seg_offsets) and bool(causal),
        out_fp32=bool(out_fp32) and not accumulate, tile_m=tm, tile_n=tn, num_stages=st,
        sum_from_old=default_sum_from_old(head_dim), late_pv_wait=default_late_pv_wait(head_dim, causal),
        elect_release=default_elect_release(head_dim, causal),
        late_k_release=default_late_k_release(head_dim, causal), window_left=int(window_left),
        softcap=float(softcap or 0.0), sinks=bool(sinks), worklist=bool(worklist),
    )
    forced = {**_OVERRIDE, **overrides}
    if short_two_ctas(head_dim, short, int(window_left), float(softcap or 0.0), bool(sinks)) \
            and "tile_m" not in forced and "ctas_per_sm" not in forced:  # (a forced tile keeps one CTA per SM)
        kw.update(tile_m=64, ctas_per_sm=2)
        if tiny and "tile_n" not in forced and "num_stages" not in forced:
            kw.update(tile_n=64, num_stages=3)
    if wide and "tile_n" not in forced and "tma_store_o" not in forced:
        kw.update(wide_tile_fields(bool(causal)))
    kw.update(forced)
    cfg = FwdConfig(**kw)
    if "persistent_ctas" not in kw:  # the default follows the other fields, overrides included (pdl: none)
        cfg = dataclasses.replace(cfg, persistent_ctas=0 if cfg.pdl else default_persistent_ctas(cfg))
    if "regs_producer" not in kw:
        cfg = dataclasses.replace(cfg, regs_producer=default_regs_producer(cfg))
    if "interleave_lengths" not in kw:
        cfg = dataclasses.replace(cfg, interleave_lengths=bool(interleave))
    if "defer_v_marks" not in kw:
        cfg = dataclasses.replace(cfg, defer_v_marks=default_defer_v_marks(cfg))
    if "chained_max" not in kw:
        cfg = dataclasses.replace(cfg, chained_max=bool(chained))
    if cfg.hoist_q_slices and not cfg.hoist_descriptors:  # (the slices are hoisted with the bases only)
        cfg = dataclasses.replace(cfg, hoist_q_slices=False)
    if cfg.interleave_lengths and not cfg.causal:  # tiles of one length: the same kernel, one cache entry
        cfg = dataclasses.replace(cfg, interleave_lengths=False)
    if "split_tail" not in kw:
        cfg = dataclasses.replace(cfg, split_tail=default_split_tail(cfg))
    elif cfg.split_tail and not split_tail_fits(cfg):
        raise ValueError(f"split_tail (forced by FA4DIST_FWD_OVERRIDE or a variant's overrides) needs a dense fresh "
                         f"16-bit launch on the dynamic persistent grid, one CTA per SM, without window or sinks: "
                         f"{cfg}")
    if cfg.pdl and cfg.persistent:
        raise ValueError(f"pdl needs one CTA per tile (a persistent grid's tile counter would be shared with the "
                         f"launch it overlaps): {cfg}")
    return cfg


# ----------------------------------------------------------------------------
# availability / support
# ----------------------------------------------------------------------------

_AVAILABLE = None


def is_available() -> bool:
    """cutlass-dsl (+ tvm-ffi) importable and the current CUDA device is an sm_90 GPU."""
    global _AVAILABLE
    if _AVAILABLE is None:
        ok = torch.cuda.is_available()
        if ok:
            major, _ = torch.cuda.get_device_capability()
            ok = major == 9
        _AVAILABLE = bool(ok and host.cutlass_importable())
    return _AVAILABLE


def supports(q, k, v, causal=False, *, cu_seqlens_q=None, cu_seqlens_k=None, accumulate=False, out=None, lse=None):
    """(ok, reason). Checks what the kernel itself can take; the caller validated the contract."""
    ok, reason = host.check_qkv(q, k, v, SUPPORTED_HEAD_DIMS, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if not ok:
        return ok, reason
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not host.aligned(t, 8):
            return False, f"{name} needs a contiguous last dim, 16-byte aligned base and strides"
    if out is not None:
        if out.dtype != torch.float32 and (accumulate or out.dtype != q.dtype):
            return False, "out must be fp32 (or q's dtype when not accumulating)"
        if not host.aligned(out):
            return False, "out needs a contiguous last dim, 16-byte aligned base and strides"
    if lse is not None and (lse.dtype != torch.float32 or lse.stride(-1) != 1):
        return False, "lse must be fp32 with a contiguous last dim"
    return True, ""


def cache_info() -> list:
    return host.cache_info(FwdConfig)


# ----------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------

_FAST: dict = {}  # (dtype, d, causal, varlen, accumulate, seg_offsets, out_fp32, window_left, softcap, sinks,
#                   short) -> (fn, takes_counter)


def forward(
    q,
    k,
    v,
    out,
    lse,
    *,
    softmax_scale=None,
    causal=False,
    q_offset=0,
    k_offset=0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    accumulate=False,
    window_left=-1,
    softcap=None,
    sinks=None,
    **overrides,
):
    """Run the Hopper forward into `out` / `lse` (in place). Inputs are assumed validated.

    Dense: q (b, s_q, h, d), k/v (b, s_k, h_kv, d), out like q, lse (b, h, s_q) fp32.
    Varlen: q (t_q, h, d), k/v (t_k, h_kv, d), cu_seqlens_* int32 (nseg+1,), lse (h, t_q).
    out: q's dtype or fp32; with accumulate=True it must be fp32 and out / lse hold a running result into
    which this block is merged (in place).
    q_offset / k_offset: ints, or per sequence / segment (list, tuple or int32 tensor of shape (nseg,)).
    window_left >= 0 (causal only): key j is also masked for query i when j < i + q_offset - k_offset -
    window_left, and the blocks below the window are never loaded.
    softcap > 0: scores become softcap * tanh(softmax_scale * q.k / softcap) before the mask and the softmax.
    sinks: None, or a (heads_q,) fp32 CUDA tensor of logits, one per query head, that join each row's softmax
    denominator (not with accumulate=True: a row takes its sink once, after its last block).
    max_seqlen_q: varlen only, the longest q segment; if None the grid is sized by total_q (correct, no host
    sync, but launches idle CTAs).  max_seqlen_k is unused.
    Non-finite values: a masked (query, key) pair contributes nothing whatever k / v hold there; a row that sees
    a non-finite key or value gets NaN; lse is -inf only for rows that see no key at all (NaN when the softmax
    of a row that sees keys is undefined).
    """
    varlen = cu_seqlens_q is not None
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    window_left = host.check_window_left(window_left, causal)
    nseq = (cu_seqlens_q.shape[0] - 1) if varlen else q.shape[0]
    per_seq = not (host.is_uniform_offset(q_offset) and host.is_uniform_offset(k_offset))
    diag = 0
    off_q = off_k = None
    if causal:
        if per_seq:
            off_q = host.segment_offsets(q_offset, nseq, q.device)
            off_k = host.segment_offsets(k_offset, nseq, q.device)
        else:
            diag = int(q_offset) - int(k_offset)
            if abs(diag) > host.INT32_MAX // 2:
                raise ValueError("q_offset - k_offset out of int32 range")
    seg_offsets = causal and per_seq
    out_fp32 = out.dtype == torch.float32
    if accumulate and not out_fp32:
        raise ValueError("accumulate=True needs an fp32 out")
    if sinks is not None:
        if accumulate:
            raise ValueError("sinks join a row once: merge them after the last accumulate call (kernels/merge.py)")
        if sinks.dtype != torch.float32 or sinks.shape != (q.shape[-2],) or sinks.stride(0) != 1:
            raise ValueError(f"sinks must be a contiguous fp32 tensor of shape ({q.shape[-2]},), got "
                             f"{sinks.dtype} {tuple(sinks.shape)}")
    # degenerate sizes: nothing to launch, or no keys at all (TMA descriptors need non-empty tensors)
    total_q = q.shape[0] * (1 if varlen else q.shape[1])
    if total_q == 0 or nseq == 0:
        return out, lse
    if k.shape[0] == 0 or (not varlen and k.shape[1] == 0):
        if not accumulate:
            out.zero_()
            if sinks is None:
                lse.fill_(-math.inf)
            else:  # no key: the sink alone
                lse.copy_(sinks.view(-1, 1) if varlen else sinks.view(1, -1, 1))
        return out, lse
    softcap = host.check_softcap(softcap)
    has_sinks = sinks is not None
    dense_plain = not (varlen or out_fp32)  # (out_fp32 covers accumulate)
    rows = int(q.shape[0] if max_seqlen_q is None else max_seqlen_q) if varlen else q.shape[1]
    short = short_queries(d, causal, dense_plain, 0 if varlen else rows) or short_documents(
        d, causal, varlen and not out_fp32, rows, window_left, softcap, has_sinks)
    tiny = tiny_tiles(short_two_ctas(d, short, window_left, softcap, has_sinks), rows)
    interleave = interleaved_launch(d, causal, dense_plain, 0 if varlen else q.shape[1], window_left)
    chained = chained_max_launch(d, causal, dense_plain, 0 if varlen else k.shape[1], window_left, softcap, has_sinks)
    wide = wide_tiles_launch(d, causal, dense_plain, 0 if varlen else k.shape[1], window_left, softcap, has_sinks)
    fast_key = (q.dtype, d, causal, varlen, accumulate, seg_offsets, out_fp32, window_left, softcap, has_sinks, short,
                tiny, interleave, chained, wide)
    fast = _FAST.get(fast_key) if not overrides and not _OVERRIDE else None
    if fast is None:
        cfg = make_config(q.dtype, d, causal=causal, varlen=varlen, accumulate=accumulate,
                          seg_offsets=seg_offsets, out_fp32=out_fp32, window_left=window_left, softcap=softcap,
                          sinks=has_sinks, short=short, tiny=tiny, interleave=interleave, chained=chained,
                          wide=wide, **overrides)
        # a split_tail variant splits only the launches its plan splits (few whole waves); every other launch runs
        # the same variant without it, whose kernel is the unsplit one
        plain = dataclasses.replace(cfg, split_tail=False) if cfg.split_tail else cfg
        fast = (host.get_compiled(plain), cfg.takes_tile_counter, cfg.reset_counter, cfg if cfg.split_tail else None)
        if not overrides and not _OVERRIDE:
            _FAST[fast_key] = fast
    fn, takes_counter, reusable_counter, split = fast
    if varlen:
        msq = int(max_seqlen_q) if max_seqlen_q is not None else int(q.shape[0])
        msq = max(msq, 1)
    else:
        msq = 1
    args = FwdKernelArgs(q=q, k=k, v=v, out=out, lse=lse, scale_log2=host.score_scale(softmax_scale, softcap),
                         diag=diag, max_seqlen_q=msq, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         seg_off_q=off_q, seg_off_k=off_k, sinks=sinks)
    plan = dense_split_plan(split, q.shape, k.shape[1], diag) if split is not None else None
    if plan is not None and plan[1] > 1:
        fn = host.get_compiled(split)
        args = args._replace(**_split_buffers(split, q, plan))
    else:
        args = args._replace(tile_counter=host.tile_counter(takes_counter, q.device, reusable_counter))
    fn(*args)
    return out, lse


def dense_split_plan(cfg: FwdConfig, q_shape, seqlen_k: int, diag: int = 0) -> tuple[int, int]:
    """(split_edge, parts) of a dense call (q (b, s_q, h, d), ``diag`` = q_offset - k_offset) on ``cfg``'s tiles
    and persistent grid: split_plan's (first split tile, parts) non-causal, causal_split_plan's (split tiles,
    parts) causal; parts = 1: no split."""
    b, sq, h, _ = q_shape
    if cfg.causal:
        return causal_split_plan(b * h, sq, seqlen_k, int(diag), cfg.tile_m, cfg.tile_n, cfg.persistent_ctas)
    return split_plan(b * h * -(-sq // cfg.tile_m), cfg.persistent_ctas, -(-seqlen_k // cfg.tile_n))


def split_tile_count(cfg: FwdConfig, q_shape, plan) -> int:
    """How many tiles a dense call's split plan splits (split_plans.split_tile_count on its tiles)."""
    b, sq, h, _ = q_shape
    return split_plans.split_tile_count(cfg.causal, b * h * -(-sq // cfg.tile_m), plan[0])


def split_rows(cfg: FwdConfig, q_shape, plan) -> torch.Tensor:
    """(b, h, s_q) bool, on the CPU: the query rows of the tiles a dense call's split plan splits. Launch-order tile
    t is query tile t % num_m of (batch, head) t // num_m; causal plans split every (batch, head)'s last
    edge / (b * h) query tiles (its longest), non-causal ones the launch-order tiles from the edge on
    (split_tile_count counts the same tiles)."""
    b, sq, h, _ = q_shape
    num_m = -(-sq // cfg.tile_m)
    edge, parts = plan
    tiles = torch.zeros(b, h, num_m, dtype=torch.bool)
    if parts > 1:
        if cfg.causal:
            tiles[..., num_m - edge // (b * h):] = True
        else:
            tiles.view(-1)[edge:] = True
    return tiles.repeat_interleave(cfg.tile_m, dim=2)[..., :sq]


def _split_buffers(cfg: FwdConfig, q, plan) -> dict:
    """The split_tail kernel's arguments (FwdKernelArgs fields) for a dense call that splits: the tile counter and
    one arrival counter per split tile, zeroed, the parts' fp32 (out, lse) scratch and the plan."""
    d = q.shape[-1]
    edge, parts = plan
    split_tiles = split_tile_count(cfg, q.shape, plan)
    return dict(split_o=torch.empty(split_tiles * parts * cfg.tile_m, d, dtype=torch.float32, device=q.device),
                split_lse=torch.empty(split_tiles * parts * cfg.tile_m, dtype=torch.float32, device=q.device),
                split_edge=edge, split_parts=parts,
                tile_counter=torch.zeros(1 + split_tiles, dtype=torch.int32, device=q.device))


def forward_worklist(q, k, v, out, lse, table, max_q_len, *, softmax_scale, causal, window_left=-1, softcap=None,
                     accumulate, overlap_previous=False):
    """One launch over the items of a work list, writing (or with accumulate=True merging into) out / lse in place.

    Packed q (t_q, h, d), k / v (t_k, h_kv, d), out (t_q, h, d) fp32 (or q's dtype when not accumulating), lse
    (h, t_q). ``table``: int32 CUDA tensor, block_info.WORKLIST_COLUMNS words per item (see there; the forward reads
    the rows and the diagonal); the items' query rows must be pairwise disjoint (a row is written by one CTA).
    ``max_q_len``: the longest item's query rows (sizes the grid). A causal launch reads each
    item's diagonal (an item with a diagonal >= its key rows sees every key); a non-causal one ignores it.
    Each item's rows get the bits of a call of :func:`forward` on that item alone with the same options.
    ``overlap_previous``: the kernel before this launch in the stream wrote none of q, k, v and the table, so the
    launch may start while it finishes (FwdConfig.pdl); out and lse are touched only after it."""
    if table.dtype != torch.int32 or table.dim() != 1 or table.numel() == 0:
        raise ValueError("table must be a non-empty flat int32 tensor")
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    window_left = host.check_window_left(window_left, causal)
    softcap = host.check_softcap(softcap)
    out_fp32 = out.dtype == torch.float32
    if accumulate and not out_fp32:
        raise ValueError("accumulate=True needs an fp32 out")
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError("a work-list launch needs query and key rows")
    pdl = bool(overlap_previous)
    fast_key = ("worklist", q.dtype, d, causal, accumulate, out_fp32, window_left, softcap, pdl)
    fast = _FAST.get(fast_key) if not _OVERRIDE else None
    if fast is None:
        cfg = make_config(q.dtype, d, causal=causal, varlen=True, accumulate=accumulate, out_fp32=out_fp32,
                          window_left=window_left, softcap=softcap, worklist=True, **({"pdl": True} if pdl else {}))
        fast = (host.get_compiled(cfg), cfg.takes_tile_counter, cfg.reset_counter)
        if not _OVERRIDE:
            _FAST[fast_key] = fast
    fn, takes_counter, reusable_counter = fast
    fn(*FwdKernelArgs(q=q, k=k, v=v, out=out, lse=lse, scale_log2=host.score_scale(softmax_scale, softcap), diag=0,
                      max_seqlen_q=max(int(max_q_len), 1), cu_seqlens_q=table,
                      tile_counter=host.tile_counter(takes_counter, q.device, reusable_counter)))
    return out, lse


def same_kernel_math(dtype, head_dim, a: dict, b: dict) -> bool:
    """Whether two calls' variants (make_config keyword sets) differ only in how a launch finds its rows (or in
    where ptxas schedules: _SCHEDULE_FIELDS), so that a row gets the same bits from either (a work list may then
    put such items in one launch)."""
    ca, cb = make_config(dtype, head_dim, **a), make_config(dtype, head_dim, **b)
    skip = set(_LAUNCH_SHAPE_FIELDS) | set(_SCHEDULE_FIELDS) | {"causal"}
    return all(getattr(ca, f) == getattr(cb, f) for f in ca.__dataclass_fields__ if f not in skip)
