"""Row maxima of |x| (Hopper; SIMT, memory bound): max |x| over the last dim of every row of a 16-bit tensor,
for the fixed-point dq's scales (fixed_point.absmax / head_absmax). torch's reductions read such rows at ~0.9
TB/s on the H200 (bench/scale_maxima.py); this reads them in 16-byte vectors, head_dim / 8 threads per row.

The maximum is taken on the bits: for non-negative floats the integer order of (bits & 0x7fff) is the value
order, so the result is exact in any order, a NaN in the row wins (its bits exceed inf's: NaN propagates, as
in torch), then an inf. finite_only: entries at or above inf's bits (inf, NaN) count as 0. The result is written
in the input's dtype (as 16-bit patterns): converting it to fp64 is exact.

This module imports cutlass at import time: import it lazily (fixed_point.absmax checks that cutlass imports)."""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int16, Int32, const_expr

from . import host

INF_BITS = {"bf16": 0x7F80, "fp16": 0x7C00}
_THREADS = 256


@dataclass(frozen=True)
class RowAbsMaxConfig:
    head_dim: int  # the row length: a power of two from 8 to 256 (head_dim / 8 threads reduce a row by shuffles)
    dtype: str  # "bf16" | "fp16": inf's bits (finite_only)
    finite_only: bool

    def build(self):
        return RowAbsMax(self.head_dim, INF_BITS[self.dtype], self.finite_only)

    def fake_args(self):
        rows = host.fake_tensor(cutlass.Int16, (cute.sym_int(), self.head_dim), 8)
        return rows, host.fake_flat(cutlass.Int16), host.fake_stream()


def supported(t: torch.Tensor) -> bool:
    """Whether :func:`row_absmax` takes ``t`` as it is (else the caller reduces with torch)."""
    d = t.shape[-1] if t.dim() else 0
    return (t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and t.dim() >= 2 and t.numel() > 0
            and d in (8, 16, 32, 64, 128, 256) and t.is_contiguous() and host.aligned(t)
            and torch.cuda.get_device_capability(t.device)[0] == 9)


def row_absmax(t: torch.Tensor, finite_only: bool = False) -> Optional[torch.Tensor]:
    """max |t| over the last dim, shaped ``t.shape[:-1]``, in t's dtype (exact); None where not :func:`supported`."""
    if not supported(t):
        return None
    d = t.shape[-1]
    out = torch.empty(t.shape[:-1], dtype=t.dtype, device=t.device)
    cfg = RowAbsMaxConfig(d, host.dtype_name(t.dtype), bool(finite_only))
    host.get_compiled(cfg)(t.view(torch.int16).view(-1, d), out.view(torch.int16).view(-1))
    return out


class RowAbsMax:
    def __init__(self, head_dim: int, inf_bits: int, finite_only: bool):
        self.vec = 8  # 16-bit elements per thread: one 16-byte load
        self.tpr = head_dim // self.vec  # threads per row
        assert self.tpr * self.vec == head_dim and self.tpr & (self.tpr - 1) == 0 and self.tpr <= 32
        self.rows_per_cta = _THREADS // self.tpr
        self.inf_bits = inf_bits
        self.finite_only = finite_only

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, stream):
        n = cute.size(mX.shape[0])
        self.kernel(mX, mOut).launch(grid=(cute.ceil_div(n, self.rows_per_cta), 1, 1), block=[_THREADS, 1, 1],
                                     stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.tpr
        col = tidx % self.tpr
        in_rows = row < cute.size(mX.shape[0])
        m = Int32(0)
        if in_rows:
            bits = cute.make_rmem_tensor((self.vec,), Int16)
            cute.autovec_copy(cute.local_tile(mX[row, None], (self.vec,), (col,)), bits)
            for i in cutlass.range_constexpr(self.vec):
                a = Int32(bits[i]) & Int32(0x7FFF)  # |x| (the sign extension of the 16 bits cleared too)
                if const_expr(self.finite_only):
                    a = a if a < Int32(self.inf_bits) else Int32(0)
                m = cutlass.max(m, a)
        # every lane of the warp shuffles (rows past the end carry 0)
        m = cute.arch.warp_reduction_max(m, threads_in_group=self.tpr)
        if in_rows and col == 0:
            mOut[row] = Int16(m)
