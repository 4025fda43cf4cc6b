"""Compile cache and launch wrapper for the Hopper forward kernel (fwd_sm90.py).

Everything that touches cutlass is imported lazily, so `import fa4dist` works without it.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (64, 96, 128)
_TORCH_DTYPES = (torch.bfloat16, torch.float16)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class KernelConfig:
    """Every static parameter of one compiled variant (the compile-cache key)."""

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
    # row of the warp moved (vote.any); 0: exact max, always rescale. The two were within noise of each other
    # on the H200 except +5% for 0.0 at hdim 128, S 8k-16k in one run (NOTES.md); 8.0 is the configuration
    # the full GPU test suite ran on.
    rescale_threshold: float = 8.0
    tma_store_o: bool = True  # dense non-accumulate 16-bit out: O via smem + TMA store (else direct stores)


def default_tiles(head_dim: int, causal: bool) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_stages) for a head dim."""
    if head_dim <= 64:
        return 192, 128, 2
    if head_dim <= 96:
        return 128, 128, 2
    return 128, 128, 2


_OVERRIDE: dict = {}


def set_tile_override(**kw) -> None:
    """Development hook: force fields of KernelConfig (tile_m=..., intra_wg_overlap=..., ...)."""
    _OVERRIDE.clear()
    _OVERRIDE.update(kw)
    _FAST.clear()


def make_config(dtype, head_dim, *, causal, varlen, accumulate, seg_offsets=False, out_fp32=False,
                **overrides) -> KernelConfig:
    tm, tn, st = default_tiles(head_dim, causal)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, dtype)
    kw = dict(
        dtype=name, head_dim=head_dim, causal=bool(causal), varlen=bool(varlen), accumulate=bool(accumulate),
        seg_offsets=bool(seg_offsets) and bool(causal), out_fp32=bool(out_fp32) and not accumulate,
        tile_m=tm, tile_n=tn, num_stages=st,
    )
    kw.update(_OVERRIDE)
    kw.update(overrides)
    return KernelConfig(**kw)


# ----------------------------------------------------------------------------
# availability / support
# ----------------------------------------------------------------------------

_AVAILABLE = None


def cutlass_importable() -> bool:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:
        return False
    return True


def is_available() -> bool:
    """cutlass-dsl (+ tvm-ffi) importable and the current CUDA device is an sm_90 GPU."""
    global _AVAILABLE
    if _AVAILABLE is None:
        ok = torch.cuda.is_available()
        if ok:
            major, _ = torch.cuda.get_device_capability()
            ok = major == 9
        _AVAILABLE = bool(ok and cutlass_importable())
    return _AVAILABLE


def _aligned(t: torch.Tensor, elems: int) -> bool:
    if t.stride(-1) != 1:
        return False
    if any(s % elems for s in t.stride()[:-1]):
        return False
    return t.data_ptr() % 16 == 0


def check_qkv(q, k, v, head_dims, *, cu_seqlens_q=None, cu_seqlens_k=None, what="kernel"):
    """(ok, reason) for the q/k/v properties every CuTe kernel needs (shared by forward and backward).

    The contract (fa4dist.kernels.problem) validated the call already; these are the kernels' own limits."""
    if q.dtype not in _TORCH_DTYPES:
        return False, f"dtype {q.dtype} not supported (bf16/fp16 only)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return False, "q, k, v must share a dtype"
    d = q.shape[-1]
    if d not in head_dims:
        return False, f"head dim {d} not supported by the cute sm90 {what} (supported: {head_dims})"
    if k.shape[-1] != d or v.shape[-1] != d:
        return False, "q, k, v head dims must match"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False, "tensors must be on a CUDA device"
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        return False, "heads_q must be a multiple of heads_kv"
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        return False, "cu_seqlens_q and cu_seqlens_k must be given together"
    if q.dim() != (3 if varlen else 4):
        return False, "q must be (b, s, h, d) or packed (t, h, d)"
    for t in (q, k):
        if t.numel() and max(s * n for s, n in zip(t.stride(), t.shape)) >= _INT32_MAX:
            return False, "tensor too large for 32-bit indexing"
    return True, ""


