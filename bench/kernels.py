"""Single-GPU attention throughput: every available fa4dist backend beside its baselines, in one process.

    python bench/kernels.py                         # full sweep, writes <out-dir>/<date>-kernels.{json,png}
    python bench/kernels.py --headdims 128 --seqlens 4096 16384 --directions fwd --rounds 5
    python bench/kernels.py --cute-variants fwd:rescale_threshold=0 bwd:det_chunk=8   # cute config overrides
    python bench/kernels.py --softcap 30 --backends cute flash_attn_4      # soft-capped scores (Gemma 2)
    python bench/kernels.py --kv-group 4 --deterministic --cute-variants bwd-det:det_dq=expanded   # GQA
    python bench/kernels.py --deterministic --cute-variants bwd-det:grads=all bwd-det:grads=dq bwd-det:grads=dkv
    python bench/kernels.py --seqlens 1024 --queue-ahead-ms 2   # device time, not do_bench's (host time shows)
    python bench/kernels.py --baseline-dir OLD   # also "cute@baseline": OLD/fa4dist (another checkout) interleaved

Baselines: flash-attn-4 when installed, and ``cudnn``, torch's cuDNN SDPA op called directly (the cute/cuDNN
column; ``--backends sdpa_cudnn`` brings it too). ``sdpa_cudnn`` is our contract's backend over that op, with the
masked-key guard around it: a backend we ship, timed like ours, not the baseline.

Sizes follow ../shared/docs/anchors.md: batch = total_tokens / seqlen, heads = model_dim / headdim, bf16.
TFLOP/s counts 4*B*H*S^2*D per forward (half of it when causal) and 2.5x that per backward.  Before timing, each
backend's forward output is checked against torch's flash kernel (relative error printed), so a fast wrong kernel
shows; that is the distance between two bf16 kernels, not accuracy (bench/fwd_error.py measures against fp64).
Timing: for every point, every (backend, direction, deterministic) is timed once per round, rounds interleaved
(round 1 of all of them, then round 2, ...), and the median over the rounds is reported: slow drifts of the
machine hit every backend alike.  Compare the ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fa4dist.kernels import attention_backward, attention_forward, available_backends  # noqa: E402


def bench_ms(fn, warmup_ms=25, rep_ms=100, queue_ahead_ms=0.0) -> float:
    """Median ms of ``fn``: triton's do_bench (L2 flushed before each call; a call whose host work outlasts the
    flush is timed with its host time), or with ``queue_ahead_ms`` > 0 device time alone (each call queued behind
    a device spin, bench/timing.py; L2 not flushed)."""
    if queue_ahead_ms > 0:
        from timing import cuda_median_ms

        return cuda_median_ms(fn, 30, queue_ahead_ms=queue_ahead_ms)
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:  # CUDA events (bench/timing.py, this script's folder)
        from timing import cuda_median_ms

        return cuda_median_ms(fn, 20)


_BASELINE = None  # the fa4dist.kernels module of --baseline-dir, imported as fa4dist_baseline


def load_baseline(checkout: str):
    """Import ``checkout/fa4dist`` under the name fa4dist_baseline (its kernels use relative imports only), so an
    older checkout's kernels run beside this one's in the same rounds: an A/B free of the machine's drift."""
    import importlib.util

    pkg = os.path.join(os.path.abspath(checkout), "fa4dist")
    spec = importlib.util.spec_from_file_location("fa4dist_baseline", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fa4dist_baseline"] = mod
    spec.loader.exec_module(mod)
    import fa4dist_baseline.kernels as kernels

    return kernels


def flops(batch, heads, seqlen, headdim, causal, direction):
    f = 4.0 * batch * heads * seqlen * seqlen * headdim / (2 if causal else 1)
    return f * (2.5 if direction == "bwd" else 1.0)


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # not carried on this machine
        return None
    return flash_attn_func


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def parse_variants(specs):
    """["fwd:rescale_threshold=0.0", "bwd-det:det_chunk=8", "d64:fwd:tile_m=128"] -> [(name, headdim|None,
    direction, overrides)]; direction fwd, bwd, or bwd-det (deterministic rows only). Values are parsed as int,
    float (with a point), bool (true / false) or else kept as words: write them as the config field's type."""
    out = []
    for spec in specs or []:
        parts = spec.split(":")
        d = None
        if parts[0].startswith("d") and parts[0][1:].isdigit():
            d = int(parts[0][1:])
            parts = parts[1:]
        direction, kv = parts[0], parts[1] if len(parts) > 1 else ""
        kw = {}
        for item in filter(None, kv.split(",")):
            key, val = item.split("=")
            low = val.lower()
            if low in ("true", "false"):
                kw[key] = low == "true"
            else:
                try:
                    kw[key] = int(val)
                except ValueError:
                    try:
                        kw[key] = float(val)
                    except ValueError:
                        kw[key] = val  # a word (grads=dq)
        out.append((f"cute[{spec}]", d, direction, kw))
    return out


def _cudnn_raw(q, k, v, causal):
    """torch's own cuDNN attention, called directly (no contract, no masked-key guard): the baseline anchors.md
    measured. (B, S, H, D) in and out, as the other backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


# torch's cuDNN SDPA op as is: the cuDNN baseline of the ratio column. "sdpa_cudnn" is our contract's backend over
# the same op, with the masked-key guard's passes around it (kernels/guard.py): a backend we ship, not the baseline
CUDNN_RAW = "cudnn"


def _make_fn(name, direction, deterministic, q, k, v, dout, causal, fa4, overrides, softcap=None):
    """(callable, forward output or None) for one timed item. softcap: None, or every backend's scores capped."""
    cap = {} if softcap is None else dict(softcap=softcap)
    if name == CUDNN_RAW:
        if direction == "fwd":
            fn = lambda: _cudnn_raw(q, k, v, causal)  # noqa: E731
            return fn, fn()
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = _cudnn_raw(qg, kg, vg, causal)
        return (lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)), None
    if name == "flash_attn_4":
        if direction == "fwd":
            def fwd():
                r = fa4(q, k, v, causal=causal, **cap)
                return r[0] if isinstance(r, tuple) else r
            return fwd, fwd()
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        r = fa4(qg, kg, vg, causal=causal, deterministic=deterministic, **cap)
        out = r[0] if isinstance(r, tuple) else r
        return (lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)), None
    if overrides is not None:  # a cute variant: the kernel entry points with config overrides
        from fa4dist.kernels.cute import backward as cbwd
        from fa4dist.kernels.cute import forward as cfwd

        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
        if direction == "fwd":
            fn = lambda: cfwd.forward(q, k, v, out, lse, causal=causal, **cap, **overrides)  # noqa: E731
            fn()
            return fn, out
        cfwd.forward(q, k, v, out, lse, causal=causal, **cap)
        overrides = dict(overrides)
        which = overrides.pop("grads", None)  # all / dq / dkv: added into fp32 buffers, as the cp_invariant engine
        if which is None:
            grads = [torch.empty_like(t) for t in (q, k, v)]
        else:
            grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
            grads = {"all": grads, "dq": [grads[0], None, None], "dkv": [None, grads[1], grads[2]]}[which]
        steps = cbwd.launch_steps(dout, q, k, v, out, lse, *grads, causal=causal, deterministic=deterministic,
                                  accumulate=which is not None, **cap, **overrides)
        return (lambda: [st() for st in steps]), None
    fwd_api, bwd_api = attention_forward, attention_backward
    if name == "cute@baseline":
        fwd_api, bwd_api, name = _BASELINE.attention_forward, _BASELINE.attention_backward, "cute"
    if direction == "fwd":
        fn = lambda: fwd_api(q, k, v, causal=causal, backend=name, **cap)  # noqa: E731
        return fn, fn()[0]
    out, lse = fwd_api(q, k, v, causal=causal, backend=name, **cap)
    return (lambda: bwd_api(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                            backend=name, **cap)), None


