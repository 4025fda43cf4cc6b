"""An fp32 model, on the CPU, of the forward's online softmax over one row: how far its lse lies from the exact one
with the old terms' factor taken as exp2(m_old * c - m_new * c) with one rounding ("fused": the kernels' form until
the fifty-ninth session), as exp2((m_old - m_new) * c) ("difference": the fifty-ninth's fix) or as
exp2(M_old - M_new) of maxima stored in log2 units, M = m * c rounded ("stored": softmax.OnlineSoftmax.online since
the sixty-first session, after its GPU run: the fix's accuracy at the fused form's instruction count).

    python bench/lse_drift_model.py --rows 300 --cases 4096:128 16500:176 32768:176

Each row's scores are N(0, 1) (q.k / sqrt(d) of Gaussian inputs); a key tile's exponentials are summed in fp32 and
added to the rescaled running sum, as the kernel does per tile (its per-thread chains and quad sum aside); exp2 is
correctly rounded here, where the GPU's MUFU.EX2 is within ~2 ulp. While the max holds, the fused argument is m * c's
rounding error, whose exp2 is 1 + ~1 ulp, so the sum drifts one ulp of 1 a tile. The model reproduces the H200's
unsplit rows (bench/split_error.py, bench/RESULTS.md fifty-ninth session) to within their sample sizes. Prints a
table and writes $OUT/<date>-lse-drift-model.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

F32 = np.float32
LOG2_E = F32(1.4426950408889634)
LN_2 = F32(0.6931471805599453)


FORMS = ("fused", "difference", "stored")


def row_lse_error(rng, keys: int, tile: int, form: str) -> float:
    """|lse - exact lse| of one row of ``keys`` N(0, 1) scores on key tiles of ``tile``, the old terms' factor in
    ``form`` (one of FORMS)."""
    s = rng.standard_normal(keys).astype(F32)
    c = LOG2_E  # the scores are already scaled by 1 / sqrt(d)
    m, total = F32(-np.inf), F32(0.0)
    for start in range(0, keys, tile):
        v = s[start:start + tile]
        m_new = max(m, v.max())
        m_scaled = F32(m_new * c)
        p = np.exp2((v.astype(np.float64) * c - m_scaled).astype(F32).astype(np.float64)).astype(F32)  # FFMA
        if m == -np.inf:
            factor = F32(0.0)
        elif form == "fused":
            factor = F32(np.exp2(np.float64(F32(np.float64(m) * np.float64(c) - np.float64(m_scaled)))))
        elif form == "difference":
            factor = F32(np.exp2(np.float64(F32(F32(m - m_new) * c))))
        else:  # the stored maxima are the rounded products themselves
            factor = F32(np.exp2(np.float64(F32(F32(m * c) - m_scaled))))
        total = F32(F32(total * factor) + p.sum(dtype=F32))
        m = m_new
    lse = F32(F32(F32(m * c) + F32(np.log2(np.float64(total)))) * LN_2)
    top = float(s.max())
    exact = np.log(np.exp(s.astype(np.float64) - top).sum()) + top
    return abs(float(lse) - exact)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=300)
    p.add_argument("--cases", nargs="+", default=["4096:128", "16500:176", "32768:176"], help="KEYS:KEY_TILE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"{'keys':>6} {'tile':>5} | " + " | ".join(f"{name + ': max / mean':>21}" for name in FORMS))
    for case in args.cases:
        keys, tile = (int(x) for x in case.split(":"))
        res = {}
        for name in FORMS:
            errs = np.array([row_lse_error(rng, keys, tile, name) for _ in range(args.rows)])
            res[name] = dict(max=float(errs.max()), mean=float(errs.mean()))
        rows.append(dict(keys=keys, tile=tile, rows=args.rows, **res))
        print(f"{keys:>6} {tile:>5} | " + " | ".join(f"{res[n]['max']:>10.2e} {res[n]['mean']:>10.2e}" for n in FORMS),
              flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    with open(os.path.join(args.out_dir, f"{now.date().isoformat()}-lse-drift-model.json"), "w") as f:
        json.dump(dict(date=now.isoformat(), command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
