"""The cost of the lse's gradient on one GPU: ``fa4dist.attention(return_lse=True)`` forward+backward with a loss of
out alone and with a loss of out and lse, per backend, in one process, interleaved rounds, medians.

    python bench/lse_grad.py                          # S 4k / 16k, hdim 128, bf16, 16k tokens, 16 heads, causal
    python bench/lse_grad.py --seqlens 8192 --backends cute sdpa

On ``cute`` (and the reference) the lse's gradient joins the backward's row sums in the same pass
(``attention_backward(dlse=)``, the preprocess reads one more vector): predicted within 1-2% of the out-only
backward. The sdpa backends run one more backward for it (v = 0): predicted ~1.8-2x. Also the relative error of
each backend's gradients against the reference backend's on the same inputs (out-and-lse loss). Writes
$OUT/<date>-lse-grad.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fa4dist  # noqa: E402
from fa4dist.kernels import available_backends  # noqa: E402
from timing import cuda_median_ms, require_cuda  # noqa: E402  (bench/, the script's folder)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--backends", nargs="+", default=["cute", "sdpa"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", default=None)
    return p.parse_args(argv)


def train_step(q, k, v, w_out, w_lse, backend):
    """One forward+backward of the loss sum(out * w_out) (+ sum(lse * w_lse) when w_lse is given)."""
    out, lse = fa4dist.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    loss = (out.float() * w_out).sum()
    if w_lse is not None:
        loss = loss + (lse * w_lse).sum()
    return torch.autograd.grad(loss, (q, k, v))


def rel_error(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def main(argv=None):
    args = parse_args(argv)
    require_cuda("lse_grad.py")
    backends = [b for b in args.backends if b in available_backends("cuda")]
    rows = []
    for seqlen in args.seqlens:
        batch = max(1, args.total_tokens // seqlen)
        gen = torch.Generator(device="cuda").manual_seed(seqlen)
        shape = (batch, seqlen, args.heads, args.headdim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        w_out = torch.randn(shape, device="cuda", generator=gen)
        w_lse = torch.randn(batch, args.heads, seqlen, device="cuda", generator=gen)
        want = train_step(q, k, v, w_out, w_lse, "reference") if seqlen <= 4096 else None
        times = {(b, lse): [] for b in backends for lse in (False, True)}
        for _ in range(args.rounds):
            for b in backends:
                for lse in (False, True):
                    fn = lambda: train_step(q, k, v, w_out, w_lse if lse else None, b)  # noqa: E731
                    times[(b, lse)].append(cuda_median_ms(fn, args.reps))
        for b in backends:
            out_ms, both_ms = (statistics.median(times[(b, lse)]) for lse in (False, True))
            row = dict(seqlen=seqlen, batch=batch, heads=args.heads, headdim=args.headdim, backend=b,
                       out_only_ms=out_ms, out_and_lse_ms=both_ms, cost=both_ms / out_ms)
            if want is not None:
                got = train_step(q, k, v, w_out, w_lse, b)
                row["rel_error_vs_reference"] = max(rel_error(g, w) for g, w in zip(got, want))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| S | backend | out only (ms) | out and lse (ms) | cost | rel. error vs reference |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        err = f"{r['rel_error_vs_reference']:.1e}" if "rel_error_vs_reference" in r else "-"
        print(f"| {r['seqlen']} | {r['backend']} | {r['out_only_ms']:.3f} | {r['out_and_lse_ms']:.3f} | "
              f"{r['cost']:.3f}x | {err} |")
    out_dir = args.out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-lse-grad.json")
    with open(path, "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
