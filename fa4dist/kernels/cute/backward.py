"""Python entry point of the Hopper backward: preprocess -> main kernel -> dQ convert.

    from fa4dist.kernels.cute.backward import backward, supports_backward
    ok, why = supports_backward(q, k, v, dq=dq, dk=dk, dv=dv, accumulate=False, ...)
    backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=..., causal=..., q_offset=0, k_offset=0,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             deterministic=False, accumulate=False)

Writes dq/dk/dv in place: fresh buffers (q dtype or fp32) are overwritten; with accumulate=True the block's
gradients are added to fp32 buffers (never rounded in between). Everything that touches cutlass is imported
lazily, so `import fa4dist` works without it. Steady-state calls do no host synchronisation (pass
max_seqlen_q / max_seqlen_k for packed input, otherwise the grids are sized by the token counts).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import torch

BWD_HEAD_DIMS = (64, 128)
_TORCH_DTYPES = (torch.bfloat16, torch.float16)
_INT32_MAX = 2**31 - 1
TILE_N = 128


def dq_scratch_elements(total_q: int, num_seqs: int, heads_q: int, head_dim: int) -> int:
    """fp32 elements of the dQ accumulation scratch (query tiles of every sequence and head), 32-bit indexed."""
    tm = tile_m_for(head_dim)
    return (total_q // tm + num_seqs + 1) * heads_q * tm * head_dim


def tile_m_for(head_dim: int) -> int:
    # 64 for both head dims: with d = 64 a 128-row query tile (FA3's choice) spills on the MMA warpgroups
    return 64


# ----------------------------------------------------------------------------
# static configurations (compile-cache keys: plain Python values only)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MainConfig:
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    causal: bool
    varlen: bool
    seg_offsets: bool
    accumulate: bool
    deterministic: bool
    dkv_fp32: bool  # dk/dv buffers are fp32 (always when accumulating)
    tile_m: int
    dv_early: bool = False  # GPU run 1: issuing dV after dS is 4-15 % faster
    stmatrix_ds: bool = True  # GPU run 2: 26/26 tests, main kernel 2-6 % faster than 16-bit stores
    det_chunk: int = 0  # deterministic launch order in chunks of key tiles (0: off); prepared, not yet measured
    regs_mma: int = 240


@dataclass(frozen=True)
class PreConfig:
    o_dtype: str  # "bf16" | "fp16" | "fp32"
    do_dtype: str
    head_dim: int
    tile_m: int
    varlen: bool
    deterministic: bool


@dataclass(frozen=True)
class PostConfig:
    dtype: str  # q dtype
    dq_fp32: bool
    head_dim: int
    tile_m: int
    varlen: bool
    accumulate: bool


_OVERRIDE: dict = {}


def set_main_override(**kw) -> None:
    """Development hook: force fields of MainConfig (dv_early=..., stmatrix_ds=..., regs_mma=...)."""
    _OVERRIDE.clear()
    _OVERRIDE.update(kw)


def _env_override():
    """FA4DIST_BWD_OVERRIDE="stmatrix_ds=1,dv_early=0": the same hook from the environment (tests, benches)."""
    spec = os.environ.get("FA4DIST_BWD_OVERRIDE", "").strip()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, val = item.partition("=")
        if key in ("dv_early", "stmatrix_ds"):
            _OVERRIDE[key] = val.strip().lower() in ("1", "true", "yes")
        elif key in ("regs_mma", "det_chunk"):
            _OVERRIDE[key] = int(val)


_env_override()


_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _cutlass_dtype(name):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}[name]


# ----------------------------------------------------------------------------
# fake arguments (compile without a GPU)
# ----------------------------------------------------------------------------


def _fake(dtype, shape, div):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=16 if div > 1 else 4)


def _fake_flat(dtype):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=16)


def _fake_i32(n=None):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Int32, (n if n is not None else cute.sym_int(),), stride=(1,), assumed_align=4)


def _qkv_shapes(varlen, D):
    import cutlass.cute as cute

    h, hk = cute.sym_int(), cute.sym_int()
    if not varlen:
        b, sq, sk = cute.sym_int(), cute.sym_int(), cute.sym_int()
        return (b, sq, h, D), (b, sk, hk, D), (b, h, sq)
    tq, tk = cute.sym_int(), cute.sym_int()
    return (tq, h, D), (tk, hk, D), (h, tq)


def _main_fake_args(cfg: MainConfig):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    dt = _cutlass_dtype(cfg.dtype)
    qs, ks, _ = _qkv_shapes(cfg.varlen, cfg.head_dim)
    q, k, v, do = _fake(dt, qs, 8), _fake(dt, ks, 8), _fake(dt, ks, 8), _fake(dt, qs, 8)
    gdt, gdiv = (cutlass.Float32, 4) if cfg.dkv_fp32 else (dt, 8)
    dk, dv = _fake(gdt, ks, gdiv), _fake(gdt, ks, gdiv)
    lse2, dps, dqacc = _fake_flat(cutlass.Float32), _fake_flat(cutlass.Float32), _fake_flat(cutlass.Float32)
    sem = _fake_flat(cutlass.Int32) if cfg.deterministic else None
    cu_q = cu_k = off_q = off_k = None
    if cfg.varlen:
        nb1 = cute.sym_int()
        cu_q, cu_k = _fake_i32(nb1), _fake_i32(nb1)
    if cfg.seg_offsets:
        nb = cute.sym_int()
        off_q, off_k = _fake_i32(nb), _fake_i32(nb)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, v, do, lse2, dps, dqacc, dk, dv, sem, cutlass.Float32(1.0), cutlass.Float32(1.0),
            cutlass.Int32(0), cutlass.Int32(1), cu_q, cu_k, off_q, off_k, stream)


def _pre_fake_args(cfg: PreConfig):
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    qs, _, ls = _qkv_shapes(cfg.varlen, cfg.head_dim)
    odt, dodt = _cutlass_dtype(cfg.o_dtype), _cutlass_dtype(cfg.do_dtype)
    o = _fake(odt, qs, 16 // (odt.width // 8))
    do = _fake(dodt, qs, 16 // (dodt.width // 8))
    lse = _fake(cutlass.Float32, ls, 1)
    lse2, dps, dqacc = _fake_flat(cutlass.Float32), _fake_flat(cutlass.Float32), _fake_flat(cutlass.Float32)
    sem = _fake_flat(cutlass.Int32) if cfg.deterministic else None
    cu_q = _fake_i32() if cfg.varlen else None
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (o, do, lse, lse2, dps, dqacc, sem, cutlass.Float32(1.0), cutlass.Int32(1), cu_q, stream)


def _post_fake_args(cfg: PostConfig):
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    qs, _, _ = _qkv_shapes(cfg.varlen, cfg.head_dim)
    gdt, gdiv = (cutlass.Float32, 4) if cfg.dq_fp32 else (_cutlass_dtype(cfg.dtype), 8)
    dq = _fake(gdt, qs, gdiv)
    dqacc = _fake_flat(cutlass.Float32)
    cu_q = _fake_i32() if cfg.varlen else None
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (dqacc, dq, cutlass.Int32(1), cu_q, stream)


def build_object(cfg):
    if isinstance(cfg, MainConfig):
        from .bwd_sm90 import FlashBwdSm90

        return FlashBwdSm90(
            _cutlass_dtype(cfg.dtype), cfg.head_dim, causal=cfg.causal, varlen=cfg.varlen,
            accumulate=cfg.accumulate, deterministic=cfg.deterministic, seg_offsets=cfg.seg_offsets,
            tile_m=cfg.tile_m, dv_early=cfg.dv_early, stmatrix_ds=cfg.stmatrix_ds, det_chunk=cfg.det_chunk,
            regs_mma=cfg.regs_mma,
        )
    if isinstance(cfg, PreConfig):
        from .bwd_preprocess import BwdPreprocess

        return BwdPreprocess(cfg.head_dim, cfg.tile_m, varlen=cfg.varlen, deterministic=cfg.deterministic)
    from .bwd_postprocess import BwdPostprocess

    return BwdPostprocess(_cutlass_dtype(cfg.dtype), cfg.head_dim, cfg.tile_m, varlen=cfg.varlen,
                          accumulate=cfg.accumulate)


def fake_args(cfg):
    if isinstance(cfg, MainConfig):
        return _main_fake_args(cfg)
    if isinstance(cfg, PreConfig):
        return _pre_fake_args(cfg)
    return _post_fake_args(cfg)


def compile_config(cfg, *, tvm_ffi: bool = True, extra_options: str = ""):
    """Compile one kernel (works without a GPU when CUTE_DSL_ARCH=sm_90a is set)."""
    import cutlass.cute as cute

    opts = "--enable-tvm-ffi" if tvm_ffi else ""
    if extra_options:
        opts = (opts + " " + extra_options).strip()
    return cute.compile(build_object(cfg), *fake_args(cfg), options=opts)


_CACHE: dict = {}
_LOCK = threading.Lock()
AOT_ENV = "FA4DIST_BWD_AOT_DIR"  # optional folder of ahead-of-time compiled variants (see export_aot)


_SOURCE_DIGEST = None


def _source_digest() -> str:
    """Digest of the kernel sources, so that an AOT object built from other code is never loaded."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        import hashlib

        h = hashlib.sha1()
        here = os.path.dirname(os.path.abspath(__file__))
        for name in ("bwd_sm90.py", "bwd_preprocess.py", "bwd_postprocess.py", "common_sm90.py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(f.read())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def config_key(cfg) -> str:
    """Stable file/symbol name of a config: its repr (every static parameter) and the kernel sources."""
    import hashlib

    return "fa4bwd_" + hashlib.sha1((repr(cfg) + _source_digest()).encode()).hexdigest()[:20]


def export_aot(cfg, out_dir: str) -> str:
    """Compile `cfg` (no GPU needed) and write it as a TVM-FFI object file that get_compiled can load."""
    os.makedirs(out_dir, exist_ok=True)
    name = config_key(cfg)
    path = os.path.join(out_dir, name + ".o")
    compile_config(cfg).export_to_c(path, function_name=name)
    return path


def _load_aot(cfg):
    folder = os.environ.get(AOT_ENV)
    if not folder:
        return None
    name = config_key(cfg)
    path = os.path.join(folder, name + ".o")
    if not os.path.exists(path):
        return None
    try:
        import cutlass.cute as cute

        return getattr(cute.runtime.load_module(path, enable_tvm_ffi=True), name)
    except Exception as exc:  # fall back to compiling
        import logging

        logging.getLogger("fa4dist.kernels").warning("cute backward: AOT load of %s failed (%s)", path, exc)
        return None


def get_compiled(cfg):
    fn = _CACHE.get(cfg)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(cfg)
            if fn is None:
                os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
                fn = _load_aot(cfg)
                if fn is None:
                    fn = compile_config(cfg)
                _CACHE[cfg] = fn
    return fn


def cache_info() -> list:
    return list(_CACHE.keys())


def make_configs(q_dtype, head_dim, *, causal, varlen, seg_offsets, accumulate, deterministic, dq_dtype, dkv_dtype,
                 o_dtype, do_dtype, **overrides):
    tm = tile_m_for(head_dim)
    name = _NAMES[q_dtype]
    kw = dict(
        dtype=name, head_dim=head_dim, causal=bool(causal), varlen=bool(varlen), seg_offsets=bool(seg_offsets),
        accumulate=bool(accumulate), deterministic=bool(deterministic), dkv_fp32=dkv_dtype == torch.float32,
        tile_m=tm,
    )
    kw.update(_OVERRIDE)
    kw.update(overrides)
    main = MainConfig(**kw)
    pre = PreConfig(o_dtype=_NAMES[o_dtype], do_dtype=_NAMES[do_dtype], head_dim=head_dim, tile_m=tm,
                    varlen=bool(varlen), deterministic=bool(deterministic))
    post = PostConfig(dtype=name, dq_fp32=dq_dtype == torch.float32, head_dim=head_dim, tile_m=tm,
                      varlen=bool(varlen), accumulate=bool(accumulate))
    return pre, main, post


# ----------------------------------------------------------------------------
# support check
# ----------------------------------------------------------------------------


def _aligned(t: torch.Tensor) -> bool:
    elems = 16 // t.element_size()
    if t.stride(-1) != 1:
        return False
    if any(s % elems for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        return False
    return t.data_ptr() % 16 == 0


def supports_backward(q, k, v, *, dout=None, out=None, lse=None, dq=None, dk=None, dv=None, causal=False,
                      cu_seqlens_q=None, cu_seqlens_k=None, accumulate=False, softmax_scale=None):
    """(ok, reason): whether this kernel can compute the call. The caller validated the contract."""
    if softmax_scale is not None and not softmax_scale > 0:
        return False, "softmax_scale must be positive (the kernel masks with -inf scores)"
    from .interface import check_qkv

    ok, reason = check_qkv(q, k, v, BWD_HEAD_DIMS, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           what="backward")
    if not ok:
        return ok, reason
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False, "needs an sm_90 (Hopper) GPU"
    varlen, d, hq = cu_seqlens_q is not None, q.shape[-1], q.shape[-2]
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        if t is not None and not _aligned(t):
            return False, f"{name} needs a contiguous last dim and 16-byte aligned base and strides"
    if dout is not None and dout.dtype not in _TORCH_DTYPES + (torch.float32,):
        return False, f"dout dtype {dout.dtype} not supported"
    if out is not None and out.dtype not in _TORCH_DTYPES + (torch.float32,):
        return False, f"out dtype {out.dtype} not supported"
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is None:
            continue
        want = (torch.float32,) if accumulate else (q.dtype, torch.float32)
        if t.dtype not in want:
            return False, f"{name} must be {' or '.join(map(str, want))}"
        if tuple(t.shape) != tuple(like.shape) or not _aligned(t):
            return False, f"{name} must match {name[1]}'s shape with aligned strides"
    if dk is not None and dv is not None and dk.dtype != dv.dtype:
        return False, "dk and dv must share a dtype"
    total_q = q.shape[0] * (1 if varlen else q.shape[1])
    nseg = (cu_seqlens_q.shape[0] - 1) if varlen else q.shape[0]
    if dq_scratch_elements(total_q, nseg, hq, d) >= _INT32_MAX:
        return False, "problem too large for 32-bit scratch indexing"
    return True, ""


# ----------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------


def _offset_tensor(x, n, device):
    if isinstance(x, torch.Tensor):
        t = x.to(device=device, dtype=torch.int32).reshape(-1)
        if t.numel() == 1 and n != 1:
            t = t.expand(n)
        return t.contiguous()
    from .interface import offsets_tensor  # cached by value: no H2D copy per ring step

    return offsets_tensor(x if isinstance(x, (list, tuple)) else [int(x)] * n, device)


def _is_uniform(x):
    return not isinstance(x, (torch.Tensor, list, tuple))


def backward(
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
    **overrides,
):
    """Gradients of one attention block (given the global out and lse), written into dq, dk, dv.

    dout, q, k, v: bf16/fp16 (dout may be fp32); out: q dtype or fp32; lse fp32 (natural log), (b, h, s_q) or
    packed (h, t_q). dq/dk/dv: fresh buffers (q dtype or fp32) or, with accumulate=True, fp32 buffers added into.
    q_offset / k_offset: ints, or int32 tensors / sequences with one global offset per sequence or segment.
    """
    for step in launch_steps(
        dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal, q_offset=q_offset,
        k_offset=k_offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic, accumulate=accumulate, **overrides,
    ):
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
    **overrides,
):
    """The backward as a list of callables (preprocess, main kernel, dQ convert), each launching one kernel on the
    current stream; `backward` runs them in order. Split out so that benchmarks can time each kernel."""
    varlen = cu_seqlens_q is not None
    d = q.shape[-1]
    hq = q.shape[-2]
    tm = tile_m_for(d)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if not softmax_scale > 0:
        raise ValueError("the cute backward needs a positive softmax_scale")
    device = q.device
    nseg = (cu_seqlens_q.shape[0] - 1) if varlen else q.shape[0]
    total_q = q.shape[0] * (1 if varlen else q.shape[1])
    total_k = k.shape[0] * (1 if varlen else k.shape[1])
    if total_q == 0 or total_k == 0 or nseg == 0 or hq == 0:
        if accumulate:  # no visible pair: nothing to add
            return []
        return [lambda: (dq.zero_(), dk.zero_(), dv.zero_())]

    seg_offsets = causal and not (_is_uniform(q_offset) and _is_uniform(k_offset))
    diag = 0
    off_q = off_k = None
    if causal:
        if seg_offsets:
            off_q = _offset_tensor(q_offset, nseg, device)
            off_k = _offset_tensor(k_offset, nseg, device)
        else:
            diag = int(q_offset) - int(k_offset)
            if abs(diag) > _INT32_MAX // 4:
                raise ValueError("q_offset - k_offset out of int32 range")

    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dout_mma = dout if dout.dtype == q.dtype else dout.to(q.dtype)
    if lse.stride(-1) != 1:
        lse = lse.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()

    pre_cfg, main_cfg, post_cfg = make_configs(
        q.dtype, d, causal=causal, varlen=varlen, seg_offsets=seg_offsets, accumulate=accumulate,
        deterministic=deterministic, dq_dtype=dq.dtype, dkv_dtype=dk.dtype, o_dtype=out.dtype,
        do_dtype=dout.dtype, **overrides,
    )
    pre_fn, main_fn, post_fn = get_compiled(pre_cfg), get_compiled(main_cfg), get_compiled(post_cfg)

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
    lse2 = torch.empty(n_chunks * tm, dtype=torch.float32, device=device)
    dpsum = torch.empty(n_chunks * tm, dtype=torch.float32, device=device)
    dq_acc = torch.empty(n_chunks * tm * d, dtype=torch.float32, device=device)
    sem = torch.empty(n_chunks, dtype=torch.int32, device=device) if deterministic else None

    scale = float(softmax_scale)
    scale_log2 = scale * math.log2(math.e)
    msk = max(msk, 1)
    return [
        lambda: pre_fn(out, dout, lse, lse2, dpsum, dq_acc, sem, scale, m_grid, cu_seqlens_q),
        lambda: main_fn(q, k, v, dout_mma, lse2, dpsum, dq_acc, dk, dv, sem, scale, scale_log2, diag, msk,
                        cu_seqlens_q, cu_seqlens_k, off_q, off_k),
        lambda: post_fn(dq_acc, dq, m_grid, cu_seqlens_q),
    ]
