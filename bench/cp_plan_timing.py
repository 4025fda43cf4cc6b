"""Host time of a new context-parallel plan: make_plan, the ring schedule's steps, one rank's schedule work, and the
balance report, for a 128k-token causal sequence (with and without a sliding window) and packed documents.

Every rank builds its own plan and schedule for every new plan (a packed batch: every step), on the CPU, before
its first kernel, so this is per-step latency at large cp.  Per case and cp, the best of ``--repeats`` runs, each on
a fresh plan (nothing cached), in milliseconds:

- ``plan``: ``make_plan``;
- ``steps``: ``Schedule(plan, 1, mask)`` and ``steps()`` (the remote steps some member runs);
- ``rank``: what one rank (member cp // 2) then asks of the schedule: its work list at each step it runs, the key
  ranges it sends at each step, and its own keys' two halves (the ring engine's calls);
- ``report``: ``plan.balance_report()`` (every member's steps and received tokens).

    python bench/cp_plan_timing.py                     # cp 8, 32, 64
    python bench/cp_plan_timing.py --cp 64 --repeats 10 --json bench/out/cp_plan_timing.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import time

from fa4dist.context_parallel import Schedule, make_plan


def packed_documents(seed: int, total: int) -> list[int]:
    """cu_seqlens of a mix of 64-2k and 2k-16k token documents, `total` tokens."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + rng.choice([rng.randint(64, 2048), rng.randint(2048, 16384)])))
    return cu


def time_case(arg, cp: int, repeats: int, **options) -> dict:
    best: dict = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = make_plan(arg, cp, **options)
        t1 = time.perf_counter()
        sched = Schedule(plan, 1, plan.mask)
        steps = sched.steps()
        t2 = time.perf_counter()
        m = cp // 2
        for t in steps:
            sched.items(m, sched.source(m, t))
            sched.send_ranges(m, t)
        sched.own_halves(m)
        t3 = time.perf_counter()
        fresh = make_plan(arg, cp, **options)
        t4 = time.perf_counter()
        fresh.balance_report()
        t5 = time.perf_counter()
        for key, value in (("plan", t1 - t0), ("steps", t2 - t1), ("rank", t3 - t2), ("report", t5 - t4)):
            best[key] = min(best.get(key, float("inf")), value)
    best["chunks"] = plan.num_chunks
    best["steps_run"] = len(steps)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--seqlen", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="bench/out/cp_plan_timing.json", help="where the rows go (seconds)")
    args = p.parse_args(argv)
    cases = [
        ("dense causal", args.seqlen, {}),
        ("dense causal window 4k", args.seqlen, dict(window=(4095, 0))),
        ("packed causal", packed_documents(0, args.seqlen), {}),
    ]
    print(f"{'case':24s} {'cp':>3s} {'chunks':>6s} {'steps':>5s}   plan ms  steps ms   rank ms  report ms")
    rows = []
    for name, arg, options in cases:
        for cp in args.cp:
            r = time_case(arg, cp, args.repeats, **options)
            rows.append(dict(case=name, cp=cp, **r))
            print(f"{name:24s} {cp:3d} {r['chunks']:6d} {r['steps_run']:5d} {r['plan'] * 1e3:9.1f} "
                  f"{r['steps'] * 1e3:9.1f} {r['rank'] * 1e3:9.1f} {r['report'] * 1e3:10.1f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(meta=dict(date=datetime.datetime.now().isoformat(timespec="seconds"), seqlen=args.seqlen,
                                 repeats=args.repeats), rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
