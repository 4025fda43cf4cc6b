"""How far a split tile's lse and out lie from fp64, beside the same rows of the unsplit launch (FwdConfig.split_tail).

    python bench/split_error.py --cases 1x2200x16500x9x3 1x4000x4050x5x1 1x16384x16384x1x1:causal

A split tile sums its exponentials as parts over its key blocks and merges them (in part order); the unsplit tile sums
them in one loop. Both are fp32 sums of the same terms in two orders, so their lse differ by rounding. This script
answers whether the split rows are less accurate than the unsplit ones or only differently rounded: per case, over the
split rows only, the max and 99.9th percentile of |lse - lse_fp64| for the split and the unsplit launch, of
|lse_split - lse_unsplit|, and the same for out (bf16), where lse_fp64 is logsumexp of the fp64 scores of the same bf16
inputs (computed on the GPU, one chunk of query rows at a time). Cases are BxSQxSKxHxHK at --headdim, dense, causal
with ":causal" (q_offset = SK - SQ then: the bottom-right diagonal). Prints a table and writes
$OUT/<date>-split-error.json (or bench/results/). flash-attn-4's lse on the same rows (when carried) stands beside them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fa4dist.kernels.cute import forward as fwd  # noqa: E402
import sibling  # noqa: E402  (bench/, the script's folder)
from timing import require_cuda  # noqa: E402


def fp64_rows(q, k, v, causal, q_off, rows, chunk=512):
    """(lse (H, n), out (n, H, D)) in fp64 of the query rows ``rows`` (a 1-D index tensor) of one sequence."""
    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    kd = k.double().repeat_interleave(h // hk, dim=1).permute(1, 2, 0)  # (H, D, SK)
    vd = v.double().repeat_interleave(h // hk, dim=1).transpose(0, 1)  # (H, SK, D)
    keys = torch.arange(k.shape[0], device=q.device)
    lses, outs = [], []
    for start in range(0, rows.numel(), chunk):
        idx = rows[start:start + chunk]
        s = q[idx].double().transpose(0, 1) @ kd / math.sqrt(d)  # (H, c, SK)
        if causal:
            s.masked_fill_((keys[None, :] > (idx + q_off)[:, None])[None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        lses.append(lse)
        outs.append((torch.exp(s - lse[..., None]) @ vd).transpose(0, 1))
    return torch.cat(lses, dim=1), torch.cat(outs, dim=0)


def launch(q, k, v, causal, q_off, **kw):
    """fwd.forward into poisoned out / lse (b, h, sq)."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
    fwd.forward(q, k, v, out, lse, causal=causal, q_offset=q_off, **kw)
    torch.cuda.synchronize()
    return out, lse


def stats(x):
    x = x.flatten().double()
    return dict(max=float(x.max()), p999=float(torch.quantile(x[:2**24], 0.999)), mean=float(x.mean()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["1x2200x16500x9x3", "1x4000x4050x5x1",
                                                  "1x16384x16384x1x1:causal", "1x4096x4096x4x1:causal"])
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    require_cuda("split_error.py")
    d = args.headdim
    fa4 = sibling.load("kernels")._fa4()  # flash-attn-4's lse on the same rows, when carried
    rows_out = []
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'case':>28} {'tile_n':>6} {'split rows':>10} | {'lse err max/p99.9 split':>24} "
          f"{'unsplit':>20} | {'split-unsplit':>20} | {'out err max split/unsplit':>26} | {'flash-attn-4 lse':>20}")
    for case in args.cases:
        shape, _, mode = case.partition(":")
        b, sq, sk, h, hk = (int(x) for x in shape.split("x"))
        causal = mode == "causal"
        q_off = sk - sq if causal else 0
        cfg = fwd.make_config(torch.bfloat16, d, causal=causal, varlen=False, accumulate=False,
                              wide=fwd.wide_tiles_launch(d, causal, True, sk))
        edge, parts = fwd.dense_split_plan(cfg, (b, sq, h, d), sk, q_off)
        if parts == 1:
            print(f"{case:>28}: no split on {cfg.persistent_ctas} SMs")
            continue
        split = fwd.split_rows(cfg, (b, sq, h, d), (edge, parts))  # (b, h, sq)
        gen = torch.Generator(device="cuda").manual_seed(args.seed * 1000003 + sq + sk + d)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))

        (o_s, l_s), (o_u, l_u) = (launch(q, k, v, causal, q_off, **kw) for kw in ({}, dict(split_tail=False)))
        l_f = None if fa4 is None else fa4(q, k, v, causal=causal, return_lse=True)[1]  # (b, h, sq); bottom-right
        err = {key: [] for key in ("l_s", "l_u", "l_su", "o_s", "o_u") + (() if l_f is None else ("l_fa4",))}
        for bi in range(b):
            # the rows of any head that is split: every head's split rows are the same for causal, not for non-causal
            rows = split[bi].any(0).nonzero().flatten().cuda()
            lse64, out64 = fp64_rows(q[bi], k[bi], v[bi], causal, q_off, rows)
            mask = split[bi][:, rows.cpu()].cuda()  # (H, n)
            omask = mask.transpose(0, 1)  # (n, H)
            err["l_s"].append((l_s[bi][:, rows].double() - lse64)[mask].abs())
            err["l_u"].append((l_u[bi][:, rows].double() - lse64)[mask].abs())
            err["l_su"].append((l_s[bi][:, rows] - l_u[bi][:, rows])[mask].abs())
            err["o_s"].append((o_s[bi][rows].double() - out64)[omask].abs())
            err["o_u"].append((o_u[bi][rows].double() - out64)[omask].abs())
            if l_f is not None:
                err["l_fa4"].append((l_f[bi][:, rows].double() - lse64)[mask].abs())
        st = {key: stats(torch.cat(val)) for key, val in err.items()}
        row = dict(case=case, headdim=d, causal=causal, tile_n=cfg.tile_n, tile_m=cfg.tile_m, parts=parts,
                   split_rows=int(split.sum()), lse_max=float(l_u.max()), **st)
        rows_out.append(row)
        print(f"{case:>28} {cfg.tile_n:>6} {row['split_rows']:>10} | "
              f"{st['l_s']['max']:>11.2e} {st['l_s']['p999']:>11.2e}  {st['l_u']['max']:>9.2e} "
              f"{st['l_u']['p999']:>9.2e} | {st['l_su']['max']:>9.2e} {st['l_su']['p999']:>9.2e} | "
              f"{st['o_s']['max']:>12.2e} {st['o_u']['max']:>12.2e} | "
              + (f"{st['l_fa4']['max']:>9.2e} {st['l_fa4']['p999']:>9.2e}" if l_f is not None else "-"), flush=True)
        del q, k, v, o_s, o_u, l_s, l_u, l_f
        torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    with open(os.path.join(args.out_dir, f"{now.date().isoformat()}-split-error.json"), "w") as f:
        json.dump(dict(date=now.isoformat(), command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                       rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
