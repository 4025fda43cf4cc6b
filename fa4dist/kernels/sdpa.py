"""Backends on torch's fused attention ops that return the LSE (GPU only).

- ``sdpa_flash``: ``aten._flash_attention_forward/_backward`` (FlashAttention-2 inside torch): dense and packed
  layouts, native GQA, head dims up to 256.
- ``sdpa_cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its backward: dense layout, equal head counts,
  head dims up to 128.
- ``sdpa``: cuDNN where it applies (it is the faster of the two on Hopper), flash otherwise.

Their masks are "none" and "causal aligned on the diagonal".  Any causal block of a single alignment is split by
:func:`fa4dist.kernels.mask.causal_decomposition` into at most three such sub-blocks whose results are merged by
:mod:`fa4dist.kernels.merge`; a packed batch whose segments need different decompositions is not expressible and
goes to the reference (the registry says so once).  Masked calls run under :mod:`fa4dist.kernels.guard`, so
non-finite values at masked positions cannot leak into visible rows through the ops' tiles.

Sliding windows: only the flash op has them (``window_size_left/right``, aligned on the bottom-right corner of the
call).  A dense block of one alignment is cut by :func:`fa4dist.kernels.mask.band_decomposition` into at most two
row ranges, each one windowed call over just the keys its rows see (rows that see nothing are never launched); a
packed batch goes in one call when every segment is square and aligned (q and k offsets equal), else to the
reference.  Softcap is not compiled into torch's flash build: calls with ``softcap`` go to the reference.  Sinks
need nothing from the ops (the contract merges them).  A negative ``softmax_scale`` is refused (the ops mask raw
scores with -inf before scaling them: "auto" takes the reference).
"""

from __future__ import annotations

import contextlib

import torch

from .guard import guarded_backward, guarded_causal_backward, guarded_causal_forward, guarded_forward
from .mask import BandBlock, SubBlock, band_decomposition, causal_decomposition
from .merge import merge_into_
from .problem import AttentionProblem, accum_dtype
from .registry import Unsupported

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------------------------
# one fused call each: q (B, Sq, H, D) / packed (T, H, D); returns out in q's dtype and lse (B, H, Sq) / (H, T)


def _flash_forward(q, k, v, scale, causal, cu_q=None, cu_k=None, max_q=None, max_k=None, window=(-1, -1)):
    if cu_q is None:
        max_q, max_k = q.shape[1], k.shape[1]
    out, lse, *_ = aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                                                 window_size_left=window[0], window_size_right=window[1])
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, scale, causal, cu_q=None, cu_k=None, max_q=None, max_k=None,
                    window=(-1, -1)):
    if cu_q is None:
        max_q, max_k = q.shape[1], k.shape[1]
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    return aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
        window_size_left=window[0], window_size_right=window[1],
    )


def packed_flash_window(problem: AttentionProblem) -> tuple[int, int]:
    """flash-attn's window of a packed batch of square, aligned segments: the mask's own sides, one of at least
    the longest key segment (the op's max_seqlen_k) as -1.  The op reads such a side as unbounded itself, but only
    after narrowing it to a C int: a side of 2**32 + 1 (legal, below 2**62) would reach it as 1."""
    mask = problem.mask
    sides = (mask.window[0], -1 if mask.hi is None else mask.hi)
    return tuple(-1 if side >= problem.seqlen_k else side for side in sides)


def flash_window(blk: BandBlock) -> tuple[int, int]:
    """flash-attn's (window_size_left, window_size_right) for a band block: its windows count from the diagonal
    through the bottom-right corner (key ``i + k_len - q_len``); -1 is unbounded."""
    shift = blk.k_len - blk.q_len
    left = -1 if blk.lo is None else shift - blk.lo
    right = -1 if blk.hi is None else blk.hi - shift
    assert left >= -1 and right >= -1 and (left >= 0 or blk.lo is None) and (right >= 0 or blk.hi is None), blk
    return left, right


def _cudnn_forward(q, k, v, scale, causal):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale
    )
    return out.transpose(1, 2), lse.reshape(q.shape[0], q.shape[2], q.shape[1])


