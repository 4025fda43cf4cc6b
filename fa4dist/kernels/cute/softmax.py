"""Online softmax of the forward: the running row max and row sums of one thread's rows, the O rescale, and the
finalisation into (1 / rowsum, lse); and soft-capping, the transform of the scores both kernels apply before the
mask and the exponential (``softcap_scores``, with the backward's derivative ``softcap_grad_fp16``).

Scores arrive as fp32 accumulator fragments (rows = queries); exp2 runs with the softmax scale folded into one
FFMA. The running row max is kept in the exponential's units (score * scale_log2, rounded once), so the factor of
the old terms is exp2 of the difference of two stored maxima: exactly 1 while the max holds. With
``rescale_threshold`` > 0 a stale row max is kept until the new one exceeds it by more than the
threshold (log2 units), so P stays below 2^threshold and O is rescaled only when some row of the warp moved; the
final normalisation is exact either way. Soft-capped scores are bounded (|c tanh| <= c), so with
``fixed_row_max`` the row max is a constant instead (``softcap_fixed_row_max``): no max reductions, no O rescale.

This module imports cutlass at import time: import it lazily.
"""

from dataclasses import dataclass
from typing import Any, Optional

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .common_sm90 import mn_view

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def sum4(terms, init=None):
    """Sum of a Python list of traced scalars (after ``init``) with 4 running partial sums (unrolled at trace time):
    short dependency chains and only 4 live temporaries (a full tree needs many, and then ptxas
    reuses the registers of the in-flight P operand and delays the softmax past the PV wait)."""
    if init is not None:  # a running total the terms add to: it leads the first chain
        terms = [init] + list(terms)
    n = len(terms)
    if n < 8:
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t
        return acc
    part = [terms[0], terms[1], terms[2], terms[3]]
    for i in range(4, n - n % 4, 4):
        for j in range(4):
            part[j] = part[j] + terms[i + j]
    for i in range(n - n % 4, n):
        part[0] = part[0] + terms[i]
    return (part[0] + part[1]) + (part[2] + part[3])


