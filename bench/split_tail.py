"""The forward's split of the last partial wave (FwdConfig.split_tail) against the same kernel unsplit, in device
time (each call queued behind a device spin, so the host's launch cost is hidden) and from an idle device (host
included), on shapes given as B x S x H at one head dim, non-causal, bf16.

    python bench/split_tail.py --headdim 128 --shapes 1x4096x5 1x8192x3 4x4096x16 --rounds 5

Prints a table (with each shape's tiles and split_plan) and writes $OUT/<date>-split-tail.json (or bench/results/).
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

from fa4dist.kernels.cute import forward as fwd  # noqa: E402
from timing import cuda_median_ms  # noqa: E402  (bench/, the script's folder)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["1x4096x5", "1x8192x3", "4x4096x16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    d = args.headdim
    rows = []
    for shape in args.shapes:
        b, s, h = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        cfg = fwd.make_config(q.dtype, d, causal=False, varlen=False, accumulate=False)
        tiles = b * h * -(-s // cfg.tile_m)
        plan = fwd.dense_split_plan(cfg, q.shape, s)
        calls = {"split": lambda: fwd.forward(q, k, v, out, lse),
                 "unsplit": lambda: fwd.forward(q, k, v, out, lse, split_tail=False)}
        times = {(name, mode): [] for name in calls for mode in ("device", "host")}
        for _ in range(args.rounds):  # interleaved rounds
            for name, fn in calls.items():
                times[(name, "device")].append(cuda_median_ms(fn, args.reps, queue_ahead_ms=5.0))
                times[(name, "host")].append(cuda_median_ms(fn, args.reps))
        flops = 4 * b * h * s * s * d
        row = dict(shape=shape, headdim=d, tiles=tiles, ctas=cfg.persistent_ctas, split_start=plan[0], parts=plan[1])
        for (name, mode), t in times.items():
            row[f"{name}_{mode}_ms"] = statistics.median(t)
            row[f"{name}_{mode}_tflops"] = flops / statistics.median(t) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| shape (B x S x H) | tiles | plan | device: split / unsplit TFLOP/s | gain | from idle: split / unsplit "
          "| gain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        dev = r["unsplit_device_ms"] / r["split_device_ms"] - 1
        host = r["unsplit_host_ms"] / r["split_host_ms"] - 1
        print(f"| {r['shape']} | {r['tiles']} | {r['split_start']} + {r['tiles'] - r['split_start']} x {r['parts']} | "
              f"{r['split_device_tflops']:.0f} / {r['unsplit_device_tflops']:.0f} | {dev:+.1%} | "
              f"{r['split_host_tflops']:.0f} / {r['unsplit_host_tflops']:.0f} | {host:+.1%} |")
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{date}-split-tail.json"), "w") as fh:
        json.dump(dict(date=date, device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
