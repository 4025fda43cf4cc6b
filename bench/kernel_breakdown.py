"""Where one attention call's GPU time goes, kernel by kernel: ours (fa4dist.attention, backend auto) and
flash-attn-4 (when installed) under torch.profiler on the same inputs, forward and forward+backward.

    python bench/kernel_breakdown.py                                  # S 1k, B 16, H 16, D 128, causal, bf16
    python bench/kernel_breakdown.py --seqlen 4096 --batch 4 --headdim 64 --no-causal

For each library and pass: the kernels (name shortened), their mean GPU time per call, and the whole call's GPU
span; the short-sequence backward is where ours trails flash-attn-4 most (bench/RESULTS.md), and whether that is
the main kernel or the pre- and postprocessing around it decides what to change.  Writes
$OUT/<date>-kernel-breakdown.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

import timing  # noqa: E402  (bench/, the script's folder)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calls import add_problem_args, make_calls  # noqa: E402  (bench/, the script's folder)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(p)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--calls", type=int, default=20, help="profiled calls per pass (kernel times are their mean)")
    p.add_argument("--launch-shapes", action="store_true",
                   help="also print each kernel's full name, grid, block, registers and shared memory (from the "
                        "profiler's trace): a peer's tile shapes read off its launch")
    return p.parse_args(argv)


def _short(name: str) -> str:
    """A kernel's name without the template noise: the class or function it comes from."""
    found = re.search(r"(FlashFwdSm90|FlashBwdSm90|BwdPreprocess|BwdPostprocess|FlashAttention\w*|"
                      r"FlashAttentionBackward\w*|flash_\w+|ncclDev\w+|elementwise_kernel|vectorized_\w+|"
                      r"reduce_kernel|fill\w*|copy\w*|Memset|Memcpy)", name)
    return found.group(1) if found else name[:60]


def launch_shapes(prof) -> list[dict]:
    """Each distinct kernel launch in a profile: full name, grid, block, registers per thread, shared memory."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    seen = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel":
            continue
        a = ev.get("args", {})
        row = dict(name=ev.get("name", ""), grid=a.get("grid"), block=a.get("block"),
                   registers=a.get("registers per thread"), smem=a.get("shared memory"))
        seen.setdefault(json.dumps(row, sort_keys=True), row)
    return list(seen.values())


def profile(fn, calls: int, shapes: bool = False) -> dict:
    """Mean GPU time per call of every kernel `fn` launches, and the mean GPU span of one call (with `shapes`, the
    launches' shapes too)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    kernels: dict = {}
    for e in events:
        kernels[_short(e.name)] = kernels.get(_short(e.name), 0.0) + e.device_time / calls
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / calls
    result = dict(span_us=span, busy_us=sum(kernels.values()),
                  kernels={k: round(v, 2) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])})
    if shapes:
        result["launches"] = launch_shapes(prof)
    return result


def main(argv=None):
    args = parse_args(argv)
    timing.require_cuda('kernel_breakdown.py')
    torch.use_deterministic_algorithms(args.deterministic)
    libs, dout = make_calls(args, args.deterministic)
    result = {}
    for name, fn in libs.items():
        with torch.no_grad():
            fwd = profile(fn, args.calls, args.launch_shapes)
        both = profile(lambda fn=fn: fn().backward(dout), args.calls, args.launch_shapes)
        result[name] = dict(fwd=fwd, fwdbwd=both)
        for label, r in (("forward", fwd), ("forward+backward", both)):
            print(f"{name} {label}: span {r['span_us']:.1f} us, kernels {r['busy_us']:.1f} us", flush=True)
            for kname, us in r["kernels"].items():
                print(f"    {us:9.2f} us  {kname}", flush=True)
            for ln in r.get("launches", []):
                print(f"    launch grid {ln['grid']} block {ln['block']} regs {ln['registers']} smem {ln['smem']}: "
                      f"{ln['name'][:200]}", flush=True)
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{date}-kernel-breakdown.json"), "w") as fh:
        json.dump(dict(date=date, device=torch.cuda.get_device_name(), args=vars(args), libs=result), fh, indent=1)


if __name__ == "__main__":
    main()