def run(args):
    device = torch.device("cuda")
    for headdim in args.headdims:
        if (args.model_dim // headdim) % args.kv_group:
            raise SystemExit(f"--kv-group {args.kv_group} must divide the {args.model_dim // headdim} heads of "
                             f"hdim {headdim}")
    backends = [b for b in available_backends(device) if b != "sdpa"]  # "sdpa" is cudnn-or-flash: listed apart
    if args.backends:
        backends = [b for b in args.backends if b in backends]
    fa4 = _fa4()
    if fa4 is not None and (not args.backends or "flash_attn_4" in args.backends):
        backends.append("flash_attn_4")
    if not args.backends or CUDNN_RAW in args.backends or "sdpa_cudnn" in args.backends:
        backends.append(CUDNN_RAW)
    if _BASELINE is not None:
        backends.append("cute@baseline")
    variants = parse_variants(args.cute_variants)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  backends: {backends}  "
          f"variants: {[v[0] for v in variants]}", flush=True)
    rows = []
    for headdim in args.headdims:
        for causal in args.causal:
            for seqlen in args.seqlens:
                batch, heads = max(1, args.total_tokens // seqlen), max(1, args.model_dim // headdim)
                gen = torch.Generator(device=device).manual_seed(seqlen * 7 + headdim)
                shape = (batch, seqlen, heads, headdim)
                kv_shape = (batch, seqlen, heads // args.kv_group, headdim)
                q, k, v, dout = (torch.randn(sh, device=device, dtype=torch.bfloat16, generator=gen)
                                 for sh in (shape, kv_shape, kv_shape, shape))
                check_out = None
                items = []  # (row, fn)
                names = [(b, None) for b in backends] + [(v[0], v) for v in variants]
                for name, variant in names:
                    if name == "reference" and seqlen > args.reference_max_seqlen:
                        continue
                    if variant is not None and variant[1] not in (None, headdim):
                        continue
                    for direction in args.directions:
                        if variant is not None and variant[2].split("-")[0] != direction:
                            continue
                        dets = [False, True] if direction == "bwd" and args.deterministic else [False]
                        if variant is not None and variant[2] == "bwd-det":
                            dets = [True]
                        for deterministic in dets:
                            if name == CUDNN_RAW and (deterministic or args.softcap is not None or args.kv_group > 1):
                                continue  # (torch's op has neither; GQA would need its enable_gqa)
                            row = dict(backend=name, headdim=headdim, causal=causal, seqlen=seqlen, batch=batch,
                                       heads=heads, kv_heads=heads // args.kv_group, direction=direction,
                                       deterministic=deterministic,
                                       softcap=args.softcap)
                            try:
                                overrides = variant[3] if variant is not None else None
                                fn, out = _make_fn(name, direction, deterministic, q, k, v, dout, causal, fa4,
                                                   overrides, args.softcap)
                                if direction == "fwd" and out is not None and args.softcap is None:
                                    if check_out is None:
                                        check_out = attention_forward(q, k, v, causal=causal,
                                                                      backend="sdpa_flash")[0]
                                    row["rel_err_vs_torch_flash"] = rel_err(out, check_out)
                                fn()  # compile / warm up outside the timed rounds
                                items.append((row, fn))
                            except Exception as exc:  # one backend failing must not hide the others
                                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                                rows.append(row)
                                _print_row(row)
                torch.cuda.synchronize()
                times = {id(row): [] for row, _ in items}
                for _ in range(args.rounds):
                    for row, fn in items:
                        times[id(row)].append(bench_ms(fn, args.warmup_ms, args.rep_ms, args.queue_ahead_ms))
                for row, _ in items:
                    ms = statistics.median(times[id(row)])
                    row["ms"] = ms
                    row["ms_rounds"] = times[id(row)]
                    row["tflops"] = flops(batch, heads, seqlen, headdim, causal, row["direction"]) / ms / 1e9
                    rows.append(row)
                    _print_row(row)
                del q, k, v, dout, items
                torch.cuda.empty_cache()
    accumulate_rows = _accumulate_cost(args) if args.accumulate else []
    return rows, accumulate_rows


def _accumulate_cost(args):
    """Cost of merging a block into a running fp32 (out, lse) against a plain forward of the same block (cute),
    interleaved rounds, medians; ``--accumulate-variants`` adds merges through the kernels' entry point with cute
    config overrides (e.g. prefetch_running=false) to the same rounds."""
    from fa4dist.kernels.cute import forward as cfwd

    rows = []
    device = torch.device("cuda")
    variants = [(spec, parse_variants([f"fwd:{spec}"])[0][3]) for spec in args.accumulate_variants or []]
    for seqlen in args.accumulate_seqlens:
        for causal in (False, True):
            headdim, batch = 128, max(1, args.total_tokens // seqlen)
            heads = args.model_dim // headdim
            q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=device, dtype=torch.bfloat16)
                       for _ in range(3))
            run_out = torch.zeros(batch, seqlen, heads, headdim, device=device)
            run_lse = torch.randn(batch, heads, seqlen, device=device)
            try:
                fns = {
                    "plain": lambda: attention_forward(q, k, v, causal=causal, backend="cute"),
                    "accumulate": lambda: attention_forward(q, k, v, causal=causal, out=run_out, lse=run_lse,
                                                            accumulate=True, backend="cute"),
                }
                if _BASELINE is not None:
                    fns["baseline"] = lambda: _BASELINE.attention_forward(q, k, v, causal=causal, out=run_out,
                                                                          lse=run_lse, accumulate=True, backend="cute")
                    fns["baseline_plain"] = lambda: _BASELINE.attention_forward(q, k, v, causal=causal, backend="cute")
                for spec, kw in variants:
                    fns[spec] = (lambda kw=kw: cfwd.forward(q, k, v, run_out, run_lse, causal=causal,
                                                            accumulate=True, **kw))
                times = {name: [] for name in fns}
                for fn in fns.values():
                    fn()
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        times[name].append(bench_ms(fn, args.warmup_ms, args.rep_ms, args.queue_ahead_ms))
                med = {name: statistics.median(t) for name, t in times.items()}
                p, a = med["plain"], med["accumulate"]
                row = dict(backend="cute", seqlen=seqlen, headdim=headdim, causal=causal, plain_ms=p,
                           accumulate_ms=a, overhead=a / p - 1,
                           variants={spec: dict(ms=med[spec], overhead=med[spec] / p - 1) for spec, _ in variants})
                if _BASELINE is not None:
                    row["baseline"] = dict(plain_ms=med["baseline_plain"], accumulate_ms=med["baseline"],
                                           overhead=med["baseline"] / med["baseline_plain"] - 1)
            except Exception as exc:
                row = dict(backend="cute", seqlen=seqlen, causal=causal, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print("accumulate", row, flush=True)
    return rows


def _print_row(row):
    if "error" in row:
        print(f"  {row['backend']:>14} d={row['headdim']} causal={row['causal']!s:5} S={row['seqlen']:>6} "
              f"{row['direction']} ERROR {row['error']}", flush=True)
    else:
        det = " det" if row["deterministic"] else ""
        err = f" err={row['rel_err_vs_torch_flash']:.1e}" if "rel_err_vs_torch_flash" in row else ""
        print(f"  {row['backend']:>14} d={row['headdim']} causal={row['causal']!s:5} S={row['seqlen']:>6} "
              f"{row['direction']}{det}: {row['tflops']:7.1f} TFLOP/s ({row['ms']:.3f} ms){err}", flush=True)


def summary_table(rows) -> str:
    """Markdown table: one line per (headdim, causal, seqlen, direction), TFLOP/s per backend, ratios to baselines."""
    key = lambda r: (r["headdim"], r["causal"], r["seqlen"], r["direction"], r["deterministic"])  # noqa: E731
    names = sorted({r["backend"] for r in rows})
    cells: dict = {}
    for r in rows:
        cells.setdefault(key(r), {})[r["backend"]] = r.get("tflops")
    header = "| d | causal | seqlen | dir | " + " | ".join(names)
    ours = "cute" if "cute" in names else None
    if ours:
        header += " | cute/cuDNN | cute/FA4"
    lines = [header + " |", "|" + "---|" * (header.count("|") - 0)]
    for kk in sorted(cells):
        d, causal, s, direction, det = kk
        vals = cells[kk]
        line = f"| {d} | {'yes' if causal else 'no'} | {s} | {direction}{' det' if det else ''} | "
        line += " | ".join(f"{vals[n]:.0f}" if vals.get(n) else "-" for n in names)
        if ours:
            # against torch's cuDNN op itself where the run has it (older JSON: the guarded backend)
            cudnn = CUDNN_RAW if vals.get(CUDNN_RAW) else "sdpa_cudnn"
            for base in (cudnn, "flash_attn_4"):
                line += f" | {vals[ours] / vals[base]:.2f}" if vals.get(ours) and vals.get(base) else " | -"
        lines.append(line + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["headdim"], r["causal"], r["direction"], r["deterministic"]) for r in rows if "tflops" in r})
    if not panels:
        return
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (d, causal, direction, det) in zip(axes.flat, panels):
        for name in sorted({r["backend"] for r in rows}):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows if "tflops" in r and r["backend"] == name and
                         (r["headdim"], r["causal"], r["direction"], r["deterministic"]) == (d, causal, direction, det))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} {'causal' if causal else 'full'} {direction}{' det' if det else ''}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[False, True])
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--backends", nargs="+", default=None, help="default: every available backend + flash_attn_4")
    p.add_argument("--cute-variants", nargs="*", default=None,
                   help="extra cute rows with config overrides: [dNN:]fwd|bwd:key=value,... (e.g. bwd:det_chunk=8)")
    p.add_argument("--deterministic", action="store_true", help="also time deterministic backward")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per point (median reported)")
    p.add_argument("--softcap", type=float, default=None,
                   help="soft-cap every backend's scores (torch's SDPA backends cannot: pass --backends)")
    p.add_argument("--kv-group", type=int, default=1,
                   help="query heads per key / value head (GQA): kv heads = heads / this")
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--model-dim", type=int, default=2048)
    p.add_argument("--reference-max-seqlen", type=int, default=2048)
    p.add_argument("--accumulate", action="store_true", help="also time the accumulate (merge) entry point")
    p.add_argument("--accumulate-seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--accumulate-variants", nargs="*", default=None,
                   help="cute forward overrides timed as merges beside the default (prefetch_running=false)")
    p.add_argument("--baseline-dir", default=None,
                   help="a checkout whose fa4dist kernels run as backend cute@baseline in the same rounds")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--queue-ahead-ms", type=float, default=0.0,
                   help="> 0: device time (each call queued behind a device spin of this length) instead of "
                        "do_bench, whose short calls carry their host time past its L2 flush")
    p.add_argument("--out-dir", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    if args.baseline_dir:
        global _BASELINE
        _BASELINE = load_baseline(args.baseline_dir)
    started = time.time()
    rows, accumulate_rows = run(args)
    os.makedirs(args.out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(date=now.isoformat(), command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, rounds=args.rounds, queue_ahead_ms=args.queue_ahead_ms, rows=rows,
                  accumulate=accumulate_rows, seconds=time.time() - started)
    stem = os.path.join(args.out_dir, f"{now.date().isoformat()}-kernels")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(rows, stem + ".png")
    except Exception as exc:  # matplotlib missing: the JSON is the result
        print("no plot:", exc)
    print()
    print(summary_table(rows))


if __name__ == "__main__":
    main()
