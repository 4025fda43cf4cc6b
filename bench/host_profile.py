"""Host time of one fa4dist.attention call: wall time per call with and without a synchronize after each, and a
cProfile of the calls (top functions by own time), forward and forward+backward, flash-attn-4 beside it.

    python bench/host_profile.py                      # S 1k, B 16, H 16, D 128, causal, bf16
    python bench/host_profile.py --seqlen 4096 --batch 4
    python bench/host_profile.py --seqlen 32768 --batch 1 --heads 32 --kv-heads 8 --mode cp_invariant --calls 10

``--sync-debug``: one more call of each pass under torch.cuda.set_sync_debug_mode("warn"), printing where every
synchronizing operation was called from.

At short sequences the GPU waits on the host (bench/kernel_breakdown.py: ~300 us idle per forward+backward at
1k, flash-attn-4 ~40 us); this shows whether that is Python work per call or a hidden device synchronisation
(a sync shows as per-call wall time = host time + GPU time even when calls are queued back to back).
Writes $OUT/<date>-host-profile.txt (or bench/results/).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import pstats
import sys
import time
import traceback
import warnings

import torch

import timing  # noqa: E402  (bench/, the script's folder)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calls import add_problem_args, make_calls  # noqa: E402  (bench/, the script's folder)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(p)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--contract", action="store_true",
                   help="also time the contract's attention_forward(backend='cute') alone, forward only")
    p.add_argument("--torch-profile", action="store_true",
                   help="also torch.profiler's CPU-side table of the calls (aten ops, launches, autograd nodes)")
    p.add_argument("--sync-debug", action="store_true", help="report the stack of every synchronizing operation")
    p.add_argument("--launch-times", action="store_true",
                   help="time each compiled kernel's host-side call (tvm-ffi argument conversion and launch) by "
                        "config, and torch's CUDA allocations beside them")
    p.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                   help="the cProfile table's order: own time, or time with the callees")
    return p.parse_args(argv)


def per_call_us(fn, calls: int, sync_each: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_only_us(fn, calls: int) -> float:
    """Python time of the calls alone (no synchronize inside the timed loop; the queue is drained first)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def synchronizing_calls(call) -> list[str]:
    """The stacks (innermost frames last, fa4dist's and the bench's frames only) of every operation that
    synchronized the host with the GPU during one ``call()``."""
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.format_stack()[:-1] if "fa4dist" in f or "bench" in f]
        found.append(f"{message}\n" + "".join(frames[-6:]))

    torch.cuda.synchronize()
    previous = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    torch.cuda.synchronize()
    return found


class LaunchTimes:
    """Wraps fa4dist's compile cache so that every compiled kernel's call is timed on the host (its launch is
    asynchronous, so this is the call's own cost: argument conversion and the driver's launch), per config."""

    def __init__(self):
        from fa4dist.kernels.cute import host

        self.totals: dict = {}
        real = host.get_compiled

        def timed_compiled(cfg):
            fn = real(cfg)
            name = f"{type(cfg).__name__}(tile_m={getattr(cfg, 'tile_m', '-')}, d={getattr(cfg, 'head_dim', '-')})"

            def call(*a):
                t0 = time.perf_counter()
                result = fn(*a)
                spent = time.perf_counter() - t0
                n, total = self.totals.get(name, (0, 0.0))
                self.totals[name] = (n + 1, total + spent)
                return result

            return call

        host.get_compiled = timed_compiled

    def report(self) -> list[str]:
        return [f"  {name}: {n} calls, {total / n * 1e6:.1f} us per call" for name, (n, total) in
                sorted(self.totals.items(), key=lambda kv: -kv[1][1])]

    def reset(self):
        self.totals.clear()


def allocation_us(device="cuda", reps=200) -> dict:
    """Host time of torch's small CUDA allocations and fills, as the kernels' wrappers make them per call."""
    found = {}
    for name, make in (("torch.empty (1 MiB, fp32)", lambda: torch.empty(2**18, device=device)),
                       ("torch.zeros (1,) int32", lambda: torch.zeros(1, dtype=torch.int32, device=device)),
                       ("torch.empty (1,) int32", lambda: torch.empty(1, dtype=torch.int32, device=device))):
        for _ in range(10):
            make()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            make()
        found[name] = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
    return found


def main(argv=None):
    args = parse_args(argv)
    timing.require_cuda('host_profile.py')
    launches = LaunchTimes() if args.launch_times else None  # before any kernel is looked up
    libs, dout = make_calls(args)
    report = io.StringIO()

    def say(line=""):
        print(line, flush=True)
        report.write(line + "\n")

    for name, fn in libs.items():
        passes = {"forward": lambda fn=fn: fn(), "forward+backward": lambda fn=fn: fn().backward(dout)}
        if "contract" in name:  # the contract's entry points alone: one pass, no autograd
            passes = {name.split("contract ")[-1] if name.endswith("backward") else "forward": fn}
        for label, call in passes.items():
            ctx = torch.no_grad() if label == "forward" else torch.enable_grad()
            with ctx:
                for _ in range(5):
                    call()
                queued = per_call_us(call, args.calls, False)
                synced = per_call_us(call, args.calls, True)
                if launches is not None:
                    launches.reset()
                host = host_only_us(call, args.calls)
                say(f"{name} {label}: {queued:.1f} us/call queued back to back, {synced:.1f} us/call with a sync "
                    f"after each, {host:.1f} us/call of host time before the GPU drains")
                if launches is not None and name.startswith("ours"):
                    say(f"{name} {label}: compiled kernels' calls during the host-time loop ({args.calls} calls):")
                    for line in launches.report():
                        say(line)
                if args.sync_debug:
                    syncs = synchronizing_calls(call)
                    say(f"{name} {label}: {len(syncs)} synchronizing operations")
                    for stack in syncs:
                        say(stack)
                prof = cProfile.Profile()
                torch.cuda.synchronize()
                prof.enable()
                for _ in range(args.calls):
                    call()
                prof.disable()
                torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(args.sort).print_stats(args.top)
            say(s.getvalue())
            if args.torch_profile:
                from torch.profiler import ProfilerActivity, profile

                # CUDA activity too: the runtime / driver API calls (launches, allocations, memsets) show as CPU rows
                with ctx, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
                    for _ in range(args.calls):
                        call()
                    torch.cuda.synchronize()
                say(f"{name} {label}: torch.profiler, CPU time of {args.calls} calls")
                say(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if launches is not None:
        for what, us in allocation_us().items():
            say(f"{what}: {us:.1f} us of host per call")
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{date}-host-profile.txt"), "w") as fh:
        fh.write(report.getvalue())


if __name__ == "__main__":
    main()
