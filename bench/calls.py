"""One attention call, ours (fa4dist.attention, backend auto) and flash-attn-4's (when installed), on the same
inputs through autograd: the problem's command-line arguments and the callables, for the benchmarks that look
inside one call (bench/kernel_breakdown.py: GPU time per kernel; bench/host_profile.py: host time)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fa4dist  # noqa: E402


def add_problem_args(p) -> None:
    """--seqlen, --batch, --heads, --headdim, --no-causal and --out-dir on an argparse parser."""
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))


def make_calls(args, deterministic: bool = False):
    """({library: call returning the output}, dout): bf16 CUDA inputs of the arguments' shape, seed 0; the outputs
    are differentiable (call(...).backward(dout) runs the backward)."""
    torch.manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.headdim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    calls = {"ours": lambda: fa4dist.attention(*leaves, causal=args.causal)}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4():
            out = flash_attn_func(*leaves, causal=args.causal, deterministic=deterministic)
            return out[0] if isinstance(out, tuple) else out
        calls["flash-attn-4"] = fa4
    except ImportError:
        pass
    return calls, dout
