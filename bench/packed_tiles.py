"""Packed causal documents (one varlen launch) on the Hopper kernels: tile shapes and grids against flash-attn-4.

A batch of `--total-tokens` tokens cut into documents of `--doclen` tokens (or, with `--mixed`, lengths drawn
uniformly between doclen / 4 and 2 * doclen, fixed seed), H = model_dim / headdim, bf16. Rows: our kernel entry
point (`fa4dist.kernels.cute.forward.forward`) as configured by default and with each `--variants` override (e.g.
tile_m=128, or persistent_ctas=0: one CTA per tile), and flash-attn-4's varlen forward when installed. Each point's
rows are timed in interleaved rounds (median of the rounds' medians); outputs are checked against the default row.
With `--direction bwd` the rows are the backward (`fa4dist.kernels.cute.backward.launch_steps`, 16-bit gradients,
`--deterministic` for the deterministic one) with backward overrides (e.g. persistent_ctas=132), and flash-attn-4's
varlen backward through autograd (its forward not timed); dq / dk / dv are checked against the default row.

    python bench/packed_tiles.py --headdim 64 --doclen 512 1024 2048 --variants tile_m=128 persistent_ctas=0
    python bench/packed_tiles.py --direction bwd --deterministic --doclen 512 1024 --variants persistent_ctas=132

Prints each row, then a table of TFLOP/s with every row's ratio to flash-attn-4, and writes JSON to
$OUT/<date>-packed-tiles[-bwd|-bwd-det]-d<headdim>[-mixed].json (or bench/out/), one file per kind of run.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import cuda_median_ms, require_cuda  # noqa: E402


def doc_lengths(total: int, doclen: int, mixed: bool) -> list[int]:
    """Document lengths summing to `total`: all `doclen` (the last one shorter if it must be), or with `mixed`
    drawn uniformly from [doclen / 4, 2 * doclen] with a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    lens, left = [], total
    while left > 0:
        n = doclen if not mixed else int(torch.randint(max(1, doclen // 4), 2 * doclen + 1, (1,), generator=gen))
        lens.append(min(n, left))
        left -= lens[-1]
    return lens


def causal_flops(lens: list[int], heads: int, headdim: int, direction: str = "fwd") -> float:
    """FLOPs of causal attention over the documents: 4 * H * D * (the visible pairs of each) for the forward,
    2.5 times that for the backward (its five GEMMs against the forward's two)."""
    return (2.5 if direction == "bwd" else 1.0) * 4.0 * heads * headdim * sum(n * (n + 1) / 2 for n in lens)


def _fa4_varlen():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def _forward_fns(q, k, v, cu, max_len, variants, fa4) -> dict:
    """name -> a callable returning the forward's out: our kernel as configured, each variant, flash-attn-4."""
    from fa4dist.kernels.cute import forward as cfwd

    def ours(**kw):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
        return lambda: cfwd.forward(q, k, v, out, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=max_len, **kw)[0]

    fns = {"cute": ours()}
    for spec, kw in variants:
        fns[f"cute[{spec}]"] = ours(**kw)
    if fa4 is not None:
        def fa4_call():
            r = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                    causal=True)
            return r[0] if isinstance(r, tuple) else r
        fns["flash_attn_4"] = fa4_call
    return fns


def _backward_fns(q, k, v, cu, max_len, variants, fa4, deterministic: bool) -> dict:
    """name -> a callable returning (dq, dk, dv) of the backward against the forward's own out and lse: our
    kernels' three launches as configured and with each variant, flash-attn-4's varlen backward (autograd)."""
    from fa4dist.kernels.cute import backward as cbwd
    from fa4dist.kernels.cute import forward as cfwd

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
    cfwd.forward(q, k, v, out, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len)
    dout = torch.randn_like(q)
    packed = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                  deterministic=deterministic)

    def ours(**kw):
        grads = [torch.empty_like(t) for t in (q, k, v)]
        steps = cbwd.launch_steps(dout, q, k, v, out, lse, *grads, **packed, **kw)

        def call():
            for step in steps:
                step()
            return grads
        return call

    fns = {"cute": ours()}
    for spec, kw in variants:
        fns[f"cute[{spec}]"] = ours(**kw)
    if fa4 is not None:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        r = fa4(qg, kg, vg, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                causal=True, deterministic=deterministic)
        fa4_out = r[0] if isinstance(r, tuple) else r
        fns["flash_attn_4"] = lambda: torch.autograd.grad(fa4_out, (qg, kg, vg), dout, retain_graph=True)
    return fns


def _rel_diff(got, want) -> float:
    """Largest relative difference over the outputs (one tensor, or dq / dk / dv)."""
    got, want = (x if isinstance(x, (list, tuple)) else [x] for x in (got, want))
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))


