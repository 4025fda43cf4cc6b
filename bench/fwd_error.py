"""The forward's error against an fp64 oracle: every backend and cute variant on the same bf16 inputs.

    python bench/fwd_error.py --headdims 128 --seqlens 16384 32768 --causal false true \
        --cute-variants fwd:tile_n=128,tma_store_o=true fwd:tile_n=176,tma_store_o=false

bench/kernels.py checks each forward against torch's flash kernel, which is itself a bf16 kernel: a larger number
there says "further from torch", not "less accurate". This script answers the second question. For each point it
prints, per backend, the relative Frobenius error of the bf16 output against softmax(q k^T / sqrt(d)) v computed in
fp64 from the same bf16 inputs, and its ratio to the floor: the error of the fp64 result rounded once to bf16, which
no bf16 output can beat. The oracle runs on the GPU in query chunks (one chunk's fp64 scores at a time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sibling  # noqa: E402  (bench/sibling.py)

from fa4dist.kernels import available_backends  # noqa: E402

bench_kernels = sibling.load("kernels")


def fp64_attention(q, k, v, causal, chunk=1024):
    """softmax(q k^T / sqrt(d)) v in fp64, (B, S, H, D) in and out, causal with the diagonal aligned at the start."""
    b, s, h, d = q.shape
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    kt = k.double().permute(0, 2, 3, 1)  # (B, H, D, S)
    vv = v.double().transpose(1, 2)  # (B, H, S, D)
    keys = torch.arange(k.shape[1], device=q.device)
    for start in range(0, s, chunk):
        qc = q[:, start:start + chunk].double().transpose(1, 2)  # (B, H, c, D)
        scores = qc @ kt / math.sqrt(d)
        if causal:
            rows = torch.arange(start, start + qc.shape[2], device=q.device)
            scores.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))
        out[:, start:start + chunk] = (torch.softmax(scores, dim=-1) @ vv).transpose(1, 2)
    return out


def rel_err(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", type=int, nargs="+", default=[128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[False, True])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--backends", nargs="+", default=None,
                   help="default: every available backend (not the reference) + flash_attn_4 + cudnn")
    p.add_argument("--cute-variants", nargs="*", default=None, help="as bench/kernels.py: fwd:key=value,...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fwd_error.py needs a CUDA GPU")
    device = torch.device("cuda")
    backends = [b for b in available_backends(device) if b not in ("sdpa", "reference")]
    fa4 = bench_kernels._fa4()
    if fa4 is not None:
        backends.append("flash_attn_4")
    backends.append(bench_kernels.CUDNN_RAW)
    if args.backends:
        backends = [b for b in backends if b in args.backends]
    variants = bench_kernels.parse_variants(args.cute_variants)
    names = [(b, None) for b in backends] + [(v[0], v) for v in variants if v[2] == "fwd"]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  rows: {[n for n, _ in names]}")
    rows = []
    for d in args.headdims:
        for causal in args.causal:
            for s in args.seqlens:
                gen = torch.Generator(device=device).manual_seed(args.seed * 1000003 + s * 7 + d)
                q, k, v = (torch.randn((1, s, args.heads, d), device=device, dtype=torch.bfloat16, generator=gen)
                           for _ in range(3))
                ref = fp64_attention(q, k, v, causal)
                floor = rel_err(ref.to(torch.bfloat16), ref)
                print(f"d={d} causal={causal} S={s}: bf16 rounding floor {floor:.3e}", flush=True)
                for name, variant in names:
                    row = dict(backend=name, headdim=d, causal=causal, seqlen=s, heads=args.heads, floor=floor)
                    try:
                        overrides = variant[3] if variant is not None else None
                        _, out = bench_kernels._make_fn(name if variant is None else "cute", "fwd", False, q, k, v,
                                                        None, causal, fa4, overrides)
                        torch.cuda.synchronize()
                        row["rel_err"] = rel_err(out, ref)
                        row["max_abs_err"] = float((out.double() - ref).abs().max())
                        print(f"  {name:>44}: rel {row['rel_err']:.3e} ({row['rel_err'] / floor:.2f}x floor)  "
                              f"max abs {row['max_abs_err']:.2e}", flush=True)
                    except Exception as exc:  # one backend failing must not hide the others
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                        print(f"  {name:>44}: ERROR {row['error']}", flush=True)
                    rows.append(row)
                del ref
                torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    with open(os.path.join(args.out_dir, f"{now.date().isoformat()}-fwd-error.json"), "w") as f:
        json.dump(dict(date=now.isoformat(), command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                       torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