def max_chains(terms):
    """The max of a Python list of traced fp32 scalars as four interleaved linear chains of ``max.f32`` (flash-attn-
    4's form; unrolled at trace time). ``max.f32`` returns the other operand where one is NaN, unlike the
    TensorSSA reduce's ``max.NaN.f32``: a row holding a NaN score gets a finite max, and its P, sum and out are NaN
    through the NaN score itself, as before."""
    part = list(terms[:4])
    for i, t in enumerate(terms[4:]):
        part[i % 4] = cute.arch.fmax(part[i % 4], t)
    while len(part) > 1:
        part = [cute.arch.fmax(part[k], part[k + 1]) if k + 1 < len(part) else part[k]
                for k in range(0, len(part), 2)]
    return part[0]


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running max / partial sums of this thread's rows (one register each; the 4 threads of a row each hold a
    partial sum, reduced at the end). Frozen: the state lives in the two register tensors. ``row_max`` is in log2
    units: the largest score times scale_log2 (positive: the cute backend refuses other scales)."""

    row_max: Any
    row_sum: Any
    scale_log2: Any
    rescale_threshold: float
    # a constant row max (in the accumulator's units) in place of the running one: bounded (capped) scores only
    fixed_row_max: Optional[float] = None
    # the old, rescaled row sum leads the new block's partial sums (else it is added after them): see online()
    sum_from_old: bool = False
    # the row max as flash-attn-4 takes it (max_chains) instead of the TensorSSA reduce's tree
    chained_max: bool = False

    @staticmethod
    def create(nrows: int, scale_log2: Float32, rescale_threshold: float,
               fixed_row_max: Optional[float] = None, sum_from_old: bool = False,
               chained_max: bool = False) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(nrows, Float32)
        row_sum = cute.make_rmem_tensor(nrows, Float32)
        row_max.fill(-Float32.inf if fixed_row_max is None else Float32(fixed_row_max) * scale_log2)
        row_sum.fill(0.0)
        return OnlineSoftmax(row_max, row_sum, scale_log2, rescale_threshold, fixed_row_max, sum_from_old,
                             chained_max)

    @cute.jit
    def online(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """Turn S into unnormalised P in place; update running max / partial sums.
        Returns per-row factors for O (1.0 where the max was kept; None with a fixed row max: O keeps its scale)."""
        row_max, row_sum, scale_log2 = self.row_max, self.row_sum, self.scale_log2
        acc_mn = mn_view(acc_S)
        if const_expr(self.fixed_row_max is not None):
            for r in cutlass.range_constexpr(cute.size(row_max)):
                acc_mn[r, None].store(cute.math.exp2(acc_mn[r, None].load() * scale_log2 - row_max[r], fastmath=True))
                p_sum = sum4([acc_mn[r, c] for c in range(cute.size(acc_mn, mode=[1]))])
                row_sum[r] = p_sum if const_expr(is_first) else row_sum[r] + p_sum
            return None
        row_scale = cute.make_rmem_tensor_like(row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            vals = acc_mn[r, None].load()
            # as Float32, so that every step of the quad's reduction is one max.f32 (a generic scalar gets a
            # NaN-propagating compare-and-select, 3 instructions; a NaN score makes its row NaN through P anyway)
            if const_expr(self.chained_max):
                m_cur = max_chains([acc_mn[r, c] for c in range(cute.size(acc_mn, mode=[1]))])
            else:
                m_cur = Float32(vals.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
            m_cur = cute.arch.warp_reduction_max(m_cur, threads_in_group=4) * scale_log2
            m_old = row_max[r]
            m_new = cute.arch.fmax(m_old, m_cur)
            if const_expr(not is_first and self.rescale_threshold > 0.0):
                # keep the stale max unless it grew by more than the threshold (log2 units):
                # P stays <= 2^threshold and the final normalisation is exact either way
                if m_new - m_old <= self.rescale_threshold:  # (both -inf: NaN, m_new stays -inf either way)
                    m_new = m_old
            row_max[r] = m_new
            m_safe = m_new
            if m_new == -Float32.inf:
                m_safe = Float32(0.0)
            # (one FFMA: the score's product unrounded, so the row's largest P is exp2 of m_safe's own rounding
            # error, 1 within an ulp)
            p = cute.math.exp2(vals * scale_log2 - m_safe, fastmath=True)
            acc_mn[r, None].store(p)
            terms = [acc_mn[r, c] for c in range(cute.size(acc_mn, mode=[1]))]
            # the old terms' factor from the difference of the stored maxima: exactly 2^0 = 1 while the max
            # holds. Maxima stored unscaled made it exp2(m_old * scale_log2 - m_safe * scale_log2) with one product
            # fused into the subtraction (FFMA): m * scale_log2's own rounding error then (up to 2^-24 of it), whose
            # exp2 is 1 + ~1 ulp, taken by row sum and O every tile: out kept its value but the lse drifted by one
            # ulp of 1 a key tile (1.5e-5 at 16500 keys on 176-key tiles, 2.8e-5 at 32k: bench/split_error.py)
            if const_expr(self.sum_from_old and not is_first):
                # the old sum, rescaled, leads the first of the short chains (flash-attn-4's order): the O
                # factor's exp2 is then on the sum's critical path, ptxas issues it among the first exponentials,
                # and the O rescale's FMULs fill the MUFU queue's shadow instead of following the last exponential
                sc = cute.math.exp2(m_old - m_safe, fastmath=True)
                row_scale[r] = sc
                row_sum[r] = sum4(terms, row_sum[r] * sc)
            else:
                # pairwise tree: short dependency chains instead of one serial FADD chain (the sum before the O
                # factor, in the order the kernels without sum_from_old were measured and PTX-compared in)
                p_sum = sum4(terms)
                if const_expr(is_first):
                    row_scale[r] = Float32(1.0)
                    row_sum[r] = p_sum
                else:
                    sc = cute.math.exp2(m_old - m_safe, fastmath=True)
                    row_scale[r] = sc
                    row_sum[r] = row_sum[r] * sc + p_sum
        return row_scale

    @cute.jit
    def rescale_o(self, acc_O: cute.Tensor, row_scale):
        if const_expr(self.fixed_row_max is not None):
            return  # the row max never moves
        acc_mn = mn_view(acc_O)
        if const_expr(self.rescale_threshold > 0.0):
            need = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                need = need | (row_scale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(need):
                for r in cutlass.range_constexpr(cute.size(row_scale)):
                    acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])
        else:
            for r in cutlass.range_constexpr(cute.size(row_scale)):
                acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, r: cutlass.Constexpr[int], sees_key, sink=None):
        """(the O scale, natural-log lse) of this thread's row r; ``sees_key``: the mask shows the row a key.
        Without a sink the O scale is 1 / row sum. ``sink`` (a learned logit, natural-log units, GPT-OSS): one more
        virtual key of that score and value 0 joins the row's denominator: the result is exactly the merge of the
        row with the sink (fa4dist.kernels.merge.merge_sink_), which a row that sees no key leaves at (0, sink);
        a +inf or NaN sink is a non-finite score every row sees, so every row gets (NaN, NaN) (merge_sink_'s rule;
        rows that see keys get it from the arithmetic below, a row that sees none from the O scale 0 * NaN)."""
        s = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
        inv = Float32(0.0)
        lse = -Float32.inf
        if const_expr(sink is not None):
            lse = sink
            if not sink < Float32.inf:  # +inf or NaN (NaN compares false)
                inv = Float32.nan
                lse = Float32.nan
        if sees_key:
            inv = cute.arch.rcp_approx(s)  # 1/0 = inf and NaN stay non-finite: 0 * inf = NaN out
            lse = Float32.nan
            if s > Float32(0.0):
                m = self.row_max[r]
                if const_expr(sink is None):
                    lse = (m + cute.math.log2(s, fastmath=True)) * LN_2
                else:
                    sink_log2 = sink * Float32(LOG2_E)
                    # shift by the larger of the row max and the sink: neither exponential overflows
                    top = m if m > sink_log2 else sink_log2
                    e_row = cute.math.exp2(m - top, fastmath=True)
                    total = s * e_row + cute.math.exp2(sink_log2 - top, fastmath=True)
                    inv = e_row * cute.arch.rcp_approx(total)
                    lse = (top + cute.math.log2(total, fastmath=True)) * LN_2
        return inv, lse


@cute.jit
def nan_max(a: Float32, b: Float32) -> Float32:
    """max(a, b) that is NaN when either is (a split tile's parts merge so: a NaN lse makes the row NaN)."""
    m = a if a > b else b  # NaN b: b; NaN a: b, so a is checked again
    if a != a:
        m = a
    return m


@cute.jit
def merge_lse(lse_old: Float32, lse_new: Float32):
    """(w_old, w_new, lse) of merging a normalised partial result with lse_new into one with lse_old:
    out = w_old * out_old + w_new * out_new. A -inf side weighs 0 (both -inf: keep the old, w = (1, 0)); a NaN
    lse on either side gives NaN weights and lse."""
    m = lse_old if lse_old > lse_new else lse_new  # NaN-propagating max (NaN compares false)
    w_old = Float32(1.0)
    w_new = Float32(0.0)
    lse = lse_old
    if m != -Float32.inf:
        e_old = cute.math.exp2((lse_old - m) * LOG2_E, fastmath=True)
        e_new = cute.math.exp2((lse_new - m) * LOG2_E, fastmath=True)
        tot = e_old + e_new
        lse = m + cute.math.log2(tot, fastmath=True) * LN_2
        rt = cute.arch.rcp_approx(tot)
        w_old = e_old * rt
        w_new = e_new * rt
    return w_old, w_new, lse


# ---------------- soft-capping: scores -> c * tanh(softmax_scale * s / c) ----------------
# The kernels keep tanh(softmax_scale * s / c) in the accumulator and let the exponential scale it by c * log2(e),
# so a softcap variant receives tanh_scale = softmax_scale / c where the others receive softmax_scale * log2(e).


def softcap_scale_log2(softcap: float) -> float:
    """The exponential's scale of capped scores: c * log2(e)."""
    return softcap * LOG2_E


# With a fixed row max of `shift` (natural-log units), P = exp(capped score - shift) lies in
# [e^(-c - shift), e^(c - shift)]; it is kept within [e^-80, e^20]. Every P is then a normal fp32 / bf16 number
# (the smallest normal is e^-87.3: nothing underflows that the running max would keep, and the row sum's relative
# precision does not depend on its magnitude). The price is headroom: O accumulates P * v with P up to e^20
# instead of 1, so it overflows fp32 once |v| * keys reaches e^68.7 (~7e29) instead of e^88.7. fp16 P (normal
# range e^-9.7 .. e^11) is too narrow for any useful c: fp16 keeps the running max. c = 50 (Gemma 2's
# attention) is the largest cap that fits.
FIXED_MAX_P_LN = 20.0
FIXED_MIN_P_LN = -80.0


def softcap_fixed_row_max(softcap: float, fp16: bool) -> Optional[float]:
    """The constant row max, in the accumulator's units (tanh values, which the exponential scales by
    c * log2(e)), that replaces the running max for scores capped at ``softcap``; None where the range of P
    does not allow one (fp16, or c > 50)."""
    if softcap <= 0 or fp16:
        return None
    shift = max(0.0, softcap - FIXED_MAX_P_LN)
    if -softcap - shift < FIXED_MIN_P_LN:
        return None
    return shift / softcap


@cute.jit
def softcap_scores(acc: cute.Tensor, tanh_scale: Float32):
    """acc <- tanh(acc * tanh_scale), elementwise (any fragment layout; before the mask, which then writes -inf).
    The hardware tanh (tanh.approx.f32, one MUFU op, relative error about 2^-11, as flash-attn-4 uses): the
    accurate tanh is two MUFU ops and a dozen FMAs per score, and the MUFU unit already carries every exp2, so it
    made the capped forward 0.57x the uncapped one on the H200 (2026-12-01)."""
    acc_mn = mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = cute.math.tanh(acc_mn[r, c] * tanh_scale, fastmath=True)


@cute.jit
def softcap_grad_fp16(acc: cute.Tensor) -> cute.Tensor:
    """d(capped score) / d(scaled score) = 1 - tanh^2 of capped scores ``acc`` (tanh values), as fp16 registers
    shaped like ``acc``: the backward computes it beside the exponential and multiplies it into dS after the dP
    MMA. fp16 holds [0, 1] to 2^-11 relative (below dS's own bf16 rounding) in half the registers of fp32.
    32 more live registers per thread on a 64-row query tile (hdim 128 spills a few bytes and still wins); 128-row
    tiles take ``softcap_grad_from_p`` (backward.default_softcap_grad_regs)."""
    g = cute.make_rmem_tensor_like(acc, cutlass.Float16)
    t = acc.load()
    g.store((1.0 - t * t).to(cutlass.Float16))
    return g


@cute.jit
def softcap_grad_from_p(p: Float32, u_offset: Float32, inv_exp_scale: Float32) -> Float32:
    """The same 1 - tanh^2 recovered from P = exp2(tanh * a - lse2), a = c * log2(e), without keeping tanh:
    tanh = log2(P) / a + lse2 / a (``u_offset`` = lse2 / a, per query; ``inv_exp_scale`` = 1 / a). One more MUFU
    op per score. P == 0 gives log2 = -inf and the clamp at 0 makes the factor 0, so dS = 0 there without a
    select (1 - tanh^2 is never negative, so the clamp changes nothing else)."""
    u = cute.math.log2(p, fastmath=True) * inv_exp_scale + u_offset
    return cute.arch.fmax(Float32(1.0) - u * u, Float32(0.0))
