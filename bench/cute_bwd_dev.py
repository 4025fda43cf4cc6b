"""Development driver for the CuTe DSL Hopper backward (fa4dist/kernels/cute/backward.py).

    python bench/cute_bwd_dev.py aot DIR        # CPU: compile the variants used below + the GPU tests, export to DIR
    python bench/cute_bwd_dev.py smoke          # GPU: one small case per main variant vs the fp64 reference
    python bench/cute_bwd_dev.py bench          # GPU: TFLOP/s beside cuDNN and flash-attn-4, det and not

With FA4DIST_CUTE_AOT_DIR=DIR set, the kernels are loaded from DIR instead of compiled (saves device time).
Sizes follow ../shared/docs/anchors.md: batch = 16384 / seqlen, heads = 2048 / headdim, bf16; backward TFLOP/s
= 2.5 x 4 B H S^2 D (/2 causal). Timings: triton.testing.do_bench medians, all in one run (ratios matter).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fa4dist.kernels.cute import backward as B  # noqa: E402
from fa4dist.kernels.cute import host  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# ----------------------------------------------------------------------------------------------------------------
# variants used by the GPU tests and this script (for the AOT export)


def dev_variants():
    out = []

    def add(dt, d, causal, varlen=False, acc=False, det=False, seg=False, o=None, do=None, grads=None, **kw):
        grads = FP32 if acc else (grads or dt)
        out.append(B.make_configs(dt, d, causal=causal, varlen=varlen, seg_offsets=seg, accumulate=acc,
                                  deterministic=det, dq_dtype=grads, dkv_dtype=grads, o_dtype=o or dt,
                                  do_dtype=do or dt, **kw))

    for dt in (BF16, FP16):
        for d in (64, 128):
            for causal in (False, True):
                add(dt, d, causal)
    add(BF16, 128, True, o=FP32, do=FP32, grads=FP32)
    for causal in (False, True):
        add(BF16, 128, causal, acc=True)
        add(BF16, 128, causal, varlen=True)
        add(FP16, 64, causal, varlen=True)
        add(BF16, 128, causal, det=True)
        add(BF16, 128, causal, det=True, grads=FP32)
        add(BF16, 64, causal, det=True)
    add(BF16, 128, True, varlen=True, seg=True)
    # variants timed by the bench (and the det_chunk order, tested under FA4DIST_BWD_OVERRIDE=det_chunk=8)
    for causal in (False, True):
        add(BF16, 128, causal, stmatrix_ds=False)
        add(BF16, 64, causal, stmatrix_ds=False)
    for trio in list(out):
        if trio[1].deterministic:
            out.append((trio[0], dataclasses.replace(trio[1], det_chunk=8), trio[2]))
    seen, flat = set(), []
    for trio in out:
        for cfg in trio:
            if cfg not in seen:
                seen.add(cfg)
                flat.append(cfg)
    return flat


def cmd_aot(folder):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cfgs = dev_variants()
    t0 = time.time()
    for i, cfg in enumerate(cfgs):
        path = host.export_aot(cfg, folder)
        print(f"[{i + 1}/{len(cfgs)}] {time.time() - t0:6.1f}s {os.path.basename(path)} {cfg}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# smoke: small correctness checks, one per main variant family


def _ref(q, k, v, dout, **kw):
    from fa4dist.kernels import attention_backward, attention_forward

    q64, k64, v64 = q.double(), k.double(), v.double()
    out, lse = attention_forward(q64, k64, v64, backend="reference", **kw)
    grads = attention_backward(dout.double(), q64, k64, v64, out, lse, backend="reference", **kw)
    return out, lse, grads


def _relerr(a, b):
    a, b = a.double(), b.double()
    if torch.isnan(a).any():
        return float("inf")
    n = b.norm()
    return float((a - b).norm() / n) if n > 0 else float(a.abs().max())


def cmd_aotcheck():
    """Exit 0 iff the AOT-loaded kernels run and agree with the reference on one small case."""
    faulthandler.dump_traceback_later(90, exit=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(1, 200, 2, 128, device="cuda", dtype=BF16, generator=g) for _ in range(4))
    out64, lse64, ref = _ref(q, k, v, dout, causal=True)
    bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=BF16) for t in (q, k, v)]
    t0 = time.time()
    B.backward(dout, q, k, v, out64.to(BF16), lse64.float(), *bufs, causal=True)
    torch.cuda.synchronize()
    errs = [_relerr(a, r) for a, r in zip(bufs, ref)]
    aot = [type(f).__name__ for f in host._CACHE.values()]
    print(f"aotcheck: errs {errs} in {time.time() - t0:.2f}s, kernels {aot}", flush=True)
    sys.exit(0 if all(e < 3e-2 for e in errs) else 1)


def cmd_smoke():
    faulthandler.dump_traceback_later(240, exit=True)
    g = torch.Generator(device="cuda").manual_seed(1234)
    cases = [
        ("bf16 d128 causal", BF16, (2, 300, 4, 128), (2, 300, 2, 128), dict(causal=True), {}),
        ("bf16 d128 full", BF16, (1, 200, 2, 128), (1, 333, 2, 128), dict(causal=False), {}),
        ("fp16 d64 causal shifted gqa8", FP16, (1, 257, 8, 64), (1, 513, 1, 64), dict(causal=True, q_offset=256), {}),
        ("bf16 d128 causal det", BF16, (1, 500, 4, 128), (1, 500, 4, 128), dict(causal=True), dict(deterministic=True)),
        ("bf16 d128 full det", BF16, (1, 500, 4, 128), (1, 700, 4, 128), dict(causal=False), dict(deterministic=True)),
        ("bf16 d128 causal acc", BF16, (1, 300, 4, 128), (1, 300, 4, 128), dict(causal=True), dict(accumulate=True)),
    ]
    ok = True
    for name, dt, sq, sk, mask, extra in cases:
        t0 = time.time()
        q, k, v = (torch.randn(s, device="cuda", dtype=dt, generator=g) for s in (sq, sk, sk))
        dout = torch.randn(sq, device="cuda", dtype=dt, generator=g)
        out64, lse64, ref = _ref(q, k, v, dout, **mask)
        acc = extra.get("accumulate", False)
        if acc:
            init = [torch.randn(t.shape, device="cuda", dtype=FP32, generator=g) for t in (q, k, v)]
            bufs = [t.clone() for t in init]
        else:
            init = None
            bufs = [torch.full(t.shape, float("nan"), device="cuda", dtype=dt) for t in (q, k, v)]
        try:
            B.backward(dout, q, k, v, out64.to(dt), lse64.float(), *bufs, **mask, **extra)
            torch.cuda.synchronize()
            errs = [_relerr(bb - ii if acc else bb, rr) for bb, ii, rr in zip(bufs, init or bufs, ref)]
        except Exception as exc:
            errs = None
            print(f"smoke {name}: EXCEPTION {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        if errs is not None:
            good = all(e < 3e-2 for e in errs)
            ok &= good
            print(f"smoke {name}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} {'ok' if good else 'FAIL'} "
                  f"({time.time() - t0:.1f}s)", flush=True)
        else:
            ok = False
    faulthandler.cancel_dump_traceback_later()
    print("SMOKE", "OK" if ok else "FAILED", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# bench


def bench_ms(fn, warmup=15, rep=60):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def tflops(b, h, s, d, causal, ms):
    return 2.5 * 4.0 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9


def cmd_bench(args):
    faulthandler.dump_traceback_later(int(os.environ.get("BENCH_TIMEOUT", "400")), exit=True)
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:
        print("flash-attn-4 unavailable:", exc)
        fa4 = None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    configs = []
    for d, seqlens in ((128, (4096, 8192, 16384)), (64, (8192,))):
        for s in seqlens:
            for causal in (False, True):
                configs.append((d, s, causal))
    if args:
        configs = [c for c in configs if f"d{c[0]}" in args or str(c[1]) in args] or configs
    rows = []
    det_jobs = []
    for d, s, causal in configs:
        b, h = max(1, 16384 // s), 2048 // d
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=BF16, generator=g) for _ in range(4))
        # cuDNN through torch SDPA ((b, h, s, d) views)
        qg, kg, vg = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o_c = sdpa(qg, kg, vg, is_causal=causal)
        do_t = dout.transpose(1, 2)
        cud = lambda: torch.autograd.grad(o_c, (qg, kg, vg), do_t, retain_graph=True)  # noqa: E731
        ref = cud()
        row = dict(d=d, s=s, causal=causal, b=b, h=h)
        row["cudnn"] = bench_ms(cud)
        # our forward inputs: out / lse from flash-attn-4's forward (fp32 lse, (b, h, s))
        from fa4dist.kernels import attention_forward

        out, lse = attention_forward(q, k, v, causal=causal, backend="sdpa_flash")
        grads = [torch.empty_like(t) for t in (q, k, v)]
        steps = B.launch_steps(dout, q, k, v, out, lse, *grads, causal=causal)
        run = lambda: [st() for st in steps]  # noqa: E731
        run()
        torch.cuda.synchronize()
        row["err_vs_cudnn"] = max(_relerr(a, r.transpose(1, 2)) for a, r in zip(grads, ref))
        row["ours"] = bench_ms(run)
        row["ours_main"] = bench_ms(steps[1])
        row["ours_pre"] = bench_ms(steps[0])
        row["ours_post"] = bench_ms(steps[2])
        # variants of the main kernel (each gets its own scratch: run all three steps once before timing)
        for tag, kw in (("16bit_ds", dict(stmatrix_ds=False)),):
            st_v = B.launch_steps(dout, q, k, v, out, lse, *grads, causal=causal, **kw)
            for st in st_v:
                st()
            torch.cuda.synchronize()
            row[f"err_{tag}_vs_cudnn"] = max(_relerr(a, r.transpose(1, 2)) for a, r in zip(grads, ref))
            row[f"ours_main_{tag}"] = bench_ms(st_v[1])
        if fa4 is not None and d == 128:
            try:
                qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
                r = fa4(qf, kf, vf, causal=causal)
                of = r[0] if isinstance(r, tuple) else r
                row["fa4"] = bench_ms(lambda: torch.autograd.grad(of, (qf, kf, vf), dout, retain_graph=True))
            except Exception as exc:
                row["fa4_error"] = str(exc)[:200]
        rows.append(row)
        det_jobs.append((row, q, k, v, dout, out, lse, causal))
        _print(row)
    # deterministic last (a hang would only cost these)
    for row, q, k, v, dout, out, lse, causal in det_jobs:
        if row["d"] != 128:
            continue
        grads = [torch.empty_like(t) for t in (q, k, v)]
        steps = B.launch_steps(dout, q, k, v, out, lse, *grads, causal=causal, deterministic=True)
        run = lambda: [st() for st in steps]  # noqa: E731
        run()
        torch.cuda.synchronize()
        row["ours_det"] = bench_ms(run)
        st_c = B.launch_steps(dout, q, k, v, out, lse, *grads, causal=causal, deterministic=True, det_chunk=8)
        run_c = lambda: [st() for st in st_c]  # noqa: E731
        run_c()
        torch.cuda.synchronize()
        row["ours_det_chunk8"] = bench_ms(run_c)
        if fa4 is not None and "fa4" in row and os.environ.get("BENCH_FA4_DET"):
            try:
                qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
                r = fa4(qf, kf, vf, causal=causal, deterministic=True)
                of = r[0] if isinstance(r, tuple) else r
                row["fa4_det"] = bench_ms(lambda: torch.autograd.grad(of, (qf, kf, vf), dout, retain_graph=True))
            except Exception as exc:
                row["fa4_det_error"] = str(exc)[:200]
        _print(row)
    faulthandler.cancel_dump_traceback_later()
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "cute_bwd_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print()
    print("| d | S | causal | ours | main | main 16-bit dS | cuDNN | FA4 | ours/cuDNN | ours/FA4 | ours det "
          "| det/nondet "
          "| det chunk8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def t(key, r=r):
            return tflops(r["b"], r["h"], r["s"], r["d"], r["causal"], r[key]) if key in r else float("nan")
        print(f"| {r['d']} | {r['s']} | {r['causal']} | {t('ours'):.0f} | {t('ours_main'):.0f} | "
              f"{t('ours_main_16bit_ds'):.0f} | {t('cudnn'):.0f} | {t('fa4'):.0f} | {t('ours') / t('cudnn'):.2f} | "
              f"{t('ours') / t('fa4'):.2f} | {t('ours_det'):.0f} | {t('ours_det') / t('ours'):.2f} | "
              f"{t('ours_det_chunk8'):.0f} |")


def _print(row):
    msg = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
    print("row", msg, flush=True)


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "bench"
    if cmd == "aot":
        cmd_aot(sys.argv[2])
    elif cmd == "aotcheck":
        cmd_aotcheck()
    elif cmd == "smoke":
        cmd_smoke()
    else:
        cmd_bench(sys.argv[2:])