def supports(q, k, v, causal=False, *, cu_seqlens_q=None, cu_seqlens_k=None, accumulate=False, out=None, lse=None):
    """(ok, reason). Checks what the kernel itself can take; the caller validated the contract."""
    ok, reason = check_qkv(q, k, v, SUPPORTED_HEAD_DIMS, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if not ok:
        return ok, reason
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _aligned(t, 8):
            return False, f"{name} needs a contiguous last dim, 16-byte aligned base and strides"
    if out is not None:
        if out.dtype != torch.float32 and (accumulate or out.dtype != q.dtype):
            return False, "out must be fp32 (or q's dtype when not accumulating)"
        if not _aligned(out, 16 // out.element_size()):
            return False, "out needs a contiguous last dim, 16-byte aligned base and strides"
    if lse is not None and (lse.dtype != torch.float32 or lse.stride(-1) != 1):
        return False, "lse must be fp32 with a contiguous last dim"
    return True, ""


# ----------------------------------------------------------------------------
# compile cache
# ----------------------------------------------------------------------------

_CACHE: dict = {}  # KernelConfig -> compiled function
_FAST: dict = {}  # (dtype, d, causal, varlen, accumulate, seg_offsets, out_fp32) -> compiled, default tiles
_LOCK = threading.Lock()


def _cutlass_dtype(name):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[name]


def _fake_args(cfg: KernelConfig):
    """Fake tensors describing every runtime argument of a variant (no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = _cutlass_dtype(cfg.dtype)
    D = cfg.head_dim

    def fake(dtype, shape, div):
        stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
        return make_fake_tensor(dtype, shape, stride=stride, assumed_align=16 if div > 1 else 4)

    out_fp32 = cfg.accumulate or cfg.out_fp32
    out_dt = cutlass.Float32 if out_fp32 else dt
    out_div = 4 if out_fp32 else 8
    h, hk = cute.sym_int(), cute.sym_int()
    if not cfg.varlen:
        b, sq, sk = cute.sym_int(), cute.sym_int(), cute.sym_int()
        q = fake(dt, (b, sq, h, D), 8)
        k = fake(dt, (b, sk, hk, D), 8)
        v = fake(dt, (b, sk, hk, D), 8)
        o = fake(out_dt, (b, sq, h, D), out_div)
        lse = fake(cutlass.Float32, (b, h, sq), 1)
        cu_q = cu_k = None
        nb = b
    else:
        tq, tk, nb1, nb = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
        q = fake(dt, (tq, h, D), 8)
        k = fake(dt, (tk, hk, D), 8)
        v = fake(dt, (tk, hk, D), 8)
        o = fake(out_dt, (tq, h, D), out_div)
        lse = fake(cutlass.Float32, (h, tq), 1)
        cu_q = make_fake_tensor(cutlass.Int32, (nb1,), stride=(1,), assumed_align=4)
        cu_k = make_fake_tensor(cutlass.Int32, (nb1,), stride=(1,), assumed_align=4)
    if cfg.seg_offsets:
        off_q = make_fake_tensor(cutlass.Int32, (nb,), stride=(1,), assumed_align=4)
        off_k = make_fake_tensor(cutlass.Int32, (nb,), stride=(1,), assumed_align=4)
    else:
        off_q = off_k = None
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(1), cu_q, cu_k, off_q, off_k, stream)


def build_kernel_object(cfg: KernelConfig):
    from .fwd_sm90 import FlashFwdSm90

    return FlashFwdSm90(
        _cutlass_dtype(cfg.dtype), cfg.head_dim, causal=cfg.causal, varlen=cfg.varlen, accumulate=cfg.accumulate,
        seg_offsets=cfg.seg_offsets, tile_m=cfg.tile_m, tile_n=cfg.tile_n, num_stages=cfg.num_stages,
        intra_wg_overlap=cfg.intra_wg_overlap, sched_barrier=cfg.sched_barrier,
        rescale_threshold=cfg.rescale_threshold, tma_store_o=cfg.tma_store_o,
    )


def compile_variant(cfg: KernelConfig, *, tvm_ffi: bool = True, extra_options: str = ""):
    """Compile one variant (works without a GPU when CUTE_DSL_ARCH=sm_90a is set)."""
    import cutlass.cute as cute

    obj = build_kernel_object(cfg)
    opts = "--enable-tvm-ffi" if tvm_ffi else ""
    if extra_options:
        opts = (opts + " " + extra_options).strip()
    return cute.compile(obj, *_fake_args(cfg), options=opts)


def get_compiled(cfg: KernelConfig):
    fn = _CACHE.get(cfg)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(cfg)
            if fn is None:
                if "CUTE_DSL_ARCH" not in os.environ:
                    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
                fn = compile_variant(cfg)
                _CACHE[cfg] = fn
    return fn


def cache_info() -> list:
    return list(_CACHE.keys())


# ----------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------


_OFFSET_CACHE: dict = {}


def offsets_tensor(values, device) -> torch.Tensor:
    """int32 device tensor of per-sequence offsets, cached by value (one H2D copy per distinct tuple)."""
    key = (tuple(int(x) for x in values), str(device))
    t = _OFFSET_CACHE.get(key)
    if t is None:
        if len(_OFFSET_CACHE) > 64:
            _OFFSET_CACHE.clear()
        t = torch.tensor(key[0], dtype=torch.int32, device=device)
        _OFFSET_CACHE[key] = t
    return t


def _int32_offsets(x, n, device):
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return offsets_tensor([int(x)] * n, device)
        return x.to(device=device, dtype=torch.int32).contiguous()
    if isinstance(x, (list, tuple)):
        return offsets_tensor(x, device)
    return offsets_tensor([int(x)] * n, device)


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
    **overrides,
):
    """Run the Hopper forward into `out` / `lse` (in place). Inputs are assumed validated.

    Dense: q (b, s_q, h, d), k/v (b, s_k, h_kv, d), out like q, lse (b, h, s_q) fp32.
    Varlen: q (t_q, h, d), k/v (t_k, h_kv, d), cu_seqlens_* int32 (nseg+1,), lse (h, t_q).
    out: q's dtype or fp32; with accumulate=True it must be fp32 and out / lse hold a running result into
    which this block is merged (in place).
    q_offset / k_offset: ints, or per sequence / segment (list, tuple or int32 tensor of shape (nseg,)).
    max_seqlen_q: varlen only, the longest q segment; if None the grid is sized by total_q (correct, no host
    sync, but launches idle CTAs).  max_seqlen_k is unused.
    """
    varlen = cu_seqlens_q is not None
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    nseq = (cu_seqlens_q.shape[0] - 1) if varlen else q.shape[0]
    per_seq = not (isinstance(q_offset, int) and isinstance(k_offset, int))
    diag = 0
    off_q = off_k = None
    if causal:
        if per_seq:
            off_q = _int32_offsets(q_offset, nseq, q.device)
            off_k = _int32_offsets(k_offset, nseq, q.device)
        else:
            diag = int(q_offset) - int(k_offset)
            if abs(diag) > _INT32_MAX // 2:
                raise ValueError("q_offset - k_offset out of int32 range")
    seg_offsets = causal and per_seq
    out_fp32 = out.dtype == torch.float32
    if accumulate and not out_fp32:
        raise ValueError("accumulate=True needs an fp32 out")
    # degenerate sizes: nothing to launch, or no keys at all (TMA descriptors need non-empty tensors)
    total_q = q.shape[0] * (1 if varlen else q.shape[1])
    if total_q == 0 or nseq == 0:
        return out, lse
    if k.shape[0] == 0 or (not varlen and k.shape[1] == 0):
        if not accumulate:
            out.zero_()
            lse.fill_(-math.inf)
        return out, lse
    fast_key = (q.dtype, d, causal, varlen, accumulate, seg_offsets, out_fp32)
    fn = _FAST.get(fast_key) if not overrides and not _OVERRIDE else None
    if fn is None:
        cfg = make_config(q.dtype, d, causal=causal, varlen=varlen, accumulate=accumulate,
                          seg_offsets=seg_offsets, out_fp32=out_fp32, **overrides)
        fn = get_compiled(cfg)
        if not overrides and not _OVERRIDE:
            _FAST[fast_key] = fn
    if varlen:
        msq = int(max_seqlen_q) if max_seqlen_q is not None else int(q.shape[0])
        msq = max(msq, 1)
    else:
        msq = 1
    scale_log2 = float(softmax_scale) * math.log2(math.e)
    fn(q, k, v, out, lse, scale_log2, diag, msq, cu_seqlens_q, cu_seqlens_k, off_q, off_k)
    return out, lse
