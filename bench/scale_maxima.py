"""The fixed-point dq's maxima (fa4dist/kernels/fixed_point.py) in several torch forms, timed side by side.

    python bench/scale_maxima.py --tokens 32768 --heads 32 --headdim 128

cp_invariant's backward takes four maxima before its kernels run: max |dO| and max |out| per (token, head), and max
|K|, max |V| per head over finite key vectors.  torch.profiler put the four at 1.36 ms of a 32k step (the row
reductions ran at ~0.8 TB/s).  Every form here gives the same values (a max is exact in any order); the table says
which is fastest for each.  Prints a table and writes $OUT/<date>-scale-maxima.json (or bench/results/).
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

INF = float("inf")


def row_forms(d: int) -> dict:
    """max |t| over the last dim (..., d) -> (...): each form's function."""
    forms = {
        "vector_norm(inf, -1)": lambda t: torch.linalg.vector_norm(t, INF, dim=-1),
        "abs().amax(-1)": lambda t: t.abs().amax(-1),
        "aminmax(-1)": lambda t: (lambda r: torch.maximum(r.max, r.min.neg()))(torch.aminmax(t, dim=-1)),
    }
    for part in (4, 8, 16, 32):  # two stages: over `part` contiguous elements, then over the d / part partial maxima
        if d % part == 0 and part < d:
            forms[f"two stages of {part}"] = (lambda p: lambda t: torch.linalg.vector_norm(
                torch.linalg.vector_norm(t.unflatten(-1, (-1, p)), INF, dim=-1), INF, dim=-1))(part)
    return forms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    require_cuda('scale_maxima.py')
    from fa4dist.kernels import fixed_point

    t = torch.randn(1, args.tokens, args.heads, args.headdim, device="cuda", dtype=torch.bfloat16)
    gbytes = t.numel() * t.element_size() / 1e9
    cases = {f"row: {name}": (lambda f: lambda: f(t))(f) for name, f in row_forms(args.headdim).items()}
    cases["row: fixed_point.absmax (our kernel on the GPU)"] = lambda: fixed_point.absmax(t, -1)
    cases["head: fixed_point.head_absmax (our kernel)"] = lambda: fixed_point.head_absmax(t)
    cases["head: nan_to_num + one reduction"] = lambda: torch.linalg.vector_norm(
        t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), INF, dim=(0, 1, 3))

    def finite_rows_then_heads():  # per (token, head) first, non-finite vectors dropped, then over the tokens
        rows = torch.linalg.vector_norm(t, INF, dim=-1)
        return torch.linalg.vector_norm(torch.where(torch.isfinite(rows), rows, 0.0), INF, dim=(0, 1))

    cases["head: two reductions, no copy"] = finite_rows_then_heads
    want = torch.linalg.vector_norm(t.float(), INF, dim=-1)
    for name, fn in cases.items():  # the same values: a max is exact
        if name.startswith("row"):
            assert torch.equal(fn().float(), want), name
    rounds = [{name: cuda_median_ms(fn, args.reps) for name, fn in cases.items()} for _ in range(args.rounds)]
    rows = []
    for name in cases:
        ms = sorted(r[name] for r in rounds)[len(rounds) // 2]
        rows.append(dict(form=name, ms=ms, tb_per_s=gbytes / ms, tokens=args.tokens, heads=args.heads,
                         head_dim=args.headdim))
        print(f"{name:>50}: {ms * 1e3:8.1f} us  {gbytes / ms:5.2f} TB/s read", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{datetime.date.today()}-scale-maxima.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
