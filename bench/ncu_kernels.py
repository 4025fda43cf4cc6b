"""Hardware counters for our kernels and flash-attn-4's, one call of each, under Nsight Compute.

Timing ratios (bench/kernels.py) say *that* a kernel trails; the counters say *where*: tensor-pipe and shared-
memory utilisation, issue slots, the warp stall reasons, achieved occupancy. This script only makes the calls:
each case's backends are built and warmed up (compiles, caches) first, then every (case, backend) runs once inside
cudaProfilerStart/Stop, in the order it prints, so `ncu --profile-from-start off` sees exactly those launches.

    ncu --profile-from-start off --clock-control none --set full --export OUT/prof \\
        python3 bench/ncu_kernels.py --cases bwd:128:1024:causal fwd:128:16384:causal
    ncu --import OUT/prof.ncu-rep --page details > OUT/details.txt   # read the kernels in the printed order

A case is DIRECTION:HEADDIM:SEQLEN:causal|full[:det], sized as bench/kernels.py sizes it (batch = 16384 / S,
heads = 2048 / D, bf16). DIRECTION is fwd, bwd, merge (our forward merging into a running fp32 (out, lse), as a ring
step calls it), fwd1 (our plain forward on the merge's grid, one CTA per tile), bwdacc (our backward adding into fp32
dq / dk / dv, as the ring calls it) or bwdfixed (the same with the int64 fixed-point dq of cp_invariant); the last
four are our kernels' cases only. Without ncu it runs as a plain script (a smoke test of the calls).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sibling  # noqa: E402  (bench/sibling.py)

kbench = sibling.load("kernels")  # the same calls the timing bench makes


DIRECTIONS = ("fwd", "bwd", "merge", "fwd1", "bwdacc", "bwdfixed")
OURS_ONLY = ("merge", "fwd1", "bwdacc", "bwdfixed")


def _cute_forward_fn(direction, q, k, v, causal):
    """merge: the forward merging into running fp32 rows (refilled before each call would change nothing the
    counters see: the merge reads and writes the same bytes); fwd1: the plain forward with persistent_ctas=0."""
    from fa4dist.kernels.cute import forward as cfwd

    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    if direction == "merge":
        out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        return lambda: cfwd.forward(q, k, v, out, lse, causal=causal, accumulate=True)
    out = torch.empty_like(q)
    return lambda: cfwd.forward(q, k, v, out, lse, causal=causal, persistent_ctas=0)


def _cute_accumulating_backward_fn(direction, q, k, v, dout, causal):
    """bwdacc / bwdfixed: the backward adding into fp32 dk / dv, and fp32 (bwdacc) or int64 fixed-point
    (bwdfixed, fixed_point.dq_scale's scales) dq."""
    from fa4dist.kernels import attention_forward, fixed_point
    from fa4dist.kernels.cute.backward import backward

    out, lse = attention_forward(q, k, v, causal=causal, backend="cute")
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    if direction == "bwdacc":
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        return lambda: backward(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, accumulate=True)
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k), fixed_point.head_absmax(v),
                                 q.shape[-1] ** -0.5)
    dq = torch.zeros(q.shape, dtype=torch.int64, device=q.device)
    return lambda: backward(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, accumulate=True, dq_scale=scale)


def parse_case(spec: str):
    parts = spec.split(":")
    if len(parts) not in (4, 5) or parts[0] not in DIRECTIONS or parts[3] not in ("causal", "full"):
        raise SystemExit(f"--cases: expected DIRECTION:HEADDIM:SEQLEN:causal|full[:det], got {spec!r}")
    if len(parts) == 5 and (parts[4] != "det" or parts[0] != "bwd"):
        raise SystemExit(f"--cases: only a backward case takes ':det', got {spec!r}")
    return dict(direction=parts[0], headdim=int(parts[1]), seqlen=int(parts[2]), causal=parts[3] == "causal",
                deterministic=len(parts) == 5)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", required=True)
    p.add_argument("--backends", nargs="+", default=["cute", "flash_attn_4"])
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--model-dim", type=int, default=2048)
    args = p.parse_args()
    device = torch.device("cuda")
    fa4 = kbench._fa4()
    calls = []  # (label, fn, tensors kept alive)
    for spec in args.cases:
        case = parse_case(spec)
        s, d = case["seqlen"], case["headdim"]
        batch, heads = max(1, args.total_tokens // s), max(1, args.model_dim // d)
        gen = torch.Generator(device=device).manual_seed(s * 7 + d)
        q, k, v, dout = (torch.randn((batch, s, heads, d), device=device, dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        for backend in args.backends:
            if backend == "flash_attn_4" and fa4 is None:
                print(f"skip {spec} {backend}: flash-attn-4 is not installed", flush=True)
                continue
            if case["direction"] in OURS_ONLY:
                if backend != "cute":
                    print(f"skip {spec} {backend}: {case['direction']} is our kernel's case only", flush=True)
                    continue
                if case["direction"] in ("merge", "fwd1"):
                    fn = _cute_forward_fn(case["direction"], q, k, v, case["causal"])
                else:
                    fn = _cute_accumulating_backward_fn(case["direction"], q, k, v, dout, case["causal"])
            else:
                fn, _ = kbench._make_fn(backend, case["direction"], case["deterministic"], q, k, v, dout,
                                        case["causal"], fa4, None)
            for _ in range(3):
                fn()
            calls.append((f"{spec} {backend} (B={batch} H={heads})", fn, (q, k, v, dout)))
    torch.cuda.synchronize()
    for label, fn, _ in calls:
        print(f"profiled call: {label}", flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
