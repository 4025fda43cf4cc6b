"""Byte comparison of this checkout's CuTe kernels with another checkout's, on one GPU: the GPU counterpart of
bench/cute_ptx_dev.py for a change that moves instructions but must keep every result's bits.

    python bench/bits_vs_baseline.py OLD                  # OLD/fa4dist is the other checkout (bench/kernels.py's
    python bench/bits_vs_baseline.py OLD --directions fwd bwd   # --baseline-dir form)

Each case runs the same fresh random inputs through both checkouts' contract with backend="cute" (dense causal and
not, hdim 64 / 128, short and long sequences, packed causal documents, a sliding window, soft-capping), once clean
and once with NaN / inf planted in three V rows and one K row near the end (masked for most causal queries: the
rows that see a bad V row come out NaN, the others must not), and compares out, lse (and dq, dk, dv) as bytes.
Prints one line per case and exits non-zero when any differs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import sibling  # noqa: E402  (bench/sibling.py)

import fa4dist.kernels as current  # noqa: E402


def cases():
    """(name, dense shape (b, s, h, d) or packed ([document lengths], h, d), options)."""
    out = []
    for d in (64, 128):
        h = 2048 // d
        for s in (512, 1024, 4096):
            out.append((f"dense causal d{d} s{s}", (16384 // s, s, h, d), dict(causal=True)))
        out.append((f"dense full d{d} s1024", (16, 1024, h, d), dict(causal=False)))
        out.append((f"packed causal d{d}", ([300, 1024, 77, 2048, 640], h, d), dict(causal=True)))
        out.append((f"window d{d} s4096", (2, 4096, h, d), dict(causal=True, window=(700, 0))))
        out.append((f"softcap d{d} s2048", (4, 2048, h, d), dict(causal=True, softcap=30.0)))
    return out


def make_inputs(shape, gen, poison: bool):
    """q, k, v (bf16, CUDA) and the packed cu_seqlens (None for dense); with ``poison``, NaN / inf in a few K and
    V token rows spread over the sequence (masked for some queries, visible to others)."""
    if isinstance(shape[0], list):
        lengths, heads, d = shape
        qkv_shape = (sum(lengths), heads, d)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        seq_dim = 0
    else:
        qkv_shape, cu, seq_dim = shape, None, 1
    q, k, v = (torch.randn(qkv_shape, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    if poison:  # three V rows anywhere, one K row near the end (masked for most causal queries)
        n = qkv_shape[seq_dim]
        rows = torch.randint(0, n, (3,), generator=gen, device="cuda").tolist()
        for (t, r), value in zip([(v, r) for r in rows] + [(k, n - 1 - n // 50)], (float("nan"), float("inf"),
                                                                                 -float("inf"), float("nan"))):
            t[(r,) if seq_dim == 0 else (slice(None), r)] = value
    return q, k, v, cu


def run(kernels, q, k, v, cu, opts, directions):
    kw = dict(opts, backend="cute")
    if cu is not None:
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    out, lse = kernels.attention_forward(q, k, v, **kw)
    results = {"out": out, "lse": lse}
    if "bwd" in directions:
        dout = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(7), device="cuda").to(out.dtype)
        dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, **kw)
        results.update(dq=dq, dk=dk, dv=dv)
    torch.cuda.synchronize()
    return results


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("baseline_dir", help="a checkout whose fa4dist is compared with this one's")
    p.add_argument("--directions", nargs="+", default=["fwd"], choices=["fwd", "bwd"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/bits_vs_baseline.py needs a CUDA GPU")
    baseline = sibling.load("kernels").load_baseline(args.baseline_dir)
    bad = 0
    for name, shape, opts in cases():
        for poison in (False, True):
            gen = torch.Generator("cuda").manual_seed(args.seed)
            q, k, v, cu = make_inputs(shape, gen, poison)
            new = run(current, q, k, v, cu, opts, args.directions)
            old = run(baseline, q, k, v, cu, opts, args.directions)
            diff = [key for key in new if not same_bytes(new[key], old[key])]
            bad += bool(diff)
            nonfinite = int((~torch.isfinite(new["out"].float())).sum())
            print(f"{name:28s} {'poisoned' if poison else 'clean':8s} "
                  f"{'DIFFERENT ' + ','.join(diff) if diff else 'same bytes'} (non-finite out: {nonfinite})",
                  flush=True)
    print(f"{bad} case(s) differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
