"""Kernel demo (until the context-parallel demo lands): one causal sequence forward and backward through the best
available backend, checked against the reference.

    python -m fa4dist.demo --seqlen 4096
"""

from __future__ import annotations

import argparse
import time

import torch

import fa4dist
from fa4dist.kernels import available_backends


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--headdim", type=int, default=64)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, args.seqlen, args.heads, args.headdim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, args.seqlen, args.kv_heads, args.headdim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    backend = available_backends(device)[0]
    leaves = [t.requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    out = fa4dist.attention(*leaves, causal=True)
    out.float().square().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref = fa4dist.attention(*(t.double() for t in leaves), causal=True, backend="reference")
    ref.square().sum().backward()
    err = (out.double() - ref).norm() / ref.norm()
    gerr = max(float((g.double() - t.grad).norm() / t.grad.norm()) for g, t in zip(grads, leaves))
    print(f"device={device} backend(auto)={backend} seqlen={args.seqlen} heads={args.heads}/{args.kv_heads} "
          f"d={args.headdim} dtype={dtype}")
    print(f"forward+backward {elapsed * 1e3:.1f} ms; rel. error vs fp64 reference: out {err:.2e}, grads {gerr:.2e}")


if __name__ == "__main__":
    main()
