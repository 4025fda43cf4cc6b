"""Balance of default packed plans: the busiest ring group's visible (query, key) pairs over the mean, on random
document mixes, and the chunk count make_plan chose.

Three kinds of mix, 4k-128k tokens: uniform short documents (16-2048 tokens), one long document (30-90% of the
stream) among short ones, and a power law of lengths.  A plan's work is what ``balance_report()`` costs: the
imbalance is max / mean over ring groups (1.0 is perfect).  To compare two versions of the package, run it under each
one's ``PYTHONPATH``: the mixes are the same for a given ``--seed``.

    python bench/cp_balance.py --mixes 400 --json bench/out/cp_balance.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import time

from fa4dist.context_parallel import make_plan


def random_mix(rng: random.Random, total: int) -> tuple[str, list[int]]:
    kind = rng.choice(["uniform", "one-long", "power"])
    lens = [int(total * rng.uniform(0.3, 0.9))] if kind == "one-long" else []
    while sum(lens) < total:
        n = rng.randint(16, 2048) if kind != "power" else int(min(total, 16 * (1 / (rng.random() + 1e-3)) ** 1.2))
        lens.append(min(n, total - sum(lens)))
    rng.shuffle(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return kind, cu


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixes", type=int, default=400)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--totals", type=int, nargs="+", default=[4096, 16384, 32768, 131072])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench/out/cp_balance.json")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows, start = [], time.perf_counter()
    for _ in range(args.mixes):
        cp, total = rng.choice(args.cp), rng.choice(args.totals)
        kind, cu = random_mix(rng, total)
        t0 = time.perf_counter()
        plan = make_plan(cu, cp)
        ms = (time.perf_counter() - t0) * 1e3
        rows.append(dict(kind=kind, cp=cp, total=total, docs=len(cu) - 1, num_chunks=plan.num_chunks, plan_ms=ms,
                         imbalance=plan.balance_report().imbalance))
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["kind"], r["cp"])].append(r)
    print(f"{'mix':9s} {'cp':>3s} {'plans':>5s} {'mean':>7s} {'max':>7s} {'>1%':>4s} {'16/rank':>7s} {'plan ms':>8s}")
    for (kind, cp), rs in sorted(by.items()):
        imb = [r["imbalance"] for r in rs]
        print(f"{kind:9s} {cp:3d} {len(rs):5d} {sum(imb) / len(imb):7.4f} {max(imb):7.4f} "
              f"{sum(x > 1.01 for x in imb):4d} {sum(r['num_chunks'] == 16 * cp for r in rs):7d} "
              f"{max(r['plan_ms'] for r in rs):8.1f}")
    imb = [r["imbalance"] for r in rows]
    print(f"all: {len(rows)} plans, mean {sum(imb) / len(imb):.4f}, max {max(imb):.4f}, "
          f"{sum(x > 1.01 for x in imb)} over 1%, {time.perf_counter() - start:.1f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), seed=args.seed)
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
