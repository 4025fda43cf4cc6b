"""The work-list forward in few launches against the per-item loop, on the lists of real ring schedules.

For each case (a causal sequence or a packed batch of documents, its plan at cp ranks), every member's forward
lists over all its ring steps (``Schedule.items``: exactly what ``ring.forward_step`` hands the backend) run on one
GPU against stand-in key buffers, two ways in one process, interleaved:

- ``loop``: one contract call per item (the backend's ``forward_items`` switched off: what every list did before);
- ``launch``: the cute backend's work-list path (``fa4dist.kernels.worklist.forward_launches``: one launch per wave
  of items with disjoint query rows and kernel variant).

Reported: launches and items per member (summed over its steps), the slowest member's time both ways (what the
ring waits for), and their ratio; plus the bytes of the one-launch out/lse against the loop's (they must be equal).

    python bench/worklist.py                          # the default sweep (H200: a few seconds per case)
    python bench/worklist.py --cp 8 --tokens 131072 --docs 0

Prints a table and writes JSON to $OUT/worklist.json (or bench/out/worklist.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4dist.context_parallel import Schedule, make_plan  # noqa: E402
from fa4dist.kernels import attention_forward_items  # noqa: E402
from fa4dist.kernels.cute import forward as cute_fwd  # noqa: E402
from fa4dist.kernels.cute.backend import CuteSm90Backend  # noqa: E402
from fa4dist.kernels.worklist import forward_launches  # noqa: E402


def documents(total: int, mean: int, seed: int) -> list[int]:
    """cu_seqlens of a packed batch: document lengths drawn around ``mean`` (geometric-like), summing to total."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + max(64, int(rng.expovariate(1 / mean)))))
    return cu


def member_lists(sched: Schedule, member: int):
    """(fresh, items) of each step of `member`, in ring order."""
    out = []
    for step in range(sched.ring_size):
        items = sched.items(member, sched.source(member, step))
        if items:
            out.append((step == 0, list(items)))
    return out


def run_member(lists, q, k, v, out, lse):
    for fresh, items in lists:
        attention_forward_items(q, k, v, items, out, lse, fresh=fresh, backend="cute")


def time_fn(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--docs", type=int, nargs="+", default=[0, 2048], help="mean document length (0: one sequence)")
    p.add_argument("--heads", default="32:8")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    h, hk = (int(x) for x in args.heads.split(":"))
    d = args.headdim
    rows = []
    for tokens in args.tokens:
        for cp in args.cp:
            for mean in args.docs:
                cu = documents(tokens, mean, seed=tokens + cp) if mean else None
                plan = make_plan(torch.tensor(cu) if cu else tokens, cp, "lpt" if cu else "zigzag")
                sched = Schedule(plan, 1, True)
                n = max(m.length for m in sched.members)
                g = torch.Generator(device="cuda").manual_seed(cp)
                q = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                k, v = (torch.randn(1, n, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
                variant = lambda it: (it.causal or d > 64, it.window)  # noqa: E731 - the backend's grouping
                per = {"loop": [], "launch": []}
                counts = []
                for member in range(cp):
                    lists = member_lists(sched, member)
                    n_items = sum(sum(1 for it in items if it.q_len and it.k_len) for _, items in lists)
                    n_launch = sum(len(forward_launches(items, fresh, variant)[1]) for fresh, items in lists)
                    counts.append((n_items, n_launch))
                    bufs = {mode: (torch.zeros(1, n, h, d, device="cuda"),
                                   torch.full((1, h, n), float("-inf"), device="cuda")) for mode in per}
                    best = {mode: float("inf") for mode in per}
                    for _ in range(args.rounds):
                        for mode in per:
                            saved = CuteSm90Backend.forward_items
                            if mode == "loop":  # the backend without its work-list path: the per-item loop
                                CuteSm90Backend.forward_items = None
                            try:
                                t = time_fn(lambda: run_member(lists, q, k, v, *bufs[mode]), args.reps)
                            finally:
                                CuteSm90Backend.forward_items = saved
                            best[mode] = min(best[mode], t)
                    same = all(torch.equal(a, b) for a, b in zip(bufs["loop"], bufs["launch"]))
                    for mode in per:
                        per[mode].append(best[mode])
                    if not same:
                        print(f"  member {member}: one-launch bytes differ from the loop's", flush=True)
                row = dict(tokens=tokens, cp=cp, docs=mean, heads=args.heads, headdim=d,
                           items=max(c[0] for c in counts), launches=max(c[1] for c in counts),
                           loop_ms=max(per["loop"]), launch_ms=max(per["launch"]),
                           loop_member_ms=per["loop"], launch_member_ms=per["launch"])
                row["speedup"] = row["loop_ms"] / row["launch_ms"]
                rows.append(row)
                print(f"{tokens:>7} cp={cp} docs={mean or '-':>5}  items {row['items']:>4} -> launches "
                      f"{row['launches']:>4}   slowest member: loop {row['loop_ms']:8.3f} ms  launch "
                      f"{row['launch_ms']:8.3f} ms  x{row['speedup']:.3f}", flush=True)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                command=" ".join(sys.argv), kernel=cute_fwd.__name__)
    with open(os.path.join(out_dir, "worklist.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