def _cudnn_backward(dout, q, k, v, out, lse, scale, causal):
    batch, seqlen_q, heads, _ = q.shape
    # dout and out always compact (batch, seqlen, heads, dim) (no copy for the usual compact ones): on torch 2.11
    # (H200) the cuDNN backward read them with the strides of the first call's (a cached graph), so (batch, heads,
    # seqlen, dim) views after compact ones (a forward's out over a head-major q, say) gave wrong gradients silently.
    dout, out = dout.contiguous(), out.contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, S, H, D) -> (B, H, S, D) views
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        t(dout), t(q), t(k), t(v), t(out), lse.reshape(batch, heads, seqlen_q, 1).contiguous(),
        seed, offset, None, None, None, seqlen_q, k.shape[1], 0.0, causal, scale=scale,
    )
    return t(dq), t(dk), t(dv)


@contextlib.contextmanager
def _deterministic_algorithms(enabled: bool):
    """torch's flash backward reads the global deterministic flag (and only the strict setting: with
    warn_only=True it stays non-deterministic, seen on torch 2.11); set it for the duration of one call."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    switch = enabled and (not before or warn_only)
    if switch:
        torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        if switch:
            torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _head_dim_compact(*tensors):
    """The tensors with a strided head dim copied compact: torch's fused ops refuse one deep inside (flash: "Input
    tensor must have contiguous last dimension", cuDNN's frontend likewise); any other layout is passed as is."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


# ---------------------------------------------------------------------------------------------------------------


def _single_segment_plan(problem: AttentionProblem) -> list[SubBlock]:
    return causal_decomposition(
        problem.seqlen_q, problem.seqlen_k, problem.q_offsets[0], problem.k_offsets[0], problem.mask
    )


def _packed_window_ok(problem: AttentionProblem) -> bool:
    """A packed windowed batch is one flash call if every segment is square and aligned (its band is the same on
    local indices and every row sees at least itself)."""
    return all(ql == kl and qo == ko for _, _, ql, _, kl, qo, ko in problem.segments())


def _packed_kind(problem: AttentionProblem):
    """For a packed batch: 'full' or 'causal' if one fused call computes every segment exactly, else None."""
    kinds = set()
    for _, _, ql, _, kl, qo, ko in problem.segments():
        blocks = causal_decomposition(ql, kl, qo, ko, problem.mask)
        if len(blocks) != 1 or (blocks[0].q_len, blocks[0].k_len) != (ql, kl):
            return None  # a segment with masked-out rows, an empty side, or several sub-blocks
        kinds.add("causal" if blocks[0].aligned_causal else "full")
    return kinds.pop() if len(kinds) == 1 else None


