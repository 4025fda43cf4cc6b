"""Sliding windows, softcap and sinks on one GPU: ours (through the kernel contract, backend auto) beside
flash-attn-4 with the same options, in one process, interleaved rounds, medians.

    python bench/window.py                       # S 32k, hdim 128, bf16, W = 4096, batch 1, 16 heads
    python bench/window.py --seqlen 8192 --window 1024
    python bench/window.py --cases causal window --window 1024

Rows: causal (no window), causal + window W, causal + sinks, causal + softcap 30 (ours only where a fast backend
takes the options; the reference backend is not timed), each forward and forward+backward, TFLOP/s counted on the
visible pairs; the cost of sinks and softcap (time against the same library's causal row); plus the relative error
of ours against the reference backend for the window, sink and softcap rows.  Writes $OUT/<date>-window.json (or
bench/results/).
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
from fa4dist.kernels.mask import Mask, visible_pairs  # noqa: E402
from timing import cuda_median_ms, require_cuda  # noqa: E402  (bench/, the script's folder)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", nargs="+", choices=["causal", "window", "sinks", "softcap"],
                   default=["causal", "window", "sinks", "softcap"], help="the rows to time (the options' cost "
                   "needs the causal row)")
    p.add_argument("--queue-ahead-ms", type=float, default=0.0,
                   help="queue each timed call behind a device spin of this length: device time alone, the host's "
                        "launch overhead hidden (default 0: timed from an idle device, host time included)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require_cuda('window.py')
    torch.manual_seed(0)
    s, h, d, w = args.seqlen, args.heads, args.headdim, args.window
    q, k, v, dout = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = torch.randn(h, device="cuda", dtype=torch.float32, requires_grad=True)
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        flash_attn_func = None
    cases = {
        "causal": dict(ours=dict(causal=True), fa4=dict(causal=True), mask=Mask(True)),
        f"window {w}": dict(ours=dict(causal=True, window=(w - 1, 0)), fa4=dict(causal=True, window_size=(w - 1, 0)),
                            mask=Mask(True, (w - 1, -1))),
        "sinks": dict(ours=dict(causal=True, sinks=sinks), fa4=dict(causal=True, learnable_sink=sinks),
                      mask=Mask(True)),
        "softcap 30": dict(ours=dict(causal=True, softcap=30.0), fa4=dict(causal=True, softcap=30.0),
                           mask=Mask(True)),
    }
    cases = {name: case for name, case in cases.items() if name.split()[0] in args.cases}
    from fa4dist.kernels import select_backend
    from fa4dist.kernels.problem import validate_inputs

    def fast(kw) -> bool:  # a backend other than the reference computes these options
        return select_backend("auto", validate_inputs(q, k, v, **kw), "forward").name != "reference"

    rows = []
    for name, case in cases.items():
        pairs = visible_pairs(s, s, 0, 0, case["mask"]) * h
        flops_fwd = 4 * pairs * d
        impls = {}
        if fast(case["ours"]):
            impls["ours"] = lambda kw=case["ours"]: fa4dist.attention(*leaves, **kw)
        if flash_attn_func is not None:
            impls["flash-attn-4"] = lambda kw=case["fa4"]: _fa4_out(flash_attn_func(*leaves, **kw))
        result = {impl: {"fwd": [], "fwdbwd": []} for impl in impls}
        for _ in range(args.rounds):  # interleaved rounds
            for impl, fn in impls.items():
                try:
                    with torch.no_grad():
                        result[impl]["fwd"].append(cuda_median_ms(fn, 5, queue_ahead_ms=args.queue_ahead_ms))
                    result[impl]["fwdbwd"].append(cuda_median_ms(lambda fn=fn: fn().backward(dout), 5,
                                                                 queue_ahead_ms=args.queue_ahead_ms))
                except Exception as err:  # noqa: BLE001 - an option a library lacks is a result
                    result[impl]["error"] = f"{type(err).__name__}: {err}"[:300]
                    break
        row = dict(case=name, seqlen=s, heads=h, headdim=d)
        for impl, r in result.items():
            if r.get("error"):
                row[impl] = dict(error=r["error"])
                continue
            f, fb = statistics.median(r["fwd"]), statistics.median(r["fwdbwd"])
            row[impl] = dict(fwd_ms=f, fwdbwd_ms=fb, fwd_tflops=flops_fwd / f / 1e9,
                             fwdbwd_tflops=3.5 * flops_fwd / fb / 1e9)
        if name != "causal" and "ours" in impls:  # ours against the reference backend on the same GPU
            with torch.no_grad():
                got = fa4dist.attention(q, k, v, **case["ours"]).float()
                small = slice(0, min(s, 4096))
                ref = fa4dist.attention(q[:, small], k[:, small], v[:, small], backend="reference",
                                        **case["ours"]).float()
                row["rel_error_vs_reference_first_4k"] = float((got[:, small] - ref).norm() / ref.norm())
        rows.append(row)
        print(json.dumps(row), flush=True)
    causal = rows[0] if rows and rows[0]["case"] == "causal" else {}
    for row in rows:  # the options' cost: time over the causal row's (same visible pairs), per library
        if row["case"] in ("sinks", "softcap 30"):
            for impl in ("ours", "flash-attn-4"):
                mine, base = row.get(impl, {}), causal.get(impl, {})
                if "fwd_ms" in mine and "fwd_ms" in base:
                    mine["cost_vs_causal"] = dict(fwd=mine["fwd_ms"] / base["fwd_ms"] - 1,
                                                  fwdbwd=mine["fwdbwd_ms"] / base["fwdbwd_ms"] - 1)
    print("| case | ours fwd / fwd+bwd TFLOP/s | flash-attn-4 fwd / fwd+bwd | ratio fwd / fwd+bwd | cost vs causal: "
          "ours / flash-attn-4 (fwd, fwd+bwd) |")
    print("|---|---|---|---|---|")
    for row in rows:
        o, f = row.get("ours", {}), row.get("flash-attn-4", {})
        cell = lambda x: "-" if "fwd_tflops" not in x else f"{x['fwd_tflops']:.0f} / {x['fwdbwd_tflops']:.0f}"  # noqa
        ratio = "-" if "fwd_tflops" not in o or "fwd_tflops" not in f else (
            f"{o['fwd_tflops'] / f['fwd_tflops']:.2f} / {o['fwdbwd_tflops'] / f['fwdbwd_tflops']:.2f}")
        cost = lambda x: "-" if "cost_vs_causal" not in x else (  # noqa
            f"{x['cost_vs_causal']['fwd']:+.0%}, {x['cost_vs_causal']['fwdbwd']:+.0%}")
        print(f"| {row['case']} | {cell(o)} | {cell(f)} | {ratio} | {cost(o)} / {cost(f)} |")
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{date}-window.json"), "w") as fh:
        json.dump(dict(date=date, device=torch.cuda.get_device_name(), queue_ahead_ms=args.queue_ahead_ms,
                       rows=rows), fh, indent=1)


def _fa4_out(result):
    return result[0] if isinstance(result, tuple) else result


if __name__ == "__main__":
    main()
