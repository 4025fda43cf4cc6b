"""One attention call, ours (fa4dist.attention, backend auto), flash-attn-4's (when installed) and, with --cudnn,
torch SDPA's cuDNN backend, on the same inputs through autograd: the problem's command-line arguments and the
callables, for the benchmarks that look inside one call (bench/kernel_breakdown.py: GPU time per kernel;
bench/host_profile.py: host time)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fa4dist  # noqa: E402


def add_problem_args(p) -> None:
    """--seqlen, --batch, --heads, --kv-heads, --headdim, --mode, --no-causal and --out-dir on an argparse
    parser."""
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key / value heads (GQA; default: --heads)")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--mode", choices=("plain", "deterministic", "cp_invariant"), default="plain",
                   help="our call's numerics: the default, deterministic=True or cp_invariant=True")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--cudnn", action="store_true", help="also torch's SDPA on its cuDNN backend (a peer's kernels)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))


def make_calls(args, deterministic: bool = False, with_leaves: bool = False):
    """({library: call returning the output}, dout): bf16 CUDA inputs of the arguments' shape, seed 0; the outputs
    are differentiable (call(...).backward(dout) runs the backward). ``with_leaves``: (calls, dout, [q, k, v]),
    the leaves whose gradients the backward writes."""
    torch.manual_seed(0)
    kv_heads = getattr(args, "kv_heads", None) or args.heads
    q, k, v, dout = (torch.randn(args.batch, args.seqlen, h, args.headdim, device="cuda", dtype=torch.bfloat16)
                     for h in (args.heads, kv_heads, kv_heads, args.heads))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mode = getattr(args, "mode", "plain")
    # plain: fa4dist's default, which follows torch.use_deterministic_algorithms (bench/kernel_breakdown.py sets it)
    ours = {"plain": {}, "deterministic": dict(deterministic=True), "cp_invariant": dict(cp_invariant=True)}[mode]
    calls = {"ours": lambda: fa4dist.attention(*leaves, causal=args.causal, **ours)}
    if getattr(args, "contract", False):  # the kernel contract's forward as bench/kernels.py times it (no autograd)
        from fa4dist.kernels import attention_forward

        from fa4dist.kernels import attention_backward

        invariant = mode == "cp_invariant"
        calls["ours, contract"] = lambda: attention_forward(q, k, v, causal=args.causal, backend="cute",
                                                             cp_invariant=invariant)[0]
        out, lse = attention_forward(q, k, v, causal=args.causal, backend="cute")
        calls["ours, contract backward"] = lambda: attention_backward(
            dout, q, k, v, out, lse, causal=args.causal, backend="cute", deterministic=mode == "deterministic")[0]
    try:
        from flash_attn.cute import flash_attn_func

        def fa4():
            out = flash_attn_func(*leaves, causal=args.causal, deterministic=deterministic)
            return out[0] if isinstance(out, tuple) else out
        calls["flash-attn-4"] = fa4
    except ImportError:
        pass
    if getattr(args, "cudnn", False):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            bhsd = [t.transpose(1, 2) for t in leaves]  # SDPA's (batch, heads, seqlen, dim)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *bhsd, is_causal=args.causal, enable_gqa=kv_heads != args.heads)
            return out.transpose(1, 2)
        calls["cudnn"] = cudnn
    return (calls, dout, leaves) if with_leaves else (calls, dout)