class _FusedBackend:
    name = ""
    priority = 0
    fused_epilogue = False
    max_head_dim = 256
    packed = True
    windows = False  # the op has window_size_left/right

    def available(self, device) -> bool:
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    def supports(self, problem: AttentionProblem, direction: str):
        if problem.device.type != "cuda":
            return Unsupported(f"{self.name} runs on CUDA tensors only, got device {problem.device}")
        if problem.dtype not in (torch.float16, torch.bfloat16):
            return Unsupported(f"{self.name} takes float16 or bfloat16, got {problem.dtype}")
        d = problem.head_dim
        if d != problem.head_dim_v or d % 8 or d > self.max_head_dim:
            return Unsupported(
                f"{self.name} needs equal q/k/v head dims that are multiples of 8 up to {self.max_head_dim}, "
                f"got {d} and {problem.head_dim_v}"
            )
        if problem.softmax_scale <= 0:
            # the ops mask raw scores with -inf and scale them in their exp2: a negative scale makes a masked pair
            # +inf (and a row's max its smallest scaled score), as in cute
            return Unsupported(f"{self.name} needs a positive softmax_scale, got {problem.softmax_scale}")
        if problem.softcap is not None:
            return Unsupported(f"{self.name} has no softcap (torch builds flash without it)", fallback=True)
        if problem.mask.windowed and not self.windows:
            return Unsupported(f"{self.name} has no sliding window", fallback=True)
        if problem.varlen:
            if not self.packed:
                return Unsupported(f"{self.name} has no packed (cu_seqlens) layout", fallback=True)
            if problem.mask.windowed:
                if not _packed_window_ok(problem):
                    return Unsupported("a packed sliding window needs square, aligned segments", fallback=True)
            elif _packed_kind(problem) is None:
                return Unsupported("segments need different masks or have masked-out rows", fallback=True)
        elif not problem.uniform_offsets:
            return Unsupported("per-sequence offsets differ within the batch", fallback=True)
        return None

    # each subclass: _fwd(q, k, v, scale, aligned_causal), _bwd(dout, q, k, v, out, lse, scale, aligned_causal)

    def _block_fwd(self, q, k, v, scale, aligned_causal):
        if not aligned_causal:  # no masked pair: nothing can leak
            return self._fwd(q, k, v, scale, False)
        return guarded_causal_forward(lambda *t: self._fwd(*t, scale, True), q, k, v)

    def _block_bwd(self, dout, q, k, v, out, lse, scale, aligned_causal):
        if not aligned_causal:
            return self._bwd(dout, q, k, v, out, lse, scale, False)
        return guarded_causal_backward(lambda *t: self._bwd(*t[:5], t[5].contiguous(), scale, True),
                                       dout, q, k, v, out, lse)

    def _windowed_forward(self, problem: AttentionProblem, q, k, v):
        """A sliding window (flash only): one call per band block, under the guard with the block's band."""
        mask, scale = problem.mask, problem.softmax_scale
        if problem.varlen:  # square aligned segments: the band is the mask's own on every segment
            cq, ck = problem.device_cu_seqlens()
            window = packed_flash_window(problem)
            return guarded_forward(lambda *t: _flash_forward(*t, scale, False, cq, ck, problem.seqlen_q,
                                                             problem.seqlen_k, window), q, k, v, mask.lo, mask.hi, cq)
        acc = accum_dtype(q.dtype)  # (fp64: the CPU emulation in the tests)
        out = torch.zeros(problem.out_shape(), dtype=acc, device=q.device)
        lse = torch.full(problem.lse_shape(), float("-inf"), dtype=acc, device=q.device)
        for blk in band_decomposition(problem.seqlen_q, problem.seqlen_k, problem.q_offsets[0], problem.k_offsets[0],
                                      mask):
            rows, keys = slice(blk.q_start, blk.q_start + blk.q_len), slice(blk.k_start, blk.k_start + blk.k_len)
            window = flash_window(blk)
            o, block_lse = guarded_forward(lambda *t: _flash_forward(*t, scale, False, window=window),
                                           q[:, rows], k[:, keys], v[:, keys], blk.lo, blk.hi)
            out[:, rows], lse[:, :, rows] = o, block_lse  # the blocks' rows are disjoint
        return out, lse

    def _windowed_backward(self, problem: AttentionProblem, dout, q, k, v, out, lse):
        mask, scale = problem.mask, problem.softmax_scale
        if problem.varlen:
            cq, ck = problem.device_cu_seqlens()
            window = packed_flash_window(problem)
            return guarded_backward(
                lambda do_, q_, k_, v_, o_, l_: _flash_backward(do_, q_, k_, v_, o_, l_.contiguous(), scale, False, cq,
                                                                ck, problem.seqlen_q, problem.seqlen_k, window),
                dout, q, k, v, out, lse, mask.lo, mask.hi, cq)
        acc = accum_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for blk in band_decomposition(problem.seqlen_q, problem.seqlen_k, problem.q_offsets[0], problem.k_offsets[0],
                                      mask):
            rows, keys = slice(blk.q_start, blk.q_start + blk.q_len), slice(blk.k_start, blk.k_start + blk.k_len)
            window = flash_window(blk)
            g = guarded_backward(
                lambda do_, q_, k_, v_, o_, l_: _flash_backward(do_, q_, k_, v_, o_, l_.contiguous(), scale, False,
                                                                window=window),
                dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows], blk.lo, blk.hi)
            dq[:, rows] += g[0]
            dk[:, keys] += g[1]
            dv[:, keys] += g[2]
        return dq, dk, dv

    def forward(self, problem: AttentionProblem, q, k, v):
        q, k, v = _head_dim_compact(q, k, v)
        if problem.mask.windowed:
            return self._windowed_forward(problem, q, k, v)
        if problem.varlen:
            cq, ck = problem.device_cu_seqlens()
            fwd = lambda q_, k_, v_, causal: _flash_forward(  # noqa: E731
                q_, k_, v_, problem.softmax_scale, causal, cq, ck, problem.seqlen_q, problem.seqlen_k)
            if _packed_kind(problem) == "causal":
                return guarded_causal_forward(lambda *t: fwd(*t, True), q, k, v, cq)
            return fwd(q, k, v, False)
        blocks = _single_segment_plan(problem)
        if len(blocks) == 1 and (blocks[0].q_len, blocks[0].k_len) == (problem.seqlen_q, problem.seqlen_k):
            return self._block_fwd(q, k, v, problem.softmax_scale, blocks[0].aligned_causal)
        out = torch.zeros(problem.out_shape(), dtype=torch.float32, device=q.device)
        lse = torch.full(problem.lse_shape(), float("-inf"), dtype=torch.float32, device=q.device)
        for blk in blocks:
            rows, keys = slice(blk.q_start, blk.q_start + blk.q_len), slice(blk.k_start, blk.k_start + blk.k_len)
            o, block_lse = self._block_fwd(q[:, rows], k[:, keys], v[:, keys], problem.softmax_scale,
                                           blk.aligned_causal)
            merge_into_(out[:, rows], lse[:, :, rows], o, block_lse)
        return out, lse

    def backward(self, problem: AttentionProblem, dout, q, k, v, out, lse, deterministic):
        dout, q, k, v, out = _head_dim_compact(dout.to(q.dtype), q, k, v, out.to(q.dtype))
        with _deterministic_algorithms(deterministic):
            if problem.mask.windowed:
                return self._windowed_backward(problem, dout, q, k, v, out, lse)
            if problem.varlen:
                cq, ck = problem.device_cu_seqlens()
                bwd = lambda do_, q_, k_, v_, o_, l_, causal: _flash_backward(  # noqa: E731
                    do_, q_, k_, v_, o_, l_.contiguous(), problem.softmax_scale, causal,
                    cq, ck, problem.seqlen_q, problem.seqlen_k)
                if _packed_kind(problem) == "causal":
                    return guarded_causal_backward(lambda *t: bwd(*t, True), dout, q, k, v, out, lse, cq)
                return bwd(dout, q, k, v, out, lse, False)
            blocks = _single_segment_plan(problem)
            if len(blocks) == 1 and (blocks[0].q_len, blocks[0].k_len) == (problem.seqlen_q, problem.seqlen_k):
                return self._block_bwd(dout, q, k, v, out, lse.contiguous(), problem.softmax_scale,
                                       blocks[0].aligned_causal)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
            for blk in blocks:
                rows, keys = slice(blk.q_start, blk.q_start + blk.q_len), slice(blk.k_start, blk.k_start + blk.k_len)
                g = self._block_bwd(
                    dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                    lse[:, :, rows].contiguous(), problem.softmax_scale, blk.aligned_causal,
                )
                dq[:, rows] += g[0]
                dk[:, keys] += g[1]
                dv[:, keys] += g[2]
            return dq, dk, dv


