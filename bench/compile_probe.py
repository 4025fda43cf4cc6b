"""Does torch.compile take our attention? One model-like function (a projection, attention, a loss) run eagerly and
under torch.compile, with each backend named on the command line; prints the graph breaks dynamo reports and
whether the compiled outputs and gradients are the same bytes as the eager ones (deterministic backward).

    python bench/compile_probe.py --backends cute reference --device cuda
    python bench/compile_probe.py --backends reference --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fa4dist  # noqa: E402


def probe(backend: str, device: str, dtype: torch.dtype, seqlen: int):
    torch.manual_seed(0)
    b, h, hkv, d = 2, 8, 2, 128 if device == "cuda" else 32
    x = torch.randn(b, seqlen, h * d, device=device, dtype=dtype)
    w = torch.randn(h * d, (h + 2 * hkv) * d, device=device, dtype=dtype) / (h * d) ** 0.5
    w.requires_grad_()

    def step(x, w):
        qkv = (x @ w).unflatten(-1, (h + 2 * hkv, d))
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]
        out = fa4dist.attention(q, k, v, causal=True, backend=backend, deterministic=True)
        return out.float().square().mean()

    eager = step(x, w)
    (g_eager,) = torch.autograd.grad(eager, w)
    explain = torch._dynamo.explain(step)(x, w)
    print(f"[{backend}] dynamo: {explain.graph_count} graphs, {explain.graph_break_count} breaks", flush=True)
    for reason in explain.break_reasons[:4]:
        print("   break:", str(reason.reason).splitlines()[0][:160], flush=True)
    torch._dynamo.reset()
    for fullgraph in (False, True):
        try:
            compiled = torch.compile(step, fullgraph=fullgraph)
            loss = compiled(x, w)
            (g,) = torch.autograd.grad(loss, w)
            same = torch.equal(loss, eager) and torch.equal(g, g_eager)
            close = torch.allclose(g.float(), g_eager.float(), rtol=2e-2, atol=1e-5)
            print(f"[{backend}] torch.compile(fullgraph={fullgraph}): ran; loss {loss.item():.6f} vs eager "
                  f"{eager.item():.6f}; same bytes: {same}; grads close: {close}", flush=True)
        except Exception as exc:
            print(f"[{backend}] torch.compile(fullgraph={fullgraph}) FAILED: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:300]}", flush=True)
            traceback.print_exc(limit=-6)
        torch._dynamo.reset()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["reference"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqlen", type=int, default=512)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for backend in args.backends:
        probe(backend, args.device, dtype, args.seqlen)


if __name__ == "__main__":
    main()
