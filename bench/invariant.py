"""What cp_invariant=True costs on one GPU: fa4dist.attention forward+backward with and without it, side by side.

    python bench/invariant.py --tokens 32768 65536 --heads 32:8 --reps 5 [--profile]

For each size: the plain call (non-deterministic backward), the deterministic one, and cp_invariant=True (one
device's form of the numerics every cp layout reproduces: K/V expanded per query head, one backward call per
document with the int64 fixed-point dq).  A cp = N step adds the gathers and the int64 dq exchange on top (see
bench/multigpu.py --invariant).  ``--profile``: the GPU kernels of one cp_invariant step, by total time.

Prints a table and writes $OUT/<date>-invariant.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import cuda_median_ms, require_cuda  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", nargs="+", default=["32:8"], help="query:key/value heads")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the kernel rows (median)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--fixed-variants", nargs="*", default=[],
                   help="more int64 dQ kernel rows, each with BwdConfig overrides, e.g. fixed_scales_early=0")
    p.add_argument("--baseline-dir", default=None,
                   help="a checkout whose fa4dist also runs cp_invariant=True (mode cp_invariant@baseline)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return p.parse_args(argv)


MODES = {"plain": dict(deterministic=False), "deterministic": dict(deterministic=True),
         "cp_invariant": dict(cp_invariant=True)}


def main(argv=None):
    args = parse_args(argv)
    require_cuda('invariant.py')
    import fa4dist

    device = torch.device("cuda")
    modes = {name: (fa4dist.attention, kw) for name, kw in MODES.items()}
    if args.baseline_dir:
        import sibling  # (bench/, the script's folder, as timing)

        sibling.load("kernels").load_baseline(args.baseline_dir)
        modes["cp_invariant@baseline"] = (sys.modules["fa4dist_baseline"].attention, MODES["cp_invariant"])
    rows = []
    for tokens in args.tokens:
        for spec in args.heads:
            hq, hkv = (int(x) for x in spec.split(":"))
            gen = torch.Generator(device=device).manual_seed(tokens)
            q, k, v, dout = (torch.randn(1, tokens, h, args.headdim, device=device, dtype=torch.bfloat16,
                                         generator=gen) for h in (hq, hkv, hkv, hq))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            times = {}
            for mode, (attention, kw) in modes.items():
                def fwd():
                    with torch.no_grad():
                        attention(*leaves, causal=True, **kw)

                def step():
                    for t in leaves:
                        t.grad = None
                    attention(*leaves, causal=True, **kw).backward(dout)

                times[mode] = (cuda_median_ms(fwd, args.reps), cuda_median_ms(step, args.reps))
            flops = 4 * tokens * tokens / 2 * hq * args.headdim * 3.5  # causal fwd (2 GEMMs) + bwd (5)
            for mode, (f_ms, s_ms) in times.items():
                row = dict(tokens=tokens, heads=hq, kv_heads=hkv, head_dim=args.headdim, mode=mode, fwd_ms=f_ms,
                           step_ms=s_ms, step_vs_plain=s_ms / times["plain"][1],
                           step_vs_deterministic=s_ms / times["deterministic"][1],
                           tflops=flops / (s_ms * 1e-3) / 1e12)
                rows.append(row)
                print(f"{tokens:>7} {hq}/{hkv} {mode:>14}: fwd {f_ms:8.2f} ms  fwd+bwd {s_ms:8.2f} ms  "
                      f"x{row['step_vs_plain']:.3f} of plain  x{row['step_vs_deterministic']:.3f} of deterministic  "
                      f"{row['tflops']:.0f} TFLOP/s", flush=True)
            group = hq // hkv
            rows += _kernel_rows(q, k, v, dout, args)
            if group > 1:  # as cp_invariant calls it: K/V expanded to one head per query head
                rows += _kernel_rows(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), dout,
                                     args)
            if args.profile and tokens == args.tokens[0]:
                _profile(fa4dist, leaves, dout)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{datetime.date.today()}-invariant.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("wrote", path)


def _kernel_rows(q, k, v, dout, args):
    """The CuTe backward alone (preprocess, main kernel, dQ convert; accumulating into zeros): fp32 dQ with and
    without the deterministic tickets, the int64 fixed-point dQ (deterministic with no tickets), and what
    deterministic=True picks (K / V expanded for long causal GQA calls: backward.deterministic_gqa_form)."""
    from fa4dist.kernels import attention_forward, fixed_point
    from fa4dist.kernels.cute.backward import backward, parse_overrides

    out, lse = attention_forward(q, k, v, causal=True, backend="cute")
    scale = fixed_point.dq_scale(dout, out, fixed_point.head_absmax(k).repeat_interleave(q.shape[2] // k.shape[2]),
                                 fixed_point.head_absmax(v).repeat_interleave(q.shape[2] // k.shape[2]),
                                 q.shape[-1] ** -0.5)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq64 = torch.zeros(q.shape, dtype=torch.int64, device=q.device)
    variants = {
        "fp32 dQ": lambda: backward(dout, q, k, v, out, lse, dq32, dk, dv, causal=True, accumulate=True),
        "fp32 dQ, tickets": lambda: backward(dout, q, k, v, out, lse, dq32, dk, dv, causal=True, accumulate=True,
                                             deterministic=True, det_dq="tickets"),
        "deterministic, auto": lambda: backward(dout, q, k, v, out, lse, dq32, dk, dv, causal=True,
                                                accumulate=True, deterministic=True),
        "int64 dQ": lambda: backward(dout, q, k, v, out, lse, dq64, dk, dv, causal=True, accumulate=True,
                                     dq_scale=scale),
    }
    for spec in args.fixed_variants:  # the int64 dQ kernel with BwdConfig overrides (measurement knobs)
        overrides = parse_overrides(spec)
        variants[f"int64 dQ {spec}"] = (lambda o: lambda: backward(dout, q, k, v, out, lse, dq64, dk, dv, causal=True,
                                                                   accumulate=True, dq_scale=scale, **o))(overrides)
    # interleaved rounds (the machine drifts): each variant's median over the rounds' medians
    rounds = [{name: cuda_median_ms(fn, args.reps) for name, fn in variants.items()} for _ in range(args.rounds)]
    times = {name: sorted(r[name] for r in rounds)[len(rounds) // 2] for name in variants}
    rows = []
    for name, ms in times.items():
        row = dict(tokens=q.shape[1], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[-1],
                   mode=f"cute backward, {name}", bwd_ms=ms, vs_fp32=ms / times["fp32 dQ"],
                   vs_tickets=ms / times["fp32 dQ, tickets"])
        rows.append(row)
        print(f"{q.shape[1]:>7} {q.shape[2]}/{k.shape[2]} cute backward, {name:>16}: {ms:8.2f} ms  "
              f"x{row['vs_fp32']:.3f} of fp32 dQ  x{row['vs_tickets']:.3f} of the deterministic one", flush=True)
    return rows


def _profile(fa4dist, leaves, dout):
    from torch.profiler import ProfilerActivity, profile

    def step():
        for t in leaves:
            t.grad = None
        fa4dist.attention(*leaves, causal=True, cp_invariant=True).backward(dout)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=100), flush=True)


if __name__ == "__main__":
    main()
