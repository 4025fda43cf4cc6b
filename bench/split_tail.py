"""The split of a few-wave launch's tail against the same kernel unsplit: the forward's (FwdConfig.split_tail:
non-causal the last partial wave, causal the longest tiles) or the backward's (--direction bwd:
backward.split_keys_variant, the key tiles of the same tail), in device time (each call queued behind a device spin, so
the host's launch cost is hidden) and from an idle device (host included), on shapes given as B x S x H at one
head dim, bf16. The backward rows time our backward's kernels (preprocess, main, dQ convert) and the baselines'
backward through autograd.

    python bench/split_tail.py --headdim 128 --shapes 1x4096x5 1x8192x3 4x4096x16 --rounds 5
    python bench/split_tail.py --causal --headdim 128 --shapes 1x4096x4 1x16384x1 1x4096x8 --rounds 5
    python bench/split_tail.py --direction bwd --causal --headdim 128 --shapes 1x4096x4 1x16384x1 --rounds 5

The baselines run in the same rounds, timed the same way: torch's cuDNN SDPA op and flash-attn-4 when carried
(bench/kernels.py's callables). Prints a table (with each shape's tiles and plan) and writes
$OUT/<date>-split-tail.json (or bench/results/).
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

from fa4dist.kernels.cute import backward as bwd  # noqa: E402
from fa4dist.kernels.cute import forward as fwd  # noqa: E402
from fa4dist.kernels.cute import host  # noqa: E402
import sibling  # noqa: E402  (bench/, the script's folder, as timing)
from timing import cuda_median_ms, require_cuda  # noqa: E402

kbench = sibling.load("kernels")  # bench/kernels.py: the baselines' callables


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--shapes", nargs="+", default=["1x4096x5", "1x8192x3", "4x4096x16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    require_cuda('split_tail.py')
    d = args.headdim
    fa4 = kbench._fa4()
    rows = []
    for shape in args.shapes:
        b, s, h = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        causal = args.causal
        if args.direction == "fwd":
            cfg = fwd.make_config(q.dtype, d, causal=causal, varlen=False, accumulate=False)
            tiles = b * h * -(-s // cfg.tile_m)
            plan = fwd.dense_split_plan(cfg, q.shape, s)
            split_tiles = fwd.split_tile_count(cfg, q.shape, plan) if plan[1] > 1 else 0
            calls = {"split": lambda: fwd.forward(q, k, v, out, lse, causal=causal),
                     "unsplit": lambda: fwd.forward(q, k, v, out, lse, causal=causal, split_tail=False),
                     "cudnn": lambda: kbench._cudnn_raw(q, k, v, causal)}
            if fa4 is not None:
                calls["flash_attn_4"] = lambda: fa4(q, k, v, causal=causal)
        else:
            calls, tiles, split_tiles, plan = _backward_calls(q, k, v, out, lse, causal, fa4)
        times = {(name, mode): [] for name in calls for mode in ("device", "host")}
        for _ in range(args.rounds):  # interleaved rounds
            for name, fn in calls.items():
                times[(name, "device")].append(cuda_median_ms(fn, args.reps, queue_ahead_ms=5.0))
                times[(name, "host")].append(cuda_median_ms(fn, args.reps))
        flops = 4 * b * h * s * s * d // (2 if causal else 1) * (2.5 if args.direction == "bwd" else 1)
        row = dict(shape=shape, headdim=d, causal=causal, direction=args.direction, tiles=tiles,
                   ctas=host.sm_count(), split_tiles=split_tiles, parts=plan[1])
        for (name, mode), t in times.items():
            row[f"{name}_{mode}_ms"] = statistics.median(t)
            row[f"{name}_{mode}_tflops"] = flops / statistics.median(t) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| shape (B x S x H) | tiles | plan | device: split / unsplit TFLOP/s | gain | cuDNN | flash-attn-4 "
          "| split / FA4 | from idle: split / unsplit | gain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dev = r["unsplit_device_ms"] / r["split_device_ms"] - 1
        idle = r["unsplit_host_ms"] / r["split_host_ms"] - 1
        fa4_tf = r.get("flash_attn_4_device_tflops")
        fa4_cols = f"{fa4_tf:.0f} | {r['split_device_tflops'] / fa4_tf:.2f}" if fa4_tf else "- | -"
        print(f"| {r['shape']} | {r['tiles']} | {r['split_tiles']} in {r['parts']} | "
              f"{r['split_device_tflops']:.0f} / {r['unsplit_device_tflops']:.0f} | {dev:+.1%} | "
              f"{r['cudnn_device_tflops']:.0f} | {fa4_cols} | "
              f"{r['split_host_tflops']:.0f} / {r['unsplit_host_tflops']:.0f} | {idle:+.1%} |")
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{date}-split-tail-{args.direction}.json"), "w") as fh:
        json.dump(dict(date=date, device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)


def _backward_calls(q, k, v, out, lse, causal, fa4):
    """(calls, key tiles, split key tiles, plan) of the backward rows: ours split (as the default plans) and not,
    the baselines' backward through autograd on their own forward's graph."""
    fwd.forward(q, k, v, out, lse, causal=causal)
    dout = torch.randn_like(q)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    b, s, h, d = q.shape
    _, main_cfg, _ = bwd.make_configs(q.dtype, d, causal=causal, varlen=False, seg_offsets=False, accumulate=False,
                                      deterministic=False, dq_dtype=q.dtype, dkv_dtype=q.dtype, o_dtype=q.dtype,
                                      do_dtype=q.dtype, max_seqlen_k=s)
    split_cfg = bwd.split_keys_variant(main_cfg)
    plan = bwd.dense_split_keys_plan(split_cfg, q.shape, k.shape, 0) if split_cfg is not None else (0, 1)
    calls = {"split": lambda: bwd.backward(dout, q, k, v, out, lse, *grads, causal=causal),
             "unsplit": lambda: bwd.backward(dout, q, k, v, out, lse, *grads, causal=causal, split_keys=False)}
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    ref = kbench._cudnn_raw(qg, kg, vg, causal)
    calls["cudnn"] = lambda: torch.autograd.grad(ref, (qg, kg, vg), dout, retain_graph=True)
    if fa4 is not None:
        r = fa4(qg, kg, vg, causal=causal)
        fa4_out = r[0] if isinstance(r, tuple) else r
        calls["flash_attn_4"] = lambda: torch.autograd.grad(fa4_out, (qg, kg, vg), dout, retain_graph=True)
    split_tiles = bwd.split_key_tile_count(split_cfg, k.shape, plan) if plan[1] > 1 else 0
    return calls, b * k.shape[2] * -(-s // 128), split_tiles, plan


if __name__ == "__main__":
    main()
