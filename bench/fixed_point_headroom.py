"""How much of the fixed-point dQ's range a row's dq uses (fa4dist.kernels.fixed_point): the bound that sets each
(row, head)'s scale against the row's actual |dq|, on CPU with the reference backend. It says what a narrower
integer would keep: with B integer bits the scale resolves 2^-(B-3) of the bound (fixed_point.FRACTION_HEADROOM is
61 for int64), so an element of |dq| = bound * 2^-k keeps ~B-3-k significant bits.

    python bench/fixed_point_headroom.py                    # 4k tokens, 4 heads of 128, causal, three input kinds
    python bench/fixed_point_headroom.py --seqlen 8192 --bits 32 64

Prints, per input kind, percentiles of k (log2 of bound / |dq|) over rows (their largest element) and over
elements, and for each integer width the share of elements (and of rows' largest elements) it would resolve more
coarsely than bf16's rounding (2^-9 of the element) and than fp32's (2^-24). Elements that are exactly 0 are left
out (exact in any fixed point).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4dist.kernels import attention_backward, attention_forward  # noqa: E402
from fa4dist.kernels import fixed_point  # noqa: E402


def inputs(kind: str, seqlen: int, heads: int, d: int, gen: torch.Generator):
    """q, k, v, dout (1, s, h, d) fp32: "normal" (unit Gaussians), "sink_keys" (as normal, with the first four
    keys 20x larger: the massive activations of attention sinks), "peaky" (q 4x larger: sharp attention)."""
    q, k, v, do = (torch.randn(1, seqlen, heads, d, generator=gen) for _ in range(4))
    if kind == "sink_keys":
        k[:, :4] *= 20
    elif kind == "peaky":
        q *= 4
    return q, k, v, do


def slack_bits(q, k, v, do, causal: bool):
    """log2(bound / |dq|) per element and per row (its largest element), as fp64 tensors."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = attention_forward(q, k, v, causal=causal, backend="reference")
    dq, _, _ = attention_backward(do, q, k, v, out, lse, causal=causal, backend="reference")
    m = fixed_point.absmax(do, -1)
    bound = (scale * q.shape[-1]) * fixed_point.head_absmax(k) * m * (fixed_point.head_absmax(v)
                                                                       + fixed_point.absmax(out, -1))
    dq = dq.double().abs()
    per_elem = torch.log2(bound.unsqueeze(-1) / dq)
    per_row = torch.log2(bound / dq.amax(-1))
    # (an exact zero, e.g. a row that sees one key, is exact in any fixed point: left out)
    return per_elem[dq > 0], per_row[dq.amax(-1) > 0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--bits", type=int, nargs="+", default=[32, 64])
    p.add_argument("--kinds", nargs="+", default=["normal", "sink_keys", "peaky"])
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    qs = (0.5, 0.9, 0.99, 0.999)
    print(f"S {args.seqlen}, {args.heads} heads of {args.headdim}, {'causal' if args.causal else 'full'}; "
          f"k = log2(bound / |dq|)")
    for kind in args.kinds:
        elem, row = slack_bits(*inputs(kind, args.seqlen, args.heads, args.headdim, gen), args.causal)
        row_q = torch.quantile(row, torch.tensor(qs, dtype=row.dtype)).tolist()
        nonzero = elem
        sample = nonzero[torch.randperm(nonzero.numel(), generator=gen)[:1_000_000]]
        elem_q = torch.quantile(sample, torch.tensor(qs, dtype=sample.dtype)).tolist()
        print(f"{kind:>10}: rows k p50/p90/p99/p99.9 " + " / ".join(f"{x:.1f}" for x in row_q)
              + "; elements " + " / ".join(f"{x:.1f}" for x in elem_q))
        for bits in args.bits:
            kept = bits - 3  # fixed_point: |sum| < 2^(bits - 2), resolving 2^-(bits - 3) of the bound
            shares = [(t > kept - m).double().mean().item() for t in (nonzero, row) for m in (9, 24)]
            print(f"{'':>10}  int{bits}: {kept} bits of the bound; resolved more coarsely than bf16's / fp32's "
                  f"rounding: elements {shares[0]:.2e} / {shares[1]:.2e}, rows' largest elements {shares[2]:.2e} / "
                  f"{shares[3]:.2e}")


if __name__ == "__main__":
    main()
