"""Python entry point of the Hopper backward: preprocess -> main kernel -> dQ convert.

``supports_backward(q, k, v, dq=, dk=, dv=, accumulate=, ...)`` returns ``(ok, reason)``; ``backward(dout, q, k, v,
out, lse, dq, dk, dv, *, softmax_scale, causal, q_offset=0, k_offset=0, cu_seqlens_q=None, cu_seqlens_k=None,
max_seqlen_q=None, max_seqlen_k=None, deterministic=False, accumulate=False)``.

Writes dq/dk/dv in place: fresh buffers (q dtype or fp32) are overwritten; with accumulate=True the block's
gradients are added to fp32 buffers (never rounded in between). Compile cache, AOT objects, fake arguments and
offsets come from host.py, shared with the forward. Everything that touches cutlass is imported lazily, so
`import fa4dist` works without it. Steady-state calls do no host synchronisation (pass max_seqlen_q /
max_seqlen_k for packed input, otherwise the grids are sized by the token counts; each at least the longest
segment: a smaller value leaves rows or keys past it without gradients. The kernel contract passes the exact
values, from its checked cu_seqlens).
``FA4DIST_BWD_OVERRIDE="stmatrix_ds=0,det_chunk=8"`` (development hook, read at import) forces BwdConfig fields
for every call; a bad field or value raises naming it (host.py lists the environment variables).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Optional

import torch

from . import host
from .split_plans import split_keys_plan, split_plan, split_tile_count

BWD_HEAD_DIMS = (64, 96, 128)
TILE_N = 128


class BwdKernelArgs(NamedTuple):
    """The main kernel's runtime arguments by name, in the order of ``bwd_sm90.FlashBwdSm90.__call__`` (before the
    stream): every launch and the compile's fake arguments build one instead of counting 24 positions."""

    q: Any
    k: Any
    v: Any
    dout: Any  # in q's dtype
    lse2: Any  # flat fp32, (chunk, h) blocks of tile_m: lse in log2 units (the preprocess writes it)
    dpsum: Any  # same indexing: rowsum(dO * O) * scale
    clean: Any  # flat int32 (chunk, h): the preprocess's clean query tiles, or None (clean_tiles off)
    dq_acc: Any  # the dQ scratch: flat fp32, or int64 (dq_fixed), (chunk, h) blocks of tile_m * d
    dk: Any
    dv: Any
    sem: Any  # flat int32 (chunk, h): the dQ tickets (deterministic), or None
    dq_scale: Any  # flat fp32 like lse2: the rows' fixed-point scales (dq_fixed), or None
    scale: Any  # softmax scale
    scale_log2: Any  # the scores' scale in log2 units (host.score_scale)
    diag: Any  # q_offset - k_offset (per-segment offsets in seg_off_q / seg_off_k)
    max_seqlen_k: Any  # packed: the longest key segment (sizes the grid); dense: the key length
    cu_seqlens_q: Any = None  # packed; a work list: its item table
    cu_seqlens_k: Any = None
    seg_off_q: Any = None
    seg_off_k: Any = None
    tile_counter: Any = None  # persistent grid: (1,) int32, zero at launch (split_keys: 1 + split key tiles)
    split_dkv: Any = None  # split_keys: the parts' fp32 dK / dV scratch
    split_edge: Any = None  # split_keys: how many key tiles (the first) are split
    split_parts: Any = None  # split_keys: parts per split key tile