def run(args) -> list[dict]:
    from fa4dist.kernels.cute import backward as cbwd
    from fa4dist.kernels.cute import forward as cfwd

    device = torch.device("cuda")
    heads = args.model_dim // args.headdim
    parse = cfwd.parse_overrides if args.direction == "fwd" else cbwd.parse_overrides
    variants = [(spec, parse(spec)) for spec in args.variants]
    fa4 = _fa4_varlen()
    rows = []
    for doclen in args.doclen:
        lens = doc_lengths(args.total_tokens, doclen, args.mixed)
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        max_len = max(lens)
        q, k, v = (torch.randn(args.total_tokens, heads, args.headdim, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        if args.direction == "fwd":
            fns = _forward_fns(q, k, v, cu, max_len, variants, fa4)
        else:
            fns = _backward_fns(q, k, v, cu, max_len, variants, fa4, args.deterministic)
        want = fns["cute"]()
        errs = {name: _rel_diff(fn(), want) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(cuda_median_ms(fn, args.reps, queue_ahead_ms=args.queue_ahead_ms))
        flop = causal_flops(lens, heads, args.headdim, args.direction)
        for name in fns:
            ms = statistics.median(times[name])
            row = dict(backend=name, direction=args.direction, deterministic=args.deterministic,
                       headdim=args.headdim, doclen=doclen, mixed=args.mixed, docs=len(lens), max_len=max_len,
                       ms=ms, tflops=flop / ms / 1e9, rel_diff_vs_default=errs[name])
            rows.append(row)
            print(f"{name:>40} d={args.headdim} doclen={doclen:>5}{' mixed' if args.mixed else ''} docs={len(lens):>4}"
                  f" {row['tflops']:7.1f} TFLOP/s ({ms:.3f} ms) diff={errs[name]:.1e}", flush=True)
    return rows


def summary_table(rows: list[dict]) -> str:
    """A markdown table: one line per document length, TFLOP/s per backend row, and each row / flash-attn-4."""
    names = list(dict.fromkeys(r["backend"] for r in rows))
    ours = [n for n in names if n != "flash_attn_4"]
    fa4 = "flash_attn_4" in names
    head = ["d", "doclen", "docs"] + names + ([f"{n} / FA4" for n in ours] if fa4 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys((r["headdim"], r["doclen"], r["docs"]) for r in rows):
        at = {r["backend"]: r["tflops"] for r in rows if (r["headdim"], r["doclen"], r["docs"]) == key}
        cells = [str(x) for x in key] + [f"{at[n]:.0f}" if n in at else "-" for n in names]
        if fa4:
            cells += [f"{at[n] / at['flash_attn_4']:.2f}" if n in at and "flash_attn_4" in at else "-" for n in ours]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--doclen", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--mixed", action="store_true", help="document lengths drawn from [doclen / 4, 2 * doclen]")
    p.add_argument("--total-tokens", type=int, default=65536)
    p.add_argument("--model-dim", type=int, default=2048)
    p.add_argument("--direction", choices=["fwd", "bwd"], default="fwd")
    p.add_argument("--deterministic", action="store_true", help="bwd: the deterministic backward (both sides)")
    p.add_argument("--variants", nargs="*", default=[],
                   help="cute overrides of the direction's kernel, e.g. tile_m=128 (fwd), persistent_ctas=132 (bwd)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--queue-ahead-ms", type=float, default=0.0,
                   help="queue each timed call behind a device spin of this length: device time alone, the host's "
                        "launch overhead hidden (default 0: timed from an idle device, host time included)")
    args = p.parse_args()
    require_cuda('packed_tiles.py')
    rows = run(args)
    print()
    print(summary_table(rows))
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    kind = "" if args.direction == "fwd" else "-bwd-det" if args.deterministic else "-bwd"
    name = f"{datetime.date.today()}-packed-tiles{kind}-d{args.headdim}{'-mixed' if args.mixed else ''}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
