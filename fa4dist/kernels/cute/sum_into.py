"""Fused in-order sums (Hopper; SIMT, memory bound): ``dst += src_0 + src_1 + ... + src_{n-1}`` for flat fp32
tensors of one length, added left to right in fp32 with one rounding per addition, so the bits are those of
``dst.add_(src_0); dst.add_(src_1); ...`` while every tensor is read once and ``dst`` written once (n + 2 passes
over the length instead of 3n). The ring backward adds a launch group's returned dK / dV partials with it
(context_parallel/ring.py, ``add_returns``).

Each thread adds 4 consecutive floats (16-byte loads and stores); the length must be a multiple of 4 and every
tensor 16-byte aligned. This module imports cutlass at import time: import it lazily (:func:`sum_into` callers
check ``host.cutlass_importable()`` first)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, const_expr

from . import host

MAX_SOURCES = 8  # sources per launch; longer lists are added in launches of this many, in order
_THREADS = 256
_VEC = 4  # floats per thread: one 16-byte vector


@dataclass(frozen=True)
class SumIntoConfig:
    sources: int  # 1 .. MAX_SOURCES

    def build(self):
        return SumInto(self.sources)

    def fake_args(self):
        flats = [host.fake_flat(cutlass.Float32) for _ in range(1 + MAX_SOURCES)]
        return (*flats, host.fake_stream())


def supported(dst: torch.Tensor, sources) -> bool:
    """Whether :func:`sum_into` takes these tensors as they are (else the caller adds with torch)."""
    tensors = [dst, *sources]
    return (dst.is_cuda and dst.numel() > 0 and dst.numel() % _VEC == 0
            and all(t.dtype == torch.float32 and t.device == dst.device and t.is_contiguous()
                    and t.numel() == dst.numel() and t.data_ptr() % 16 == 0 for t in tensors)
            and torch.cuda.get_device_capability(dst.device)[0] == 9)


def sum_into(dst: torch.Tensor, sources) -> bool:
    """``dst += sources[0] + sources[1] + ...`` in that order (the bits of the in-place adds in turn); False (and
    nothing done) where not :func:`supported`."""
    sources = list(sources)
    if not sources or not supported(dst, sources):
        return False
    flat = dst.view(-1)
    for at in range(0, len(sources), MAX_SOURCES):
        part = [s.view(-1) for s in sources[at:at + MAX_SOURCES]]
        padded = part + [flat] * (MAX_SOURCES - len(part))  # (not read: the count is compiled in)
        host.get_compiled(SumIntoConfig(len(part)))(flat, *padded)
    return True


class SumInto:
    def __init__(self, sources: int):
        assert 1 <= sources <= MAX_SOURCES
        self.sources = sources

    @cute.jit
    def __call__(self, mDst: cute.Tensor, mS0: cute.Tensor, mS1: cute.Tensor, mS2: cute.Tensor, mS3: cute.Tensor,
                 mS4: cute.Tensor, mS5: cute.Tensor, mS6: cute.Tensor, mS7: cute.Tensor, stream):
        n = cute.size(mDst.shape[0])
        per_cta = _THREADS * _VEC
        self.kernel(mDst, mS0, mS1, mS2, mS3, mS4, mS5, mS6, mS7).launch(
            grid=(cute.ceil_div(n, per_cta), 1, 1), block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mDst: cute.Tensor, mS0: cute.Tensor, mS1: cute.Tensor, mS2: cute.Tensor, mS3: cute.Tensor,
               mS4: cute.Tensor, mS5: cute.Tensor, mS6: cute.Tensor, mS7: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        chunk = bidx * _THREADS + tidx  # this thread's 4 floats
        if chunk * _VEC < cute.size(mDst.shape[0]):
            acc = cute.make_rmem_tensor((_VEC,), Float32)
            cute.autovec_copy(cute.local_tile(mDst, (_VEC,), (chunk,)), acc)
            for j, src in enumerate((mS0, mS1, mS2, mS3, mS4, mS5, mS6, mS7)):
                if const_expr(j < self.sources):
                    add = cute.make_rmem_tensor((_VEC,), Float32)
                    cute.autovec_copy(cute.local_tile(src, (_VEC,), (chunk,)), add)
                    for i in cutlass.range_constexpr(_VEC):
                        acc[i] = acc[i] + add[i]  # left to right, one rounding each: the in-place adds' bits
            cute.autovec_copy(acc, cute.local_tile(mDst, (_VEC,), (chunk,)))
