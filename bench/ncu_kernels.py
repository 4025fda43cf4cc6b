"""Hardware counters for our kernels and flash-attn-4's, one call of each, under Nsight Compute.

Timing ratios (bench/kernels.py) say *that* a kernel trails; the counters say *where*: tensor-pipe and shared-
memory utilisation, issue slots, the warp stall reasons, achieved occupancy. This script only makes the calls:
each case's backends are built and warmed up (compiles, caches) first, then every (case, backend) runs once inside
cudaProfilerStart/Stop, in the order it prints, so `ncu --profile-from-start off` sees exactly those launches.

    ncu --profile-from-start off --clock-control none --set full --export OUT/prof \\
        python3 bench/ncu_kernels.py --cases bwd:128:1024:causal fwd:128:16384:causal
    ncu --import OUT/prof.ncu-rep --page details > OUT/details.txt   # read the kernels in the printed order

A case is DIRECTION:HEADDIM:SEQLEN:causal|full[:det], sized as bench/kernels.py sizes it (batch = 16384 / S,
heads = 2048 / D, bf16). Without ncu it runs as a plain script (a smoke test of the calls).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernels as kbench  # noqa: E402  (bench/kernels.py: the same calls the timing bench makes)


def parse_case(spec: str):
    parts = spec.split(":")
    if len(parts) not in (4, 5) or parts[0] not in ("fwd", "bwd") or parts[3] not in ("causal", "full"):
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