class SdpaFlashBackend(_FusedBackend):
    name = "sdpa_flash"
    priority = 10
    windows = True

    def _fwd(self, q, k, v, scale, causal):
        return _flash_forward(q, k, v, scale, causal)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal):
        return _flash_backward(dout, q, k, v, out, lse, scale, causal)


class SdpaCudnnBackend(_FusedBackend):
    name = "sdpa_cudnn"
    priority = 5  # reached through "sdpa", which prefers it where it applies
    max_head_dim = 128
    packed = False

    def available(self, device) -> bool:
        return super().available(device) and torch.backends.cudnn.is_available()

    def supports(self, problem: AttentionProblem, direction: str):
        if problem.heads_q != problem.heads_kv:
            return Unsupported(f"{self.name} needs as many key/value heads as query heads (no GQA)", fallback=True)
        return super().supports(problem, direction)

    def _fwd(self, q, k, v, scale, causal):
        return _cudnn_forward(q, k, v, scale, causal)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal):
        return _cudnn_backward(dout, q, k, v, out, lse, scale, causal)


class SdpaBackend:
    """cuDNN where it applies and the call need not be deterministic, else torch's flash."""

    name = "sdpa"
    priority = 20
    fused_epilogue = False

    def __init__(self, cudnn: SdpaCudnnBackend, flash: SdpaFlashBackend):
        self._cudnn, self._flash = cudnn, flash

    def available(self, device) -> bool:
        return self._flash.available(device)

    def _pick(self, problem, direction, deterministic=False):
        cudnn = self._cudnn
        if not deterministic and cudnn.available(problem.device) and cudnn.supports(problem, direction) is None:
            return cudnn
        return self._flash

    def supports(self, problem, direction):
        return self._pick(problem, direction).supports(problem, direction)

    def forward(self, problem, q, k, v):
        return self._pick(problem, "forward").forward(problem, q, k, v)

    def backward(self, problem, dout, q, k, v, out, lse, deterministic):
        return self._pick(problem, "backward", deterministic).backward(problem, dout, q, k, v, out, lse, deterministic)
