"""The work lists in few launches against the per-item loop, on the lists of real ring schedules (fwd and bwd).

For each case (a causal sequence or a packed batch of documents, its plan at cp ranks), every member's forward
lists over all its ring steps (``Schedule.items``: exactly what ``ring.forward_step`` hands the backend) run on one
GPU against stand-in key buffers, two ways in one process, interleaved:

- ``loop``: one contract call per item (the backend's ``forward_items`` switched off: what every list did before);
- ``launch``: the cute backend's work-list path (forward: ``fa4dist.kernels.worklist.forward_launches``, one
  launch per wave of items with disjoint query rows and kernel variant; backward, non-deterministic, through the
  member's shared query side as ``ring.backward_step`` runs it: ``backward_launches``, one main kernel per group
  of items with disjoint key rows).

Reported: launches and items per member (summed over its steps), the slowest member's time both ways (what the
ring waits for), and their ratio; plus the bytes of the one-launch out/lse against the loop's (they must be equal;
the backward's sums are unordered, so its gradients are compared to the loop's relative error).

    python bench/worklist.py                          # the default sweep (H200: a few seconds per case)
    python bench/worklist.py --cp 8 --tokens 131072 --docs 0

Prints a table and writes JSON to $OUT/worklist.json (or bench/out/worklist.json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4dist.context_parallel import Schedule, make_plan  # noqa: E402
from timing import cuda_median_ms, require_cuda  # noqa: E402
from fa4dist.kernels import attention_backward_items, attention_forward_items  # noqa: E402
from fa4dist.kernels.cute import backward as cute_bwd  # noqa: E402
from fa4dist.kernels.worklist import share_queries  # noqa: E402
from fa4dist.kernels.cute import forward as cute_fwd  # noqa: E402
from fa4dist.kernels.cute.backend import CuteSm90Backend  # noqa: E402


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


def run_member_bwd(lists, dout, q, k, v, out, lse, grads, deterministic=False):
    """The member's backward over its steps as the ring runs it: one shared query side, every step's list."""
    shared = share_queries(dout, q, out, lse, deterministic=deterministic, backend="cute")
    for _, items in lists:
        attention_backward_items(dout, q, k, v, out, lse, items, *grads, deterministic=deterministic,
                                 backend="cute", shared=shared)
    if shared is not None:
        shared.finish(grads[0])


@contextlib.contextmanager
def work_list_path(attr: str, mode: str):
    """The cute backend with its work-list entry ``attr`` ("launch") or without it ("loop": the per-item loop)."""
    saved = getattr(CuteSm90Backend, attr)
    if mode == "loop":
        setattr(CuteSm90Backend, attr, None)
    try:
        yield
    finally:
        setattr(CuteSm90Backend, attr, saved)


def measure(direction, sched, cp, q, k, v, args) -> dict:
    """Times every member's lists both ways (interleaved rounds, best of each); the slowest member's times."""
    n, h, d = q.shape[1], q.shape[2], q.shape[3]
    g = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    out = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    lse = torch.randn(1, h, n, device="cuda", generator=g) + 8
    attr = "forward_items" if direction == "fwd" else "backward_items"
    per = {"loop": [], "launch": []}
    counts, diffs = [], []
    for member in range(cp):
        lists = member_lists(sched, member)
        n_items = sum(sum(1 for it in items if it.q_len and it.k_len) for _, items in lists)
        if direction == "fwd":
            bufs = {mode: (torch.zeros(1, n, h, d, device="cuda"), torch.full((1, h, n), float("-inf"),
                                                                              device="cuda")) for mode in per}
            work = {mode: (lambda b=bufs[mode]: run_member(lists, q, k, v, *b)) for mode in per}
        else:
            bufs = {mode: [torch.zeros(t.shape, device="cuda") for t in (q, k, v)] for mode in per}
            det = direction == "bwd-det"
            work = {mode: (lambda b=bufs[mode]: run_member_bwd(lists, dout, q, k, v, out, lse, b, det))
                    for mode in per}
        def reset(mode):
            for buf in bufs[mode]:
                buf.zero_()
            if direction == "fwd":
                bufs[mode][1].fill_(float("-inf"))

        best = {mode: float("inf") for mode in per}
        for _ in range(args.rounds):
            for mode in per:
                with work_list_path(attr, mode):
                    reset(mode)
                    best[mode] = min(best[mode], cuda_median_ms(work[mode], args.reps))
        for mode in per:
            per[mode].append(best[mode])
        # same inputs, both ways once more from the start: the results, and the launch path's kernel calls counted
        module, fn_name = (cute_fwd, "forward_worklist") if direction == "fwd" else (cute_bwd, "backward_worklist")
        real, calls = getattr(module, fn_name), []
        for mode in per:
            with work_list_path(attr, mode):
                reset(mode)
                setattr(module, fn_name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
                try:
                    work[mode]()
                finally:
                    setattr(module, fn_name, real)
        counts.append((n_items, len(calls)))
        for a, b in zip(bufs["launch"], bufs["loop"]):
            fin = torch.isfinite(b)
            scale = b[fin].abs().max().clamp_min(1e-30) if fin.any() else torch.tensor(1.0, device="cuda")
            diffs.append(((a - b)[fin].abs().max() / scale).item() if fin.any() else 0.0)
            if direction == "fwd" and not torch.equal(a, b):
                print(f"  member {member}: one-launch bytes differ from the loop's", flush=True)
    row = dict(direction=direction, items=max(c[0] for c in counts), launches=max(c[1] for c in counts),
               loop_ms=max(per["loop"]), launch_ms=max(per["launch"]), loop_member_ms=per["loop"],
               launch_member_ms=per["launch"], max_rel_diff=max(diffs))
    row["speedup"] = row["loop_ms"] / row["launch_ms"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--docs", type=int, nargs="+", default=[0, 2048], help="mean document length (0: one sequence)")
    p.add_argument("--heads", default="32:8")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd", "bwd-det"])
    args = p.parse_args()
    require_cuda('worklist.py')
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
                for direction in args.directions:
                    row = measure(direction, sched, cp, q, k, v, args)
                    row.update(tokens=tokens, cp=cp, docs=mean, heads=args.heads, headdim=d)
                    rows.append(row)
                    print(f"{direction} {tokens:>7} cp={cp} docs={mean or '-':>5}  items {row['items']:>4} -> "
                          f"launches {row['launches']:>4}   slowest member: loop {row['loop_ms']:8.3f} ms  launch "
                          f"{row['launch_ms']:8.3f} ms  x{row['speedup']:.3f}  (rel diff "
                          f"{row['max_rel_diff']:.1e})", flush=True)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                command=" ".join(sys.argv), kernel=cute_fwd.__name__)
    with open(os.path.join(out_dir, "worklist.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