def dq_scratch_elements(total_q: int, num_seqs: int, heads_q: int, head_dim: int) -> int:
    """fp32 elements of the dQ accumulation scratch (query tiles of every sequence and head), 32-bit indexed."""
    tm = tile_m_for(head_dim)
    return (total_q // tm + num_seqs + 1) * heads_q * tm * head_dim


def tile_m_for(head_dim: int) -> int:
    """Query rows of a backward step. hdim 64 takes 128 (as FA3 / flash-attn-4): a step twice as long against the
    same fixed costs per step (barriers, the dQ add and, deterministic, its ticket); hdim 128 keeps 64, its dK / dV
    accumulators leave no registers for a longer step."""
    return _OVERRIDE.get("tile_m") or (128 if head_dim <= 64 else 64)


# ----------------------------------------------------------------------------
# static configurations (compile-cache keys: plain Python values only)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdConfig:
    """Every static parameter of one compiled main-kernel variant."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    causal: bool
    varlen: bool
    seg_offsets: bool
    accumulate: bool
    deterministic: bool
    dkv_fp32: bool  # dk/dv buffers are fp32 (always when accumulating)
    tile_m: int
    stmatrix_ds: bool = True  # GPU run 2: 26/26 tests, main kernel 2-6 % faster than 16-bit stores
    det_chunk: int = 0  # deterministic launch order in chunks of key tiles (0: off)
    # deterministic orders for sequences of at most this many key tiles, which fit on the GPU at once: non-causal
    # key tiles visit their query tiles rotated and add dQ in arrival order, causal ones launch longest first
    # (bwd_sm90.FlashBwdSm90.det_resident; make_configs turns True into half the SM count). Default from
    # default_det_resident (the rotated order where it measured faster)
    det_resident: int = 0
    regs_mma: int = 240
    # K and masked-step Q / dO tiles through the sanitizer warps (masked pairs contribute nothing even with
    # non-finite operands). False is a measurement knob only (the cost of the guarantee).
    sanitize: bool = True
    window_left: int = -1  # >= 0 (causal only): the sliding window's lower edge (forward.FwdConfig)
    softcap: float = 0.0  # > 0: soft-capped scores (forward.FwdConfig); the launch passes tanh's scale
    # non-deterministic causal: plain query tiles before the masked band (bwd_sm90.FlashBwdSm90.masked_last). A
    # measurement knob since the fifty-sixth session: built when the band's Q / dO waited for the sanitizer's scan
    # (+3-9% at 1k-4k then); once clean_tiles certified most band tiles, the ascending order measured faster at
    # hdim 128 (one H100, bench/kernels.py --cute-variants bwd:masked_last=0: +3.7% at causal 1k, +0.9% at 2k,
    # +0.6-1.7% at 4k-32k; packed 1-4k-token documents +0.8-1.7%) and the same at hdim 64 (within +-0.3% at 1k-16k)
    masked_last: bool = False
    # softcap: the derivative of the cap kept in fp16 registers from the S phase (True) or recovered from P
    # through a log2 (False); default_softcap_grad_regs says which is faster where
    softcap_grad_regs: bool = True
    # "all", or only "dq" / only "dkv" (bwd_sm90.FlashBwdSm90)
    grads: str = "all"
    # dQ in int64 fixed point (fa4dist.kernels.fixed_point; cp_invariant): no tickets, exact order-free sums
    dq_fixed: bool = False
    # one launch over a work list's items (block_info.WORKLIST_COLUMNS table; backward_worklist)
    worklist: bool = False
    # > 0: a persistent grid of at most this many CTAs claiming key tiles from a counter (bwd_sm90.FlashBwdSm90);
    # the launch passes a zeroed int32 counter. Default from default_persistent_ctas (sequences of up to 2k, 8k dense
    # non-deterministic: it measured up to -9% at causal 16k; NOTES_BWD.md, eleventh, twelfth and seventeenth
    # sessions; dense non-deterministic causal hdim 64 at any length: +3% at 16k and 32k, fifty-fifth session;
    # deterministic up to 16k: +0.5-3.9%, fifty-sixth)
    persistent_ctas: int = 0
    # fresh 16-bit dK / dV of a dense call staged in shared memory and written with TMA stores, as flash-attn-4
    # does (False: stores from registers, which the varlen, accumulating and fp32-output variants always use)
    tma_store_dkv: bool = True
    # each step's lse2 / dPsum read from smem while its first GEMMs run (64-row query tiles only; the same bits).
    # Default from default_early_vectors (measured, NOTES_BWD.md)
    early_vectors: bool = False
    # the forward's late_pv_wait forms in the step (Q / dO barriers tried before the blocking wait, P^T / dS^T
    # converted with inline cvts; the same bits). A measurement knob (NOTES_BWD.md, fifteenth session)
    try_waits: bool = False
    # the smem operands' descriptor bases computed once per CTA instead of in every step
    # (common_sm90.loop_invariant_descriptors; the same bits). False: a measurement knob
    hoist_descriptors: bool = True
    # causal, not deterministic: long and short key tiles alternate in the launch order (tile_scheduler.
    # bwd_work_tile). Default from default_interleave_lengths (short dense sequences)
    interleave_lengths: bool = False
    # causal, not a work list: the longest key tiles of every (batch or packed sequence, kv head) first, then every
    # one's second longest, ... (tile_scheduler.bwd_work_tile's longest_first_over_heads, the split launches' order)
    # instead of one head's key tiles after another's; deterministic, the shortest first over every head (the
    # tickets' waits stay on tiles launched before); the same bits. Not a default of any config: launch_steps runs
    # lpt_over_heads_variant(cfg, group) for the dense non-deterministic launches whose shapes take it
    # (over_heads_group); deterministic or packed, a measurement knob measured slower (-9 to -14% deterministic,
    # -2 to -13% packed: NOTES_BWD.md, thirty-seventh session)
    lpt_over_heads: bool = False
    # lpt_over_heads within groups of this many (batch, kv head) pairs, one group after another (0: every pair at
    # once), so that a group's query-side streams stay in L2 on many-wave launches (the forward's l2_rows); the
    # same bits. Not a default of any config: over_heads_group picks it for the many-wave launches
    lpt_group: int = 0
    # deterministic: the dQ writer's ticket poll sleeps this many ns between reads (0: it spins, as flash-attn-4's
    # does; measured neutral), and fences before it releases the ticket (True: an explicit fence.acq_rel.gpu before
    # red.release, two MEMBAR.ALL.GPU per step in the SASS; False, the default: red.release alone, itself a
    # release, one MEMBAR as in flash-attn-4: +1.4-2.8% on the deterministic hdim-128 backward, +0.7-1.8% at hdim
    # 64 but one -0.4% row). The same order of adds either way, so the same bits (NOTES_BWD.md, nineteenth session)
    ticket_sleep_ns: int = 32
    release_fence: bool = False
    # fixed-point dQ: the rows' scales loaded at the start of the step (64-row query tiles without a cap; the same
    # bits; -4% on the int64 kernel at 32k causal hdim 128, median of three runs: NOTES_BWD.md twenty-first session)
    fixed_scales_early: bool = True
    # causal: a masked step's Q / dO skip the sanitizer when the preprocess certified every row of the query tile
    # (finite lse and dpsum: bwd_preprocess.py); the same bits. False: a measurement knob (every masked step
    # sanitized, as before the twenty-ninth session)
    clean_tiles: bool = True
    # a launch of few waves: the key tiles that make its tail (causal the longest, non-causal the last partial
    # wave's) run as parts over their query tiles, and the part that arrives last sums their dK / dV in part order
    # (dense_split_keys_plan). Not a default of any config: launch_steps runs split_keys_variant(cfg) for the
    # launches whose plan splits
    split_keys: bool = False

    def build(self):
        from .bwd_sm90 import FlashBwdSm90

        return FlashBwdSm90(
            host.cutlass_dtype(self.dtype), self.head_dim, causal=self.causal, varlen=self.varlen,
            accumulate=self.accumulate, deterministic=self.deterministic, seg_offsets=self.seg_offsets,
            tile_m=self.tile_m, stmatrix_ds=self.stmatrix_ds, det_chunk=self.det_chunk,
            regs_mma=self.regs_mma, sanitize=self.sanitize, window_left=self.window_left, softcap=self.softcap,
            masked_last=self.masked_last, softcap_grad_regs=self.softcap_grad_regs, grads=self.grads,
            dq_fixed=self.dq_fixed, worklist=self.worklist, persistent_ctas=self.persistent_ctas,
            det_resident=self.det_resident, tma_store_dkv=self.tma_store_dkv, early_vectors=self.early_vectors,
            try_waits=self.try_waits, hoist_descriptors=self.hoist_descriptors,
            interleave_lengths=self.interleave_lengths, lpt_over_heads=self.lpt_over_heads, lpt_group=self.lpt_group,
            ticket_sleep_ns=self.ticket_sleep_ns,
            release_fence=self.release_fence, fixed_scales_early=self.fixed_scales_early,
            clean_tiles=self.clean_tiles, split_keys=self.split_keys,
        )

    @property
    def takes_clean_flags(self) -> bool:
        """Whether the launch passes the preprocess's int32 clean flags, one per (query tile, head)."""
        return self.clean_tiles and self.sanitize and self.causal

    @property
    def takes_tile_counter(self) -> bool:
        """Whether the launch passes a zeroed (1,) int32 tile counter (a persistent grid)."""
        return self.persistent_ctas > 0

    def fake_args(self):
        import cutlass
        import cutlass.cute as cute

        dt = host.cutlass_dtype(self.dtype)
        qs, ks, _ = host.qkv_shapes(self.varlen, self.head_dim)
        fk = host.fake_tensor
        q, k, v, do = fk(dt, qs, 8), fk(dt, ks, 8), fk(dt, ks, 8), fk(dt, qs, 8)
        gdt, gdiv = (cutlass.Float32, 4) if self.dkv_fp32 else (dt, 8)
        dk, dv = fk(gdt, ks, gdiv), fk(gdt, ks, gdiv)
        lse2, dps = (host.fake_flat(cutlass.Float32) for _ in range(2))
        clean = host.fake_flat(cutlass.Int32) if self.takes_clean_flags else None
        dqacc = host.fake_flat(cutlass.Int64 if self.dq_fixed else cutlass.Float32)
        sem = host.fake_flat(cutlass.Int32) if self.deterministic else None
        dq_scale = host.fake_flat(cutlass.Float32) if self.dq_fixed else None
        cu_q = cu_k = off_q = off_k = None
        if self.worklist:
            cu_q = host.fake_i32()  # the item table
        elif self.varlen:
            nb1 = cute.sym_int()
            cu_q, cu_k = host.fake_i32(nb1), host.fake_i32(nb1)
        if self.seg_offsets:
            nb = cute.sym_int()
            off_q, off_k = host.fake_i32(nb), host.fake_i32(nb)
        counter = host.fake_i32(1) if self.takes_tile_counter else None
        split = {}
        if self.split_keys:  # the parts' fp32 dK / dV scratch, the split key tiles and the parts per tile
            counter = host.fake_i32()  # (and one arrival counter per split key tile after the tile counter)
            split = dict(split_dkv=host.fake_tensor(cutlass.Float32, (cute.sym_int(), self.head_dim), 4),
                         split_edge=cutlass.Int32(0), split_parts=cutlass.Int32(1))
        args = BwdKernelArgs(q=q, k=k, v=v, dout=do, lse2=lse2, dpsum=dps, clean=clean, dq_acc=dqacc, dk=dk, dv=dv,
                             sem=sem, dq_scale=dq_scale, scale=cutlass.Float32(1.0), scale_log2=cutlass.Float32(1.0),
                             diag=cutlass.Int32(0), max_seqlen_k=cutlass.Int32(1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             seg_off_q=off_q, seg_off_k=off_k, tile_counter=counter, **split)
        return (*args, host.fake_stream())


@dataclass(frozen=True)
class PreConfig:
    """The preprocess kernel (bwd_preprocess.py): D = rowsum(dO * O) * scale, lse in log2 units, the query tiles'
    clean flags, scratch zeroing."""

    o_dtype: str  # "bf16" | "fp16" | "fp32"
    do_dtype: str
    head_dim: int
    tile_m: int
    varlen: bool
    deterministic: bool
    zero_dq: bool = True  # False: the main kernel computes no dQ, so there is no scratch to zero
    dq_fixed: bool = False  # int64 scratch, and the rows' fixed-point scales copied next to lse2
    worklist: bool = False  # cu_seqlens is a work list's item table (its query rows and scratch tiles)
    dlse: bool = False  # the lse's gradient is given (lse's layout) and joins the row sums: D - dlse

    def build(self):
        from .bwd_preprocess import BwdPreprocess

        return BwdPreprocess(self.head_dim, self.tile_m, varlen=self.varlen, deterministic=self.deterministic,
                             zero_dq=self.zero_dq, dq_fixed=self.dq_fixed, worklist=self.worklist, dlse=self.dlse)

    def fake_args(self):
        import cutlass

        qs, _, ls = host.qkv_shapes(self.varlen, self.head_dim)
        odt, dodt = host.cutlass_dtype(self.o_dtype), host.cutlass_dtype(self.do_dtype)
        o = host.fake_tensor(odt, qs, 16 // (odt.width // 8))
        do = host.fake_tensor(dodt, qs, 16 // (dodt.width // 8))
        lse = host.fake_tensor(cutlass.Float32, ls, 1)
        dlse = host.fake_tensor(cutlass.Float32, ls, 1) if self.dlse else None
        lse2, dps, dqacc = (host.fake_flat(cutlass.Float32) for _ in range(3))
        clean = host.fake_flat(cutlass.Int32)
        sem = host.fake_flat(cutlass.Int32) if self.deterministic and self.zero_dq else None
        scale_rows = host.fake_tensor(cutlass.Float32, ls, 1) if self.dq_fixed else None
        scale2 = host.fake_flat(cutlass.Float32) if self.dq_fixed else None
        cu_q = host.fake_i32() if self.varlen else None
        return (o, do, lse, dlse, lse2, dps, clean, dqacc, sem, scale_rows, scale2, cutlass.Float32(1.0),
                cutlass.Int32(1), cu_q, host.fake_stream())


@dataclass(frozen=True)
class PostConfig:
    """The dQ convert kernel (bwd_postprocess.py): fp32 fragment-ordered scratch -> dq (int64 -> int64 dq,
    added, with dq_fixed; int64 -> a float dq with fixed_to_float)."""

    dtype: str  # q dtype
    dq_fp32: bool
    head_dim: int
    tile_m: int
    varlen: bool
    accumulate: bool
    dq_fixed: bool = False
    fixed_to_float: bool = False
    worklist: bool = False  # cu_seqlens is a work list's item table (its query rows and scratch tiles)

    def build(self):
        from .bwd_postprocess import BwdPostprocess

        return BwdPostprocess(host.cutlass_dtype(self.dtype), self.head_dim, self.tile_m, varlen=self.varlen,
                              accumulate=self.accumulate, dq_fixed=self.dq_fixed,
                              fixed_to_float=self.fixed_to_float, worklist=self.worklist)

    def fake_args(self):
        import cutlass

        qs, _, _ = host.qkv_shapes(self.varlen, self.head_dim)
        gdt, gdiv = (cutlass.Float32, 4) if self.dq_fp32 else (host.cutlass_dtype(self.dtype), 8)
        if self.dq_fixed and not self.fixed_to_float:
            gdt, gdiv = cutlass.Int64, 2
        dq = host.fake_tensor(gdt, qs, gdiv)
        dqacc = host.fake_flat(cutlass.Int64 if self.dq_fixed else cutlass.Float32)
        scale2 = host.fake_flat(cutlass.Float32) if self.fixed_to_float else None
        cu_q = host.fake_i32() if self.varlen else None
        return (dqacc, dq, scale2, cutlass.Int32(1), cu_q, host.fake_stream())


_FIELDS = {"stmatrix_ds": host.parse_bool, "regs_mma": host.parse_count, "det_chunk": host.parse_count,
           "sanitize": host.parse_bool,
           "masked_last": host.parse_bool, "softcap_grad_regs": host.parse_bool, "persistent_ctas": host.parse_count,
           "tma_store_dkv": host.parse_bool, "early_vectors": host.parse_bool,
           "try_waits": host.parse_bool, "hoist_descriptors": host.parse_bool,
           "interleave_lengths": host.parse_bool, "lpt_over_heads": host.parse_bool, "lpt_group": host.parse_count,
           "ticket_sleep_ns": host.parse_count,
           "release_fence": host.parse_bool,
           "fixed_scales_early": host.parse_bool, "clean_tiles": host.parse_bool,
           "det_resident": host.parse_bool}  # True: sequences of up to half the SMs' key tiles
# development hook: FA4DIST_BWD_OVERRIDE="stmatrix_ds=0,det_chunk=8" (tests and benches run a variant)
_OVERRIDE: dict = host.env_overrides("FA4DIST_BWD_OVERRIDE", _FIELDS)


def parse_overrides(text: str) -> dict:
    """``"persistent_ctas=132,det_resident=0"`` -> BwdConfig field overrides, typed (benches' variant rows)."""
    return host.parse_overrides(text, _FIELDS, "backward overrides")


def set_override(**kw) -> None:
    """Development hook: force fields of BwdConfig (stmatrix_ds=..., det_chunk=..., regs_mma=...)."""
    _OVERRIDE.clear()
    _OVERRIDE.update(kw)
    _FAST.clear()


def cache_info() -> list:
    return host.cache_info((BwdConfig, PreConfig, PostConfig))


def default_softcap_grad_regs(head_dim: int, tile_m: int) -> bool:
    """Whether the cap's derivative stays in fp16 registers (True) or is recovered from P. The fp16 copy costs
    tile_m * head_dim / 256 registers per MMA thread. Measured on the H200: registers are faster on 64-row query
    tiles at both head dims, at hdim 64 by +10% (causal 4k / 16k, no spills, 2026-12-01) and at hdim 128 by +6%
    (causal 4k and 16k, 8 bytes of spills; twentieth session, bench/sessions/gpu_session_19.sh 5) and +3-5% when
    it spilled 20-36 bytes (2026-12-01). hdim 64's 128-row query tiles take the P path: there the registers
    path spills 200 bytes, and the P path's 8-40 run at 0.97-1.00x the 64-row tiles' registers path (sixth
    session, bench/RESULTS.md)."""
    return tile_m == 64


def default_det_resident(deterministic: bool, causal: bool, accumulate: bool, grads: str, det_chunk: int,
                         worklist: bool) -> bool:
    """Whether a backward takes the rotated deterministic order (det_resident=True): non-causal deterministic
    calls that write fresh gradients, all three. Measured on the H200 (2026-12-01, eleventh session, bench/sessions/
    gpu_session_persistent_bwd.sh 1): deterministic non-causal 1.19x / 1.12x the ascending order at hdim 64 1k /
    4k, 1.08x / 1.09x at hdim 128 (0.95-0.98x flash-attn-4 there, from 0.80-0.91x); at 16k 0.98-1.00x, where
    sequences of more than half the SMs' key tiles keep the ascending order anyway. Causal, the longest-first
    launch measured within noise (0.98-1.02x): off. Merging calls (the ring's steps, the cp_invariant engine's
    passes), one-gradient calls, work lists and det_chunk keep the ascending order: their callers rely on the
    bytes of the full ascending backward, or (cp_invariant) on an order that does not follow the block's shape."""
    return bool(deterministic and not causal and not accumulate and grads == "all" and not det_chunk
                and not worklist)


def default_early_vectors(tile_m: int, varlen: bool, accumulate: bool, grads: str, dq_fixed: bool, worklist: bool,
                          softcap: float) -> bool:
    """Whether the step reads its lse2 / dPsum columns while its first GEMMs run (early_vectors): on 64-row query
    tiles (hdim 128), for the family measured, dense calls writing fresh dq, dk and dv. H200, 2026-12-02,
    fourteenth session, two interleaved runs against the default at 1k / 4k / 16k (bench/sessions/gpu_session_14.sh,
    14b.sh): non-causal +4 / 0 / +4% and +13 / +2 / +3%, deterministic non-causal +2 / +3 / 0% and +3 / +2 / -2%,
    deterministic causal +3 / 0 / 0% and +6 / 0 / 0%; causal non-deterministic lost then (-2% at 4k, 0 / -3% at
    16k), with the masked band visited last. With the ascending order (masked_last off, fifty-sixth session, one
    H100, bench/sessions/gpu_session_56.sh confirm / short / window, against the previous defaults in the same
    rounds) both together: causal +3.7 / +2.3 / +3.2 / +2.6 / +1.7 / +1.6% at 1k / 2k / 4k / 8k / 16k / 32k,
    reaching 1.00x flash-attn-4 at 16k and 32k; windowed (W 4096, 32k) forward+backward +1.1% in two runs; the
    few-wave split launches 0 to +1.6%. The loads only move, so every variant gives the same bits either way. On
    the persistent grid (sequences of up to 8k keys) the causal kernels spill 4 bytes with them (measured with the
    spill: the gains above), the split variant 12; soft-capped calls keep them off (16 bytes of spills without
    them, 248-264 with them: -43% at 4k / 16k, fifty-seventh session); packed calls (+0-1.2% measured over
    masked_last's change alone) keep the loads at their use. So do work lists: in the ring simulation (cp 8, 128k
    causal, fifty-seventh session, A / B / A / B) the steps' efficiency did not move with them (0.907 / 0.909
    against 0.908 / 0.907). So does the fixed-point dQ: the single device's cp_invariant step (the int64 dQ written
    into a float dq) with them was 1.2-1.4% slower at 32k, 32 / 32 and 32 / 8 heads of 128 (sixty-first session, one
    H100, bench/sessions/gpu_session_61.sh inv_ev, same run), and its accumulating kernel took 0-2.6% longer."""
    return bool(tile_m == 64 and not varlen and not accumulate and grads == "all" and not dq_fixed and not worklist
                and not softcap)


# dense causal non-deterministic backwards of at most this many keys alternate long and short key tiles
INTERLEAVE_MAX_SEQLEN_K = 1024


def default_interleave_lengths(causal: bool, deterministic: bool, varlen: bool, accumulate: bool, grads: str,
                               dq_fixed: bool, worklist: bool, window_left: int,
                               max_seqlen_k: Optional[int]) -> bool:
    """Whether long and short key tiles alternate in the launch order (BwdConfig.interleave_lengths): dense causal
    non-deterministic calls writing fresh dq, dk and dv, no window, at most INTERLEAVE_MAX_SEQLEN_K keys. Measured
    on the H200 against longest first in the same rounds (2026-12-02, seventeenth session, bench/sessions/
    gpu_session_17.sh 1 and 2): 1k +7.6% / +8.4% at hdim 128 / 64 (the same in both runs); 2k -4.6% / 0; 4k
    -3.5% / -5%; 16k -3% / -2%; packed causal documents of 512-2048 tokens 0 to -3%."""
    return bool(causal and not deterministic and not varlen and not accumulate and grads == "all" and not dq_fixed
                and not worklist and window_left < 0 and max_seqlen_k is not None
                and max_seqlen_k <= INTERLEAVE_MAX_SEQLEN_K)


# The longest key sequence (dense: the key length; packed: max_seqlen_k) that the persistent grid takes by default,
# and for dense non-deterministic calls
PERSISTENT_MAX_SEQLEN_K = 2048
PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET = 8192
# ... and at any length for dense non-deterministic causal calls at these head dims, without a window or a cap
# (fifty-fifth session, one H100, bench/kernels.py --cute-variants bwd:persistent_ctas=132, device time, three runs
# against one CTA per tile: hdim 64 causal +3.3 / +3.1 / +3.1% at 16k, +3.3% at 32k, reaching 1.01 / 1.03x
# flash-attn-4 from 0.98 / 0.99; in the same runs hdim 64 non-causal 16k -0.7 / +0.2% and hdim 128 16k within
# +-0.3%, causal and not, so those keep one CTA per tile)
PERSISTENT_ANY_SEQLEN_CAUSAL_HEAD_DIMS = (64,)
# ... and deterministic ones at those head dims up to this many keys (fifty-sixth session, one H100, bench/kernels.py
# --deterministic --cute-variants bwd-det:persistent_ctas=132, against one CTA per tile in the same rounds: hdim 64
# causal +3.9 / +3.5% at 4k, +1.3% at 8k, +0.9 / +0.5% at 16k; in the same runs hdim 64 non-causal +0.6 / -0.9% at
# 4k / 16k and hdim 128 -2.0 to -0.4%, so those keep one CTA per tile; 32k not measured). The grid gives the bits
# of one CTA per tile (the persistent-grid GPU test's deterministic cases)
PERSISTENT_MAX_SEQLEN_K_DENSE_DET_CAUSAL = 16384


def default_persistent_ctas(accumulate: bool, grads: str, worklist: bool, dq_fixed: bool,
                            max_seqlen_k: Optional[int], deterministic: bool = False, varlen: bool = True,
                            head_dim: int = 0, causal: bool = False, plain_mask: bool = False) -> int:
    """The SM count for backwards that write fresh dq, dk and dv on key sequences of at most PERSISTENT_MAX_SEQLEN_K
    tokens, PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET for dense non-deterministic calls; dense causal calls at
    PERSISTENT_ANY_SEQLEN_CAUSAL_HEAD_DIMS with a plain mask (no window, no cap) at any length, deterministic ones
    up to PERSISTENT_MAX_SEQLEN_K_DENSE_DET_CAUSAL; else 0 (one CTA per tile).
    Measured on the H200 against one CTA per tile (bench/RESULTS.md): packed causal documents of 512 / 1024 / 2048
    tokens 1.15 / 1.11 / 1.03x at hdim 64 and 1.07 / 1.06 / 1.02x at hdim 128, deterministic 1.17 / 1.10 / 1.04x and
    1.05 / 1.04 / 1.00x (twelfth session); dense causal 1k 1.02-1.10x (deterministic too), non-causal 1k 1.00-1.05x
    (eleventh session). Dense, non-deterministic, 4k / 8k / 16k (seventeenth session,
    bench/sessions/gpu_session_17.sh 6 and 7): causal hdim 64 +5.9 / +1.7% and +4.8 / +3.7 / +0.6%, causal hdim 128
    +0.6 / +2.3% and +1.2 / +1.9 / -1.7%, non-causal hdim 64 -0.2 / -0.4 / +1.9%, hdim 128 +2.2 / +1.5 / +2.2% (the
    eleventh session had causal 16k down to 0.91x): on the grid up to 8k. Deterministic and packed calls beyond 2k
    are not measured there. A deterministic grid claims every tile from its counter, so its dQ tickets never wait on
    a CTA that has no SM (tile_scheduler.TileClaims). Kept off the grid: merging calls (the ring's steps, whose NCCL
    transfers on another stream need SMs that a persistent grid holds until its last tile), one-gradient calls, work
    lists, the fixed-point dQ, and calls whose longest key sequence is unknown (packed without max_seqlen_k)."""
    if accumulate or grads != "all" or worklist or dq_fixed or max_seqlen_k is None:
        return 0
    if (not varlen and causal and plain_mask and head_dim in PERSISTENT_ANY_SEQLEN_CAUSAL_HEAD_DIMS
            and (not deterministic or max_seqlen_k <= PERSISTENT_MAX_SEQLEN_K_DENSE_DET_CAUSAL)):
        return host.sm_count()
    bound = PERSISTENT_MAX_SEQLEN_K if deterministic or varlen else PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET
    return host.sm_count() if max_seqlen_k <= bound else 0


# The deterministic GQA backward runs on K / V expanded per query head (det_dq="expanded") for causal calls whose
# longest key sequence reaches this length, by head dim; the GQA tickets elsewhere. Measured on the H200 (twentieth
# session, bench/sessions/gpu_session_21.sh 2: bench/kernels.py --kv-group 4, 32k tokens per call, 16 / 4 heads of
# 128 and 32 / 8 of 64, bf16, TFLOP/s expanded / GQA tickets / int64 dQ): hdim 128 causal 4k 378 / 397 / 330, 16k
# 509 / 407 / 432, 32k 537 / 407 / 444 (flash-attn-4's deterministic 459 / 545 / 557); non-causal 4k-32k the tickets
# by 1-16%. hdim 64 causal 16k 483 / 492, 32k 508 / 480; non-causal the tickets. The int64 dQ (the default for long
# hdim-128 GQA calls before) is slowest everywhere since the tickets got faster; det_dq="fixed" still forces it.
EXPANDED_GQA_MIN_SEQLEN_K = {128: 16384, 64: 32768}


# A non-deterministic GQA backward runs on K / V expanded per query head when its CTAs (one per key tile and key /
# value head, each walking its group of query heads) leave most SMs idle or end with the group's longest CTAs: few
# key / value heads on the GPU (tensor parallelism). Expanded, the launch has group times the CTAs, each one head
# long, for K / V copies and a group sum of fp32 dK / dV (GQA_EXPAND_COST, in units of the longest CTA's one-head
# work); taken where that comes to at most GQA_EXPAND_MAX_RATIO of the GQA launch's time. Measured on the H200
# (thirty-second session, bench/sessions/gpu_session_33.sh 7: one kv head, 4 query heads of 128, batch 1, fwd+bwd
# through the entry points, expanded against GQA): 2.4x / 1.5x / 0.96x non-causal at 4k / 8k / 16k, 2.6x / 2.05x /
# 1.58x causal.
GQA_EXPAND_COST = 0.5
GQA_EXPAND_MAX_RATIO = 0.8


def nondeterministic_gqa_form(group: int, kv_tiles: int, num_sms: int, causal: bool = False,
                              longest_tiles: int = 0) -> str:
    """"expanded" or "gqa" (the GQA kernel as it is) for a non-deterministic backward with ``group`` query heads per
    key / value head and ``kv_tiles`` (key tile, key / value head) CTAs, the longest sequence ``longest_tiles`` key
    tiles long. Each launch's time in units of its longest CTA's one-head work: the GQA launch max(1, work / SMs)
    times the group, the expanded one max(1, group x work / SMs) and the expansion's cost, where work is the CTAs'
    summed one-head work (a causal key tile's is its share of the queries: (n + 1) / 2n on average)."""
    if group <= 1 or kv_tiles <= 0:
        return "gqa"
    share = (longest_tiles + 1) / (2 * longest_tiles) if causal and longest_tiles > 0 else (0.5 if causal else 1.0)
    work = kv_tiles * share
    gqa = group * max(1.0, work / num_sms)
    expanded = max(1.0, group * work / num_sms) + GQA_EXPAND_COST
    return "expanded" if expanded <= GQA_EXPAND_MAX_RATIO * gqa else "gqa"


def deterministic_gqa_form(group: int, head_dim: int, causal: bool, max_seqlen_k) -> str:
    """How a deterministic backward with `group` query heads per key / value head adds dQ: "expanded" (K / V copied
    per query head, so that no CTA walks a group of heads: the causal launch ends with its longest CTAs, group times
    longer with GQA) or "tickets" (the GQA kernel as it is). max_seqlen_k: the longest key sequence, None unknown."""
    if group <= 1 or not causal or max_seqlen_k is None:
        return "tickets"
    return "expanded" if max_seqlen_k >= EXPANDED_GQA_MIN_SEQLEN_K.get(head_dim, math.inf) else "tickets"


def make_configs(q_dtype, head_dim, *, causal, varlen, seg_offsets, accumulate, deterministic, dq_dtype, dkv_dtype,
                 o_dtype, do_dtype, window_left=-1, softcap=0.0, grads="all", dq_fixed=False, fixed_to_float=False,
                 worklist=False, max_seqlen_k=None, dlse=False, **overrides):
    """(PreConfig, BwdConfig, PostConfig) of one backward call. max_seqlen_k: its longest key sequence, if known
    (default_persistent_ctas); dlse: the lse's gradient is given (the preprocess's); overrides: BwdConfig fields,
    which win over the defaults."""
    tm = overrides.get("tile_m") or tile_m_for(head_dim)  # the three kernels share the query tile
    if dq_fixed:
        # exact integer sums: deterministic without tickets; the query tiles of a key tile in ascending order
        # (no masked_last), as every deterministic variant (the dk/dv-only calls of the cp_invariant backward) has.
        # masked_last is off by default; this keeps it off under FA4DIST_BWD_OVERRIDE too (it would change dk / dv)
        deterministic = False
        overrides.setdefault("masked_last", False)
    name = host.dtype_name(q_dtype)
    kw = dict(
        dtype=name, head_dim=head_dim, causal=bool(causal), varlen=bool(varlen), seg_offsets=bool(seg_offsets),
        accumulate=bool(accumulate), deterministic=bool(deterministic), dkv_fp32=dkv_dtype == torch.float32,
        tile_m=tm, window_left=int(window_left), softcap=float(softcap or 0.0),
        softcap_grad_regs=default_softcap_grad_regs(head_dim, tm), grads=grads, dq_fixed=bool(dq_fixed),
        worklist=bool(worklist),
    )
    kw.update(_OVERRIDE)
    kw.update(overrides)
    if "persistent_ctas" not in kw:
        kw["persistent_ctas"] = default_persistent_ctas(kw["accumulate"], kw["grads"], kw["worklist"],
                                                        kw["dq_fixed"], max_seqlen_k, kw["deterministic"],
                                                        kw["varlen"], head_dim, kw["causal"],
                                                        kw["window_left"] < 0 and not kw["softcap"])
    if "early_vectors" not in kw:
        kw["early_vectors"] = default_early_vectors(tm, kw["varlen"], kw["accumulate"], kw["grads"], kw["dq_fixed"],
                                                    kw["worklist"], kw["softcap"])
    if "det_resident" not in kw:
        kw["det_resident"] = default_det_resident(kw["deterministic"], kw["causal"], kw["accumulate"], kw["grads"],
                                                  kw.get("det_chunk", 0), kw["worklist"])
    # True: half the SMs (every key tile of such a sequence must be resident at once, with room to spare)
    resident = kw.get("det_resident", 0)
    kw["det_resident"] = host.sm_count() // 2 if resident is True else int(resident)
    if kw.get("persistent_ctas", 0) > 0:  # ... on the persistent grid, every such tile claimed at once
        kw["det_resident"] = min(kw["det_resident"], kw["persistent_ctas"] // 2)
    if "interleave_lengths" not in kw:
        kw["interleave_lengths"] = default_interleave_lengths(
            kw["causal"], kw["deterministic"], kw["varlen"], kw["accumulate"], kw["grads"], kw["dq_fixed"],
            kw["worklist"], kw["window_left"], max_seqlen_k)
    if kw.get("interleave_lengths") and not (kw["causal"] and not kw["deterministic"]):
        kw["interleave_lengths"] = False  # the kernel's rule (bwd_sm90): one cache entry per kernel
    if kw.get("lpt_over_heads") and not (kw["causal"] and not kw["worklist"] and not (
            kw["deterministic"] and (kw.get("det_chunk") or kw["det_resident"]))):
        kw["lpt_over_heads"] = False  # the kernel's rule (bwd_sm90)
    if not kw.get("lpt_over_heads"):
        kw["lpt_group"] = 0
    main = BwdConfig(**kw)
    pre = PreConfig(o_dtype=host.dtype_name(o_dtype), do_dtype=host.dtype_name(do_dtype), head_dim=head_dim,
                    tile_m=tm, varlen=bool(varlen), deterministic=bool(deterministic), zero_dq=grads != "dkv",
                    dq_fixed=bool(dq_fixed), worklist=bool(worklist), dlse=bool(dlse))
    post = PostConfig(dtype=name, dq_fp32=dq_dtype == torch.float32, head_dim=head_dim, tile_m=tm,
                      varlen=bool(varlen), accumulate=bool(accumulate), dq_fixed=bool(dq_fixed),
                      fixed_to_float=bool(fixed_to_float), worklist=bool(worklist))
    return pre, main, post


def check_resident(cfg: BwdConfig) -> None:
    """A deterministic persistent grid of more CTAs than SMs is refused before any kernel runs. Its claims keep it
    from hanging (tile_scheduler.TileClaims), but the rotated order's bound (half the grid's CTAs, make_configs)
    assumes every CTA can hold an SM, and the CTAs past the SM count would only wait for one."""
    if cfg.deterministic and cfg.persistent_ctas > host.sm_count():
        raise ValueError(f"persistent_ctas={cfg.persistent_ctas} exceeds the {host.sm_count()} SMs: a "
                         "deterministic persistent backward takes at most one CTA per SM")


def split_keys_variant(cfg: BwdConfig) -> Optional[BwdConfig]:
    """The split_keys form of a call's main-kernel variant (on the persistent grid, whose claims and counters it
    needs), or None where it does not apply: non-deterministic dense calls writing fresh 16-bit dK / dV through
    the TMA stores, every gradient, no window (a causal part's queries are then a run of the key tile's), no
    fixed-point dQ or work list."""
    if not (not cfg.deterministic and not cfg.varlen and not cfg.accumulate and cfg.grads == "all"
            and not cfg.dq_fixed and not cfg.worklist and cfg.window_left < 0 and cfg.tma_store_dkv
            and not cfg.dkv_fp32):
        return None
    return replace(cfg, split_keys=True, persistent_ctas=host.sm_count(), interleave_lengths=False)


# ----------------------------------------------------------------------------
# support check
# ----------------------------------------------------------------------------


def supports_backward(q, k, v, *, dout=None, out=None, lse=None, dq=None, dk=None, dv=None, causal=False,
                      cu_seqlens_q=None, cu_seqlens_k=None, accumulate=False, softmax_scale=None, dq_scale=None):
    """(ok, reason): whether this kernel can compute the call. The caller validated the contract."""
    if softmax_scale is not None and not softmax_scale > 0:
        return False, "softmax_scale must be positive (the kernel masks with -inf scores)"
    ok, reason = host.check_qkv(q, k, v, BWD_HEAD_DIMS, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           what="backward")
    if not ok:
        return ok, reason
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False, "needs an sm_90 (Hopper) GPU"
    varlen, d, hq = cu_seqlens_q is not None, q.shape[-1], q.shape[-2]
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        if t is not None and not host.aligned(t):
            return False, f"{name} needs a contiguous last dim and 16-byte aligned base and strides"
    if dout is not None and dout.dtype not in host.TORCH_DTYPES + (torch.float32,):
        return False, f"dout dtype {dout.dtype} not supported"
    if out is not None and out.dtype not in host.TORCH_DTYPES + (torch.float32,):
        return False, f"out dtype {out.dtype} not supported"
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is None:
            continue
        want = (torch.float32,) if accumulate else (q.dtype, torch.float32)
        if name == "dq" and dq_scale is not None and accumulate:
            want = (torch.int64, torch.float32)
        if t.dtype not in want:
            return False, f"{name} must be {' or '.join(map(str, want))}"
        if tuple(t.shape) != tuple(like.shape) or not host.aligned(t):
            return False, f"{name} must match {name[1]}'s shape with aligned strides"
    if dk is not None and dv is not None and dk.dtype != dv.dtype:
        return False, "dk and dv must share a dtype"
    total_q = q.shape[0] * (1 if varlen else q.shape[1])
    nseg = (cu_seqlens_q.shape[0] - 1) if varlen else q.shape[0]
    if dq_scratch_elements(total_q, nseg, hq, d) >= host.INT32_MAX:
        return False, "problem too large for 32-bit scratch indexing"
    return True, ""


# ----------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------


def backward(dout, q, k, v, out, lse, dq, dk, dv, **options):
    """Gradients of one attention block (given the global out and lse), written into dq, dk, dv: the launches of
    :func:`launch_steps` (which documents the arguments and options) run in order. Returns (dq, dk, dv)."""
    for step in launch_steps(dout, q, k, v, out, lse, dq, dk, dv, **options):
        step()
    return dq, dk, dv


def launch_steps(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    *,
    softmax_scale=None,
    causal=False,
    q_offset=0,
    k_offset=0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic=False,
    accumulate=False,
    window_left=-1,
    softcap=None,
    rows: Optional["SharedRows"] = None,
    q_start: int = 0,
    dq_scale: Optional[torch.Tensor] = None,
    dlse: Optional[torch.Tensor] = None,
    **overrides,
):
    """The backward as a list of callables (preprocess, main kernel, dQ convert), each launching one kernel on the
    current stream; `backward` runs them in order. Split out so that benchmarks can time each kernel.

    dout, q, k, v: bf16/fp16 (dout may be fp32); out: q dtype or fp32; lse fp32 (natural log), (b, h, s_q) or
    packed (h, t_q). dq/dk/dv: fresh buffers (q dtype or fp32) or, with accumulate=True, fp32 buffers added into.
    q_offset / k_offset: ints, or int32 tensors / sequences with one global offset per sequence or segment.
    window_left >= 0 (causal only): the sliding window's lower edge, and softcap, as in forward.forward.
    With accumulate=True, dq = None or dk = dv = None skips those gradients (a variant without their GEMMs).
    dq_scale (accumulate=True, dq int64): the fixed-point dQ of fa4dist.kernels.fixed_point; each (query tile,
    key tile) contribution times its row's scale (fp32 powers of two, lse's shape) is rounded and added into dq.
    With an fp32 dq, the launch's integer sums are converted once (fixed_point.from_fixed's rounding) and added;
    with accumulate=False, converted to fp32 and written (into an fp32 or q-dtype dq), and dK / dV written as
    the accumulating kernel adds them into zeros (a signed zero comes out +0).
    dlse: the lse's gradient (fp32, lse's shape), which joins the preprocess's row sums (D - dlse: d lse / d s = P);
    not with shared rows or the fixed-point dQ.
    overrides: BwdConfig fields (measurement knobs; det_dq="auto" | "tickets" | "fixed" | "expanded": the
    deterministic dQ's form; gqa_form="auto" | "gqa" | "expanded": a non-deterministic GQA call's; split_keys=False:
    no split of a few-wave launch's tail key tiles, split_keys_variant).

    rows: the query side is shared (:class:`SharedRows`): q, dout, out, lse are rows [q_start, q_start + len) of
    its queries, the preprocess and the dQ convert are its own (dq is ignored), and the steps are the main kernel
    alone, on views of its scratch."""
    det_dq = overrides.pop("det_dq", "auto")
    if det_dq not in ("auto", "tickets", "fixed", "expanded"):
        raise ValueError(f"det_dq must be 'auto', 'tickets', 'fixed' or 'expanded', got {det_dq!r}")
    gqa_form = overrides.pop("gqa_form", "auto")
    split_keys = overrides.pop("split_keys", "auto")  # "auto": as dense_split_keys_plan says; False: never
    if split_keys not in ("auto", False):
        raise ValueError(f"split_keys must be 'auto' or False, got {split_keys!r}")
    if gqa_form not in ("auto", "gqa", "expanded"):
        raise ValueError(f"gqa_form must be 'auto', 'gqa' or 'expanded', got {gqa_form!r}")
    group = q.shape[-2] // max(k.shape[-2], 1)
    if deterministic:
        if det_dq == "auto":
            det_dq = deterministic_gqa_form(group, q.shape[-1], causal,
                                            k.shape[1] if cu_seqlens_k is None else max_seqlen_k)
        form = "expanded" if det_dq == "expanded" else "gqa"
    else:
        form = gqa_form
        if form == "auto":
            longest = k.shape[1] if cu_seqlens_k is None else (max_seqlen_k or k.shape[0])
            form = nondeterministic_gqa_form(group, _kv_tiles(k, cu_seqlens_k), host.sm_count(), causal,
                                             -(-longest // TILE_N))
    # (the copies per query head hold group x |K| elements: past 32-bit indexing, which supports() checks for K as
    # given, the GQA kernel runs as it is)
    if (form == "expanded" and group > 1 and rows is None and dq_scale is None
            and dq is not None and dk is not None and dv is not None and k.numel() * group < host.INT32_MAX):
        inner = dict(softmax_scale=softmax_scale, causal=causal, q_offset=q_offset, k_offset=k_offset,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, window_left=window_left, softcap=softcap, split_keys=split_keys,
                     dlse=dlse, **overrides)
        return _expanded_kv_steps(dout, q, k, v, out, lse, dq, dk, dv, group, accumulate, deterministic, inner)
    varlen = cu_seqlens_q is not None
    d = q.shape[-1]
    hq = q.shape[-2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if not softmax_scale > 0:
        raise ValueError("the cute backward needs a positive softmax_scale")
    window_left = host.check_window_left(window_left, causal)
    softcap = host.check_softcap(softcap)
    device = q.device
    nseg = (cu_seqlens_q.shape[0] - 1) if varlen else q.shape[0]
    total_q = q.shape[0] * (1 if varlen else q.shape[1])
    total_k = k.shape[0] * (1 if varlen else k.shape[1])
    if total_q == 0 or total_k == 0 or nseg == 0 or hq == 0:
        if accumulate or rows is not None:  # no visible pair: nothing to add
            return []
        return [lambda: (dq.zero_(), dk.zero_(), dv.zero_())]

    seg_offsets = causal and not (host.is_uniform_offset(q_offset) and host.is_uniform_offset(k_offset))
    diag = 0
    off_q = off_k = None
    if causal:
        if seg_offsets:
            off_q = host.segment_offsets(q_offset, nseg, device)
            off_k = host.segment_offsets(k_offset, nseg, device)
        else:
            diag = int(q_offset) - int(k_offset)
            if abs(diag) > host.INT32_MAX // 4:
                raise ValueError("q_offset - k_offset out of int32 range")

    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dout_mma = dout if dout.dtype == q.dtype else dout.to(q.dtype)
    if lse.stride(-1) != 1:
        lse = lse.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    if dlse is not None:
        if dlse.dtype != torch.float32 or tuple(dlse.shape) != tuple(lse.shape):
            raise ValueError(f"dlse must be fp32 shaped like lse {tuple(lse.shape)}, got {dlse.dtype} "
                             f"{tuple(dlse.shape)}")
        if rows is not None or dq_scale is not None:
            raise ValueError("dlse= (the lse's gradient) is not taken with shared rows or the fixed-point dQ")
        if dlse.stride(-1) != 1:
            dlse = dlse.contiguous()

    dq_fixed = dq_scale is not None
    # the fixed-point dQ into a float dq: the launch's integer sums converted once by the convert kernel and added
    # (accumulate=True) or written
    fixed_to_float = False
    if dq_fixed:
        dq_dtypes = (torch.int64, torch.float32) if accumulate else (q.dtype, torch.float32)
        if rows is not None or dq is None or dq.dtype not in dq_dtypes:
            raise ValueError("the fixed-point dQ (dq_scale=) adds into an int64 dq or, converted, an fp32 one "
                             "(accumulate=True), or writes the converted sums into an fp32 or q-dtype dq "
                             "(accumulate=False); no shared rows")
        fixed_to_float = dq.dtype != torch.int64
        if dq_scale.dtype != torch.float32 or tuple(dq_scale.shape) != tuple(lse.shape):
            raise ValueError(f"dq_scale must be fp32 shaped like lse {tuple(lse.shape)}, got {dq_scale.dtype} "
                             f"{tuple(dq_scale.shape)}")
        if dq_scale.stride(-1) != 1:
            dq_scale = dq_scale.contiguous()
    # det_dq="fixed": the int64 fixed-point dQ instead of the ticketed fp32 one (exact sums, no tickets), converted
    # to the caller's dq by the convert kernel (measured slower than the other two forms, twentieth session)
    if deterministic and not dq_fixed and rows is None and dq is not None and (dk is not None or not accumulate):
        if det_dq == "fixed" and dlse is not None:
            raise ValueError("det_dq='fixed' bounds dQ from dout and out alone: not with dlse=")
        if det_dq == "fixed":
            from .. import fixed_point

            group = hq // k.shape[-2]
            k_max, v_max = (fixed_point.head_absmax(t).repeat_interleave(group) for t in (k, v))
            dq_scale = fixed_point.dq_scale(dout, out, k_max, v_max, softmax_scale)
            dq_fixed = fixed_to_float = True
    grads = "all"
    if dk is None or dv is None or (dq is None and rows is None):
        if not accumulate or rows is not None or (dk is None) != (dv is None) or (dq is None and dk is None):
            raise ValueError("the cute backward skips gradients only when accumulating: dq=None, or dk=dv=None")
        grads = "dq" if dk is None else "dkv"
    if rows is not None and (varlen or q.shape[0] != 1):
        raise ValueError("a launch on shared rows takes a dense batch-1 view of them")
    config_args = (q.dtype, d)
    config_kw = dict(
        causal=causal, varlen=varlen, seg_offsets=seg_offsets, accumulate=accumulate, deterministic=deterministic,
        dq_dtype=torch.float32 if dq is None else dq.dtype, dkv_dtype=torch.float32 if dk is None else dk.dtype,
        o_dtype=out.dtype, do_dtype=dout.dtype, window_left=window_left, softcap=softcap, grads=grads,
        dq_fixed=dq_fixed, fixed_to_float=fixed_to_float,
        max_seqlen_k=None if rows is not None else max_seqlen_k if varlen else k.shape[1], dlse=dlse is not None,
    )
    pre_cfg, main_cfg, post_cfg, pre_fn, main_fn, post_fn = _compiled_configs(
        config_args, config_kw, overrides, shared=rows is not None, device=device)
    tm = main_cfg.tile_m  # make_configs chose it (a measurement knob may pick the other tile)
    if grads == "dq":  # never written (the kernel's dK / dV stores are compiled out); shaped like k for its checks
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    scale = float(softmax_scale)
    scale_log2 = host.score_scale(scale, softcap)

    def main_args(**scratch) -> BwdKernelArgs:  # this call's inputs and options, with its scratch
        return BwdKernelArgs(q=q, k=k, v=v, dout=dout_mma, dk=dk, dv=dv, scale=scale, scale_log2=scale_log2,
                             diag=diag, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seg_off_q=off_q,
                             seg_off_k=off_k, **scratch)

    if rows is not None:
        lse2, dpsum, clean, dq_acc, sem = rows.views(q_start, total_q, deterministic)
        args = main_args(lse2=lse2, dpsum=dpsum, clean=clean if main_cfg.takes_clean_flags else None, dq_acc=dq_acc,
                         sem=sem, dq_scale=None, max_seqlen_k=max(k.shape[1], 1))
        # (a fresh zeroed tile counter per launch: the shared rows' launches may run on several streams)
        main = lambda: main_fn(*args._replace(  # noqa: E731
            tile_counter=host.tile_counter(main_cfg.takes_tile_counter, device)))
        # deterministic: the dQ tickets count from 0 again for this launch's key tiles
        return ([sem.zero_] if sem is not None else []) + [main]

    # scratch: one chunk per (query tile, head); sequences padded to whole tiles
    if varlen:
        n_blocks = total_q // tm + nseg
        msq = int(max_seqlen_q) if max_seqlen_q is not None else total_q
        msk = int(max_seqlen_k) if max_seqlen_k is not None else total_k
        m_grid = max(1, -(-max(msq, 1) // tm))
    else:
        n_blocks = q.shape[0] * (-(-q.shape[1] // tm))
        msk = k.shape[1]
        m_grid = 1
    n_chunks = n_blocks * hq
    msk = max(msk, 1)
    split_cfg = _split_variant(main_cfg) if split_keys == "auto" and grads != "dkv" else None
    plan = dense_split_keys_plan(split_cfg, q.shape, k.shape, diag) if split_cfg is not None else (0, 1)
    split_tiles = split_key_tile_count(split_cfg, k.shape, plan) if plan[1] > 1 else 0
    if grads == "dkv":  # no dQ: no scratch, no tickets (one chunk and one ticket satisfy the signature)
        dq_part, sem_count = (tm * d, torch.float32), 1 if deterministic else None
    elif dq_fixed:  # int64 scratch (zeroed by the preprocess as fp32 words), the rows' scales in lse2's indexing
        dq_part, sem_count = (n_chunks * tm * d, torch.int64), None
    else:
        dq_part, sem_count = (n_chunks * tm * d, torch.float32), n_chunks if main_cfg.deterministic else None
    # the split variant's arrival counters follow its tile counter
    counter_count = 1 + split_tiles if split_tiles else 1 if main_cfg.takes_tile_counter else None
    scratch = make_scratch(device, n_chunks, tm, dq_part, sem=sem_count, row_scales=dq_fixed,
                           counter=counter_count, split_dkv=2 * split_tiles * plan[1] * TILE_N * d or None)
    lse2, dpsum, clean, dq_acc, sem, scale2, counter, _ = scratch
    dq_words = dq_acc.view(torch.float32) if dq_fixed else dq_acc  # (the preprocess zeroes int64 as fp32 words)
    main_clean = clean if main_cfg.takes_clean_flags else None
    args = main_args(lse2=lse2, dpsum=dpsum, clean=main_clean, dq_acc=dq_acc, sem=sem, dq_scale=scale2,
                     max_seqlen_k=msk)

    def launch():  # what each main launch makes fresh: its zeroed tile counter (a persistent grid's)
        return dict(tile_counter=None if counter is None else counter.zero_())

    if grads == "dkv":
        return [
            lambda: pre_fn(out, dout, lse, dlse, lse2, dpsum, clean, dq_acc, None, None, None, scale, m_grid,
                           cu_seqlens_q),
            lambda: main_fn(*args._replace(**launch())),
        ]
    if split_tiles:  # the longest key tiles in parts: the split variant, its scratch and arrival counters
        main_fn = host.get_compiled(split_cfg)
        split_dkv = scratch.split_dkv.view(-1, d)
        args = args._replace(split_dkv=split_dkv, split_edge=plan[0], split_parts=plan[1])
    elif "lpt_over_heads" not in {**_OVERRIDE, **overrides}:
        group = over_heads_group(main_cfg, q.shape, k.shape)
        if group is not None:  # (the split variant has this order too)
            main_fn = host.get_compiled(lpt_over_heads_variant(main_cfg, group))
    return [
        lambda: pre_fn(out, dout, lse, dlse, lse2, dpsum, clean, dq_words, sem, dq_scale, scale2, scale, m_grid,
                       cu_seqlens_q),
        lambda: main_fn(*args._replace(**launch())),
        lambda: post_fn(dq_acc, dq, scale2 if fixed_to_float else None, m_grid, cu_seqlens_q),
    ]


# lpt_over_heads for dense causal non-deterministic launches of at most LPT_OVER_HEADS_MAX_WAVES waves of key tiles
# whose query-side streams (q and dO in 16 bits, the fp32 dQ scratch: 8 bytes per query element) take at most
# LPT_OVER_HEADS_MAX_BYTES. Measured on the H200 (bench/RESULTS.md, thirty-fourth session, bench/split_tail.py
# --direction bwd --causal, device time, against one head's key tiles after another's): hdim 128 +40 / +35 / +39
# / +19 / +18% at 8 x 4k / 16 x 2k / 4 x 8k / 12 x 4k / 16 x 4k heads x tokens (2-4 waves), +5 / +6.5 / -0.4% at
# 32 x 4k / 16 x 8k / 8 x 16k (8 waves, 128 MB); -0.6 / -1.9 / -12% at 2 x 8k x 16 / 16k x 16 / 4 x 4k x 16 (16
# waves, 256 MB); hdim 64 +40 / +17 / +8.5% at 8 x 4k / 16 x 4k / 16 x 8k, -32% at 4 x 4k x 32 (32 waves, 256 MB):
# every head's streams at once then no longer fit the 50 MB L2, where a head-major order keeps one head's hot.
# Past those bounds the same order within groups of LPT_GROUP_MANY_WAVES (batch, kv head) pairs, one group after
# another (thirty-seventh session, bench/sessions/gpu_session_37.sh, device time against head-major, hdim 128: +4.5
# / +4.6 / -0.1% at 4 x 4k x 16 / 2 x 8k x 16 / 16k x 16, 1.02 / 1.02 / 0.98x flash-attn-4; groups of 8: +4.5 /
# +3.4 / -0.9%; confirmed in the thirty-eighth session: 575 / 636 / 669 against 550 / 609 / 670). Only at hdim 128
# (LPT_GROUP_HEAD_DIMS): at hdim 64 groups of 4 measured -0.4 to -1.8% against head-major (4 x 4k x 32, 2 x 8k x 32,
# 16k x 32; thirty-eighth session, gpu_session_37.sh), whose head-major rows are already 1.01 / 1.01 / 0.97x FA4.
LPT_OVER_HEADS_MAX_WAVES = 8
LPT_OVER_HEADS_MAX_BYTES = 128 * 2**20
LPT_GROUP_MANY_WAVES = 4
LPT_GROUP_HEAD_DIMS = (128,)


def over_heads_group(cfg: BwdConfig, q_shape, k_shape) -> Optional[int]:
    """The launch order of a dense call (q (b, s_q, h, d), k (b, s_k, h_kv, d)) on ``cfg``: None head-major (cfg as
    it is), 0 every head's longest key tile first (lpt_over_heads_variant), G > 0 so within groups of G (batch, kv
    head) pairs. Head-major where the short sequences' interleaved order is on (measured against head-major only)."""
    if not (cfg.causal and not cfg.deterministic and not cfg.varlen and not cfg.interleave_lengths):
        return None
    b, sq, h, d = q_shape
    _, sk, hk, _ = k_shape
    key_tiles = b * hk * -(-sk // TILE_N)
    if key_tiles <= LPT_OVER_HEADS_MAX_WAVES * host.sm_count() and b * h * sq * d * 8 <= LPT_OVER_HEADS_MAX_BYTES:
        return 0
    if d not in LPT_GROUP_HEAD_DIMS or b * hk <= LPT_GROUP_MANY_WAVES:
        return None
    return LPT_GROUP_MANY_WAVES


@functools.lru_cache(maxsize=256)
def lpt_over_heads_variant(cfg: BwdConfig, group: int = 0) -> BwdConfig:
    """``cfg`` with lpt_over_heads in groups of ``group`` (batch, kv head) pairs (0: every pair at once),
    remembered per variant (a cache lookup per call)."""
    return replace(cfg, lpt_over_heads=True, lpt_group=group)


@functools.lru_cache(maxsize=256)
def _split_variant(cfg: BwdConfig) -> Optional[BwdConfig]:
    """split_keys_variant, remembered per variant (the backward's host time counts at the few-wave sizes it is
    for)."""
    return split_keys_variant(cfg)


def dense_split_keys_plan(cfg: BwdConfig, q_shape, k_shape, diag: int) -> tuple[int, int]:
    """(split_edge, parts) of a dense call (q (b, s_q, h, d), k (b, s_k, h_kv, d)) on ``cfg``'s tiles:
    split_plans.split_keys_plan's (split key tiles, parts) causal, split_plan's (first split key tile, parts) over
    the key tiles' equal runs of query tiles (each walked by the GQA group's heads) non-causal; parts = 1: no
    split."""
    b, sq, h, _ = q_shape
    _, sk, hk, _ = k_shape
    if cfg.causal:
        return split_keys_plan(b * hk, h // hk, sq, sk, int(diag), cfg.tile_m, TILE_N, host.sm_count())
    return split_plan(b * hk * -(-sk // TILE_N), host.sm_count(), -(-sq // cfg.tile_m), unit_steps=h // hk)


def split_key_tile_count(cfg: BwdConfig, k_shape, plan) -> int:
    """How many key tiles a dense call's split plan splits (split_plans.split_tile_count on its key tiles)."""
    b, sk, hk, _ = k_shape
    return split_tile_count(cfg.causal, b * hk * -(-sk // TILE_N), plan[0])


_FAST: dict = {}  # (make_configs' arguments, shared, device) -> (its three configs, their compiled kernels)


def _compiled_configs(args: tuple, kw: dict, overrides: dict, *, shared: bool, device) -> tuple:
    """(pre, main, post configs, pre, main, post kernels) of one call: make_configs, check_resident and the compile
    cache's lookups, remembered per distinct call (their Python costs ~60 us of host per backward, and a training
    loop repeats a few calls) unless a measurement knob (overrides, FA4DIST_BWD_OVERRIDE) is set. ``shared``: a
    launch on shared rows runs the main kernel alone (no preprocess or convert compiled for it)."""
    key = None
    if not overrides and not _OVERRIDE:
        key = (args, tuple(kw.items()), shared, device)  # (launch_steps builds kw in one order)
        found = _FAST.get(key)
        if found is not None:
            return found
    pre_cfg, main_cfg, post_cfg = make_configs(*args, **kw, **overrides)
    check_resident(main_cfg)
    pre_fn = None if shared else host.get_compiled(pre_cfg)
    post_fn = None if shared or kw["grads"] == "dkv" else host.get_compiled(post_cfg)
    found = (pre_cfg, main_cfg, post_cfg, pre_fn, host.get_compiled(main_cfg), post_fn)
    if key is not None:
        if len(_FAST) > 256:
            _FAST.clear()
        _FAST[key] = found
    return found


def _kv_tiles(k, cu_seqlens_k) -> int:
    """The (key tile, key / value head) CTAs of a GQA launch: dense exactly, packed at most (each segment adds at
    most one partial tile)."""
    if cu_seqlens_k is None:
        return k.shape[0] * k.shape[2] * -(-k.shape[1] // TILE_N)
    return k.shape[1] * (k.shape[0] // TILE_N + cu_seqlens_k.shape[0] - 1)


def _expanded_kv_steps(dout, q, k, v, out, lse, dq, dk, dv, group, accumulate, deterministic, options):
    """A GQA backward as the kernel runs it without GQA: K and V copied to one head per query head, the backward
    (ticketed when deterministic) into dq and fp32 dK / dV per query head, then each key / value head's group of
    query heads summed in ascending head order (invariant.sum_group) into the caller's dk / dv (written, or added
    when accumulating). A GQA CTA walks its whole group of heads, so the launch's longest CTAs are group times
    longer and its tail with them (NOTES_BWD.md, twentieth session), and a launch of few key / value heads has few
    CTAs; expanded, every CTA is one head long. Costs 2 x group x |K| of K / V copies and 2 x group x |K| fp32 of
    dK / dV per query head in memory."""
    from ..invariant import sum_group

    heads = k.shape[-2] * group
    k_e, v_e = (torch.empty(*t.shape[:-2], heads, t.shape[-1], dtype=t.dtype, device=t.device) for t in (k, v))
    dk_e, dv_e = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k_e, v_e))

    def expand():
        for src, dst in ((k, k_e), (v, v_e)):
            dst.unflatten(-2, (-1, group)).copy_(src.unsqueeze(-2).expand(*src.shape[:-1], group, src.shape[-1]))
        if accumulate:
            dk_e.zero_()
            dv_e.zero_()

    def reduce():
        for dst, per_head in ((dk, dk_e), (dv, dv_e)):
            total = sum_group(per_head, group)
            dst.add_(total) if accumulate else dst.copy_(total)

    det = dict(det_dq="tickets") if deterministic else {}
    steps = launch_steps(dout, q, k_e, v_e, out, lse, dq, dk_e, dv_e, deterministic=deterministic,
                         accumulate=accumulate, **det, **options)
    return [expand] + steps + [reduce]


class BwdScratch(NamedTuple):
    """A backward's scratch (the preprocess's and the main kernel's vectors, bwd_preprocess.py), indexed by chunk =
    query tile x head: lse2 / dpsum tile_m fp32 words per chunk, clean one int32 per chunk, the dQ accumulator, and
    where the call has them the tickets (int32), the fixed-point rows' scales (lse2's indexing), the tile counter
    (zeroed by each main launch's own step) and the split variant's dK / dV parts."""
    lse2: torch.Tensor
    dpsum: torch.Tensor
    clean: torch.Tensor
    dq_acc: torch.Tensor
    sem: Optional[torch.Tensor]
    scale2: Optional[torch.Tensor]
    counter: Optional[torch.Tensor]
    split_dkv: Optional[torch.Tensor]


def make_scratch(device, n_chunks: int, tm: int, dq_acc: tuple, *, sem: Optional[int] = None,
                 row_scales: bool = False, counter: Optional[int] = None, split_dkv: Optional[int] = None):
    """One call's :class:`BwdScratch` in one allocation (host.carve): ``dq_acc`` is (numel, dtype), ``sem`` /
    ``counter`` int32 counts and ``split_dkv`` an fp32 count, None where the call has none."""
    rows = (n_chunks * tm, torch.float32)
    flags = -(-n_chunks // 4) * 4  # (whole 16-byte words: the tickets after them need no padding between)
    lse2, dpsum, dq, scale2, split, clean, sem, counter = host.carve(device, (
        rows, rows, dq_acc, rows if row_scales else None, None if split_dkv is None else (split_dkv, torch.float32),
        (flags, torch.int32), None if sem is None else (-(-sem // 4) * 4, torch.int32),
        None if counter is None else (counter, torch.int32)))
    return BwdScratch(lse2, dpsum, clean, dq, sem, scale2, counter, split)


class SharedRows:
    """The query side of one backward spread over many main-kernel launches on row ranges of the same queries (a
    ring's steps against the keys of every member): the preprocess (lse in log2 units, rowsum(dO * O), scratch
    zeroing) runs once over all rows, every launch adds its dQ into the one fp32 scratch, and one dQ convert at the
    end adds the sum into the caller's fp32 dq. A launch per step then costs the main kernel alone (the preprocess
    and the convert are full passes over the member's rows: about 3% of a ring step at 32k tokens per GPU).

    Queries: one dense sequence, ``(1, s, h, d)`` (a packed token range is its batch-1 view); a launch takes rows
    ``[q_start, q_start + n)`` whose ends fall on the scratch's query tiles (or the last row), so that no launch's
    padding rows are another launch's rows (:meth:`takes`). dQ differs from per-launch converts by the rounding of
    one fp32 sum instead of several; its order is the launch order, which the caller fixes."""

    def __init__(self, dout, q, out, lse, *, softmax_scale=None, deterministic=False, dlse=None):
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"SharedRows takes one dense sequence (1, s, h, d), got q {tuple(q.shape)}")
        if dlse is not None and (dlse.dtype != torch.float32 or tuple(dlse.shape) != tuple(lse.shape)):
            raise ValueError(f"dlse must be fp32 shaped like lse {tuple(lse.shape)}, got {dlse.dtype} "
                             f"{tuple(dlse.shape)}")
        d = q.shape[-1]
        self.q, self.heads, self.head_dim = q, q.shape[2], d
        self.tm = tm = tile_m_for(d)
        self.rows = q.shape[1]
        self.deterministic = bool(deterministic)
        scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d))
        # scratch of one sequence: query tile m of head h is chunk m * heads + h (SeqlenInfo.scratch_base = 0)
        n_chunks = max(-(-self.rows // tm), 1) * self.heads
        device = q.device
        self.lse2, self.dpsum, self.clean, self.dq_acc, self.sem, _, _, _ = make_scratch(
            device, n_chunks, tm, (n_chunks * tm * d, torch.float32), sem=n_chunks if deterministic else None)
        dout, out, lse = (t if t.stride(-1) == 1 else t.contiguous() for t in (dout, out, lse))
        if dlse is not None and dlse.stride(-1) != 1:  # (the preprocess takes a unit last stride, as lse's)
            dlse = dlse.contiguous()
        pre = PreConfig(o_dtype=host.dtype_name(out.dtype), do_dtype=host.dtype_name(dout.dtype), head_dim=d,
                        tile_m=tm, varlen=False, deterministic=self.deterministic, dlse=dlse is not None)
        self.post = host.get_compiled(PostConfig(dtype=host.dtype_name(q.dtype), dq_fp32=True, head_dim=d, tile_m=tm,
                                                 varlen=False, accumulate=True))
        if self.rows:
            host.get_compiled(pre)(out, dout, lse, dlse, self.lse2, self.dpsum, self.clean, self.dq_acc, self.sem, None,
                                   None, scale, 1, None)

    def takes(self, q_start: int, q_len: int) -> bool:
        """Whether rows [q_start, q_start + q_len) start on a scratch tile and end on one (or at the last row)."""
        end = q_start + q_len
        return q_len > 0 and end <= self.rows and q_start % self.tm == 0 and (end % self.tm == 0 or end == self.rows)

    def views(self, q_start: int, q_len: int, deterministic: bool):
        """(lse2, dpsum, clean, dq_acc, sem) of rows [q_start, q_start + q_len), laid out as a launch on those rows sees
        its own scratch."""
        if not self.takes(q_start, q_len):
            raise ValueError(f"rows [{q_start}, {q_start + q_len}) are not whole scratch tiles of {self.rows} rows")
        if bool(deterministic) != self.deterministic:
            raise ValueError("a launch on shared rows must match their deterministic setting")
        first = (q_start // self.tm) * self.heads  # the launch's first chunk
        tm, d = self.tm, self.head_dim
        return (self.lse2[first * tm:], self.dpsum[first * tm:], self.clean[first:], self.dq_acc[first * tm * d:],
                None if self.sem is None else self.sem[first:])

    def finish(self, dq: torch.Tensor) -> torch.Tensor:
        """Adds the launches' dQ into the fp32 dq of all rows (q's shape); returns dq."""
        if dq.dtype != torch.float32 or tuple(dq.shape) != tuple(self.q.shape):
            raise ValueError(f"dq must be fp32 of shape {tuple(self.q.shape)}, got {dq.dtype} {tuple(dq.shape)}")
        if self.rows:
            self.post(self.dq_acc, dq, None, 1, None)
        return dq


def backward_worklist(dout, q, k, v, out, lse, dq, dk, dv, table, *, scratch_tiles, max_q_len, max_k_len,
                      softmax_scale, causal, window_left=-1, softcap=None, rows: Optional[SharedRows] = None,
                      deterministic=False, write_dkv=False, dlse=None):
    """The gradients of a work list's items in one main-kernel launch, added into fp32 dq, dk, dv. Deterministic:
    the items' scratch tiles are pairwise disjoint too, and each query tile takes its item's key tiles' dQ in the
    tickets' fixed order (as for the segments of a packed call); otherwise dQ goes through unordered atomic adds.

    Packed views: dout / q / out (t_q, h, d), k / v (t_k, h_kv, d), lse (h, t_q), dq (t_q, h, d), dk / dv (t_k, h_kv,
    d), all fp32 gradients. ``table``: int32 CUDA tensor, block_info.WORKLIST_COLUMNS words per item; the items'
    key rows are pairwise disjoint (a key tile's dK / dV are added by one CTA), and their scratch tiles (column 5)
    too. Without ``rows``: the launch's own preprocess and dQ convert run over the items' rows, the items' query
    rows pairwise disjoint and the scratch ``scratch_tiles`` query tiles long. With ``rows`` (a :class:`SharedRows`
    of these queries, ``dq`` unused): every item's rows start on one of its tiles, column 5 is that tile, and only
    the main kernel runs (its dQ is in the shared scratch until ``rows.finish``). ``write_dkv``: the items' key
    rows of dk / dv hold nothing yet: written (``0 + x``, the bits of the add into zeros), not added into.
    ``dlse`` (fp32, lse's layout): the lse's gradient, which joins the launch's own preprocess's row sums (with
    ``rows``, the shared side's preprocess has it: not given here)."""
    d, hq = q.shape[-1], q.shape[-2]
    tm = tile_m_for(d)
    scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d))
    window_left = host.check_window_left(window_left, causal)
    softcap = host.check_softcap(softcap)
    if dout.dtype != q.dtype:
        raise ValueError("a work-list backward takes dout in q's dtype")
    pre_cfg, main_cfg, post_cfg = make_configs(
        q.dtype, d, causal=causal, varlen=True, seg_offsets=False, accumulate=True, deterministic=deterministic,
        dq_dtype=torch.float32, dkv_dtype=torch.float32, o_dtype=out.dtype, do_dtype=dout.dtype,
        window_left=window_left, softcap=softcap, worklist=True, dlse=dlse is not None)
    if dlse is not None and (rows is not None or dlse.dtype != torch.float32 or dlse.shape != lse.shape):
        raise ValueError(f"dlse must be fp32 shaped like lse {tuple(lse.shape)} (and not with shared rows, whose "
                         f"preprocess takes it), got {dlse.dtype} {tuple(dlse.shape)}")
    if dlse is not None and dlse.stride(-1) != 1:
        dlse = dlse.contiguous()
    if write_dkv:  # the main kernel's accumulate is its dK / dV store's; dQ still goes through the scratch
        main_cfg = replace(main_cfg, accumulate=False)
    check_resident(main_cfg)
    main_fn = host.get_compiled(main_cfg)
    scale_log2 = host.score_scale(scale, softcap)
    msk = max(int(max_k_len), 1)
    if rows is not None:
        sem = rows.sem
        if bool(deterministic) != rows.deterministic:
            raise ValueError("a launch on shared rows must match their deterministic setting")
        if sem is not None:
            sem.zero_()  # the tickets count this launch's key tiles from 0 again
        clean = rows.clean if main_cfg.takes_clean_flags else None
        main_fn(*BwdKernelArgs(q=q, k=k, v=v, dout=dout, lse2=rows.lse2, dpsum=rows.dpsum, clean=clean,
                               dq_acc=rows.dq_acc, dk=dk, dv=dv, sem=sem, dq_scale=None, scale=scale,
                               scale_log2=scale_log2, diag=0, max_seqlen_k=msk, cu_seqlens_q=table,
                               tile_counter=host.tile_counter(main_cfg.takes_tile_counter, q.device)))
        return dq, dk, dv
    n_chunks = max(int(scratch_tiles), 1) * hq
    # (clean is written by the preprocess, which zeroes dq_acc and the tickets)
    lse2, dpsum, clean, dq_acc, sem, _, counter, _ = make_scratch(
        q.device, n_chunks, tm, (n_chunks * tm * d, torch.float32), sem=n_chunks if deterministic else None,
        counter=1 if main_cfg.takes_tile_counter else None)
    m_grid = max(1, -(-int(max_q_len) // tm))
    host.get_compiled(pre_cfg)(out, dout, lse, dlse, lse2, dpsum, clean, dq_acc, sem, None, None, scale, m_grid,
                               table)
    main_fn(*BwdKernelArgs(q=q, k=k, v=v, dout=dout, lse2=lse2, dpsum=dpsum,
                           clean=clean if main_cfg.takes_clean_flags else None, dq_acc=dq_acc, dk=dk, dv=dv, sem=sem,
                           dq_scale=None, scale=scale, scale_log2=scale_log2, diag=0, max_seqlen_k=msk,
                           cu_seqlens_q=table, tile_counter=None if counter is None else counter.zero_()))
    host.get_compiled(post_cfg)(dq_acc, dq, None, m_grid, table)
    return dq, dk, dv
