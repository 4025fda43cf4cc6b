"""Dev benchmark of the Hopper CuTe DSL forward (fa4dist.kernels.cute) beside cuDNN, FA2 (torch flash) and
flash-attn-4, side by side in one run.

    python bench/cute_fwd_dev.py --hdims 64 128 --seqlens 1024 4096 16384 --causal 0 1 \
        --variants "" "intra_wg_overlap=False" --json $OUT/bench.json

Sizes as ../shared/docs/anchors.md: bf16, batch = 16384 / seqlen, heads = 2048 / headdim; TFLOP/s counts
4*B*H*S^2*D per forward (half when causal); triton.testing.do_bench median.  Each cute variant's output is checked
against cuDNN (or FA2) first.  --acc times the accumulate entry point against a plain forward of the same block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4dist.kernels.cute import forward as cute_fwd  # noqa: E402


def bench_ms(fn, warmup=25, rep=100):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def parse_variant(s):
    kw = {}
    for item in filter(None, s.split(",")):
        k, v = item.split("=")
        kw[k.strip()] = eval(v)  # noqa: S307 - dev script
    return kw


def sdpa_fn(kind, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[kind]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def fn():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    return fn


def fa4_fn(q, k, v, causal):
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # not carried
        print("flash-attn-4 unavailable:", exc, flush=True)
        return None

    def fn():
        r = flash_attn_func(q, k, v, causal=causal)
        return r[0] if isinstance(r, tuple) else r

    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="+", default=[""],
                    help="cute config overrides, e.g. 'tma_store_o=True' or head-dim specific 'd64:tile_m=128'")
    ap.add_argument("--baselines", nargs="*", default=["cudnn", "fa2", "fa4"])
    ap.add_argument("--total-tokens", type=int, default=16384)
    ap.add_argument("--model-dim", type=int, default=2048)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--acc", action="store_true", help="also time accumulate vs plain forward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    for d in args.hdims:
        for causal in map(bool, args.causal):
            for s in args.seqlens:
                b, h = max(1, args.total_tokens // s), max(1, args.model_dim // d)
                g = torch.Generator(device=dev).manual_seed(s + d)
                q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
                flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
                res = dict(d=d, causal=causal, s=s, b=b, h=h)
                ref = None
                for name in args.baselines:
                    fn = fa4_fn(q, k, v, causal) if name == "fa4" else sdpa_fn(name, q, k, v, causal)
                    if fn is None:
                        continue
                    try:
                        o = fn()
                        if ref is None:
                            ref = o
                        res[name] = flops / bench_ms(fn, rep=args.rep) / 1e9
                    except Exception as exc:
                        print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, device=dev, dtype=torch.float32)
                for vs in args.variants:
                    if ":" in vs:  # head-dim specific variant, e.g. "d64:tile_m=128"
                        want, vs_kw = vs.split(":", 1)
                        if want != f"d{d}":
                            continue
                    else:
                        vs_kw = vs
                    kw = parse_variant(vs_kw)
                    tag = "cute" + (f"[{vs}]" if vs else "")
                    try:
                        t0 = time.time()
                        cute_fwd.forward(q, k, v, out, lse, causal=causal, **kw)
                        torch.cuda.synchronize()
                        ct = time.time() - t0
                        if ref is not None:
                            res[tag + ".err"] = float((out.float() - ref.float()).abs().max())
                        fn = lambda: cute_fwd.forward(q, k, v, out, lse, causal=causal, **kw)  # noqa: E731
                        res[tag] = flops / bench_ms(fn, rep=args.rep) / 1e9
                        res[tag + ".first_call_s"] = ct
                    except Exception as exc:
                        print(f"  {tag} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append(res)
                print(json.dumps({k_: (round(x, 4) if isinstance(x, float) else x) for k_, x in res.items()}),
                      flush=True)
                del q, k, v, out, lse
                torch.cuda.empty_cache()

    # host overhead of one steady-state call (tiny problem; enqueue time, no sync inside the loop)
    q = torch.randn(1, 128, 1, 128, device=dev, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, 1, 128, device=dev)
    for _ in range(10):
        cute_fwd.forward(q, q, q, out, lse, causal=True)
    torch.cuda.synchronize()
    n_calls = 2000
    t0 = time.perf_counter()
    for _ in range(n_calls):
        cute_fwd.forward(q, q, q, out, lse, causal=True)
    t_host = (time.perf_counter() - t0) / n_calls
    torch.cuda.synchronize()
    print(f"HOST per-call enqueue time (tiny causal forward): {t_host * 1e6:.1f} us", flush=True)

    acc_rows = []
    if args.acc:
        # a ring step: non-causal 16k x 8k block and a causal diagonal block, H=16, D=128
        for (sq, sk, causal) in [(16384, 8192, False), (8192, 8192, True), (4096, 4096, False)]:
            h, d = 16, 128
            q = torch.randn(1, sq, h, d, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(1, sk, h, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
            out = torch.empty_like(q)
            lse = torch.empty(1, h, sq, device=dev)
            run_o = torch.randn(1, sq, h, d, device=dev)
            run_l = torch.randn(1, h, sq, device=dev)
            plain = bench_ms(lambda: cute_fwd.forward(q, k, v, out, lse, causal=causal), rep=args.rep)
            acc = bench_ms(lambda: cute_fwd.forward(q, k, v, run_o, run_l, causal=causal, accumulate=True),
                           rep=args.rep)

            def torch_merge():  # what a ring step pays without the fused epilogue
                cute_fwd.forward(q, k, v, out, lse, causal=causal)
                m = torch.maximum(run_l, lse)
                w1, w2 = torch.exp(run_l - m), torch.exp(lse - m)
                tot = w1 + w2
                a_old, a_new = (w1 / tot).transpose(1, 2)[..., None], (w2 / tot).transpose(1, 2)[..., None]
                run_o.mul_(a_old).add_(out.float() * a_new)
                run_l.copy_(m + torch.log(tot))

            unfused = bench_ms(torch_merge, rep=args.rep)
            row = dict(sq=sq, sk=sk, causal=causal, plain_ms=plain, acc_ms=acc, unfused_ms=unfused,
                       acc_overhead=acc / plain - 1, unfused_overhead=unfused / plain - 1)
            acc_rows.append(row)
            print("ACC", json.dumps({k_: (round(x, 4) if isinstance(x, float) else x) for k_, x in row.items()}),
                  flush=True)

    # summary table
    names = ["cudnn", "fa2", "fa4"] + ["cute" + (f"[{v}]" if v else "") for v in args.variants]
    print("\n| d | causal | S | " + " | ".join(names) + " | cute/cuDNN | cute/FA4 |")
    print("|---" * (len(names) + 5) + "|")
    for r in rows:
        cells = [f"{r[n]:.0f}" if n in r else "-" for n in names]
        best = max((r[n] for n in names[3:] if n in r), default=None)
        rc = f"{best / r['cudnn']:.2f}" if best and "cudnn" in r else "-"
        rf = f"{best / r['fa4']:.2f}" if best and "fa4" in r else "-"
        print(f"| {r['d']} | {'y' if r['causal'] else 'n'} | {r['s']} | " + " | ".join(cells) + f" | {rc} | {rf} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, acc=acc_rows), f, indent=1)


if __name__ == "__main__":
    main()
