"""Online softmax of the forward: the running row max and row sums of one thread's rows, the O rescale, and the
finalisation into (1 / rowsum, lse).

Scores arrive as fp32 accumulator fragments (rows = queries); exp2 runs with the softmax scale folded into one
FFMA. With ``rescale_threshold`` > 0 a stale row max is kept until the new one exceeds it by more than the
threshold (log2 units), so P stays below 2^threshold and O is rescaled only when some row of the warp moved; the
final normalisation is exact either way.

This module imports cutlass at import time: import it lazily.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .common_sm90 import mn_view


def sum4(terms):
    """Sum of a Python list of traced scalars with 4 running partial sums (unrolled at trace time):
    short dependency chains and only 4 live temporaries (a full tree needs many, and then ptxas
    reuses the registers of the in-flight P operand and delays the softmax past the PV wait)."""
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


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running max / partial sums of this thread's rows (one register each; the 4 threads of a row each hold a
    partial sum, reduced at the end). Frozen: the state lives in the two register tensors."""

    row_max: Any
    row_sum: Any
    scale_log2: Any
    rescale_threshold: float

    @staticmethod
    def create(nrows: int, scale_log2: Float32, rescale_threshold: float) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(nrows, Float32)
        row_sum = cute.make_rmem_tensor(nrows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(row_max, row_sum, scale_log2, rescale_threshold)

    @cute.jit
    def online(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """Turn S into unnormalised P in place; update running max / partial sums.
        Returns per-row factors for O (1.0 where the max was kept)."""
        row_max, row_sum, scale_log2 = self.row_max, self.row_sum, self.scale_log2
        acc_mn = mn_view(acc_S)
        row_scale = cute.make_rmem_tensor_like(row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            vals = acc_mn[r, None].load()
            m_cur = vals.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            m_cur = cute.arch.warp_reduction_max(m_cur, threads_in_group=4)
            m_old = row_max[r]
            m_new = cute.arch.fmax(m_old, m_cur)
            if const_expr(not is_first and self.rescale_threshold > 0.0):
                # keep the stale max unless it grew by more than the threshold (log2 units):
                # P stays <= 2^threshold and the final normalisation is exact either way
                grow = (m_new - m_old) * scale_log2
                if grow <= self.rescale_threshold:  # NaN (both -inf) also lands here: fine
                    m_new = m_old
            row_max[r] = m_new
            m_safe = m_new
            if m_new == -Float32.inf:
                m_safe = Float32(0.0)
            m_scaled = m_safe * scale_log2
            p = cute.math.exp2(vals * scale_log2 - m_scaled, fastmath=True)
            acc_mn[r, None].store(p)
            # pairwise tree: short dependency chains instead of one serial FADD chain
            p_sum = sum4([acc_mn[r, c] for c in range(cute.size(acc_mn, mode=[1]))])
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                row_sum[r] = p_sum
            else:
                sc = cute.math.exp2(m_old * scale_log2 - m_scaled, fastmath=True)
                row_scale[r] = sc
                row_sum[r] = row_sum[r] * sc + p_sum
        return row_scale

    @cute.jit
    def rescale_o(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
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
