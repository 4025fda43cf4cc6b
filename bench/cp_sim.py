"""Ring context parallelism simulated on one device: every simulated rank's real ring-step kernel calls.

For cp in {2, 4, 8} and causal sequences up to 128k tokens (H=16, D=128, bf16), each simulated rank runs exactly
the contract calls the ring engine makes at each of its steps (``fa4dist.context_parallel.ring.MemberForward`` /
``MemberBackward``: real partial blocks with global offsets, trimmed to what the mask lets through, real fp32 merges
through the contract's accumulate mode) against the key rows it would receive at that step.  Reported per balancer
(contiguous, zigzag, LPT):

- compute efficiency = T_full / (cp x max_rank T_rank), T_full being one single-device call on the whole sequence
  (1.0 would be a perfect split with no per-block overhead), the median of the rounds' own ratios: every round
  times the whole-sequence call before and after every rank's run, the ranks in a rotated order, so that the
  device's clock drift over the run and within a round cancels (``interleaved_rounds``); the work model's
  prediction (mean / max visible pairs) beside it. Each call is timed from an idle device (its host time before
  the first launch counts), or with ``--queue-ahead-ms`` behind a device-side spin (device time alone); with
  ``--back-to-back`` (the fair reading) a round's calls are queued as one stream, so the device stays busy as a
  ring rank's does and every call runs at the clock a continuous load settles at (timed one by one, short calls
  on a quiet device ran at a clock ~18% above the long whole-sequence call's, and the call right after it lower:
  the clock probes in the JSON's ``calls_log`` show it, and each round's slowest rank is printed with them);
- "eff~": T_full / (cp x the slowest rank's median over the rounds), each rank's noise averaged before the max
  (a round's max picks up whichever rank ran at a low clock); with ``--steady P`` every round times P + 1
  whole-sequence calls in a row and then P + 1 passes over the ranks, dropping each block's first pass, so that the
  whole-sequence call and the ranks are each timed at the clock their own continuous load settles at on a
  power-capped device, as on a single GPU and on a ring's GPUs (``steady_rounds``);
- after the table, "pooled": every row's eff~ against the median whole-sequence time over all rows that time
  the same call at that length (a row's own T_full moves a few percent with what its rounds ran before it);
- "kernel": the efficiency of the same calls without the merges (each to a fresh output), i.e. what a fused
  accumulate epilogue would approach;
- the ring steps each rank computes (``steps``: its own keys plus the remote steps it receives at; without a window
  every rank runs cp steps, with ``--window W`` only the steps whose keys fall inside some query's window);
- the largest transfer a rank receives in one step (K+V forward; K+V plus fp32 dK+dV backward), its time at
  400 GB/s, and the slowest rank's mean compute time per step it runs (the transfer hides if it is shorter);
- "+xfer": the efficiency with the transfers the launch groups would leave exposed in a real ring, by a model
  (:func:`exposed_transfer_ms`: a group's transfers, each the largest step's at 400 GB/s, travel while the launch
  before it computes; :func:`exposed_backward_transfer_ms` adds the returned fp32 dK / dV); launch groups save
  merges and launch tails but wait for all their transfers.

    python bench/cp_sim.py                                 # the full sweep on the GPU, backend auto
    python bench/cp_sim.py --seqlens 131072 --cp 8 --directions fwd bwd
    python bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --queue-ahead-ms 8 --back-to-back
    python bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --queue-ahead-ms 8 --steady 2
    python bench/cp_sim.py --window 4095 --seqlens 131072  # a causal sliding window of 4096 tokens
    python bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --directions fwd fwd_pdl --back-to-back
    python bench/cp_sim.py --device cpu --tiny             # a smoke run on the CPU (reference backend)
    python bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --profile-ranks 0 6   # kernels of ranks 0, 6

Prints a table and writes JSON to $OUT/cp_sim.json (or bench/out/cp_sim.json; cp_sim-TAG.json with --tag TAG).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fa4dist.context_parallel import Schedule, make_plan  # noqa: E402
from fa4dist.context_parallel.plan import BALANCERS  # noqa: E402
from fa4dist.context_parallel.ring import (  # noqa: E402
    HeldKV, IncomingKeys, KernelOptions, KVBuffer, MemberBackward, MemberForward, ReturningGrads, accum_dtype,
    member_backward_steps,
)
from fa4dist.kernels import attention_backward, attention_forward, available_backends  # noqa: E402
from timing import spin_cycles_per_second  # noqa: E402  (bench/, the script's folder)

LINK_GBPS = 400.0
GROUPED = ("fwd", "bwd")  # the directions --steps-per-launch applies to (the ring's launch groups)


class Timer:
    """Seconds a call takes: on CUDA between two events around it, from an idle device (so the host's time before
    the call's first launch counts, as it does for a call nothing precedes), or with ``queue_ahead_ms`` behind a
    device-side spin of that length queued first, so that the host issues the call's launches while the device is
    still busy (its launch latency hidden, as when the call follows other queued work in a model's step: device
    time alone, if the host issues faster than the device runs).

    ``last`` describes the latest call: ``host_ms`` (the host's time issuing it), and on CUDA ``before_ms`` (the
    device time from the previous mark to the call's start: the spin, timed) and ``probe_ms`` (a spin of
    ``PROBE_MS`` nominal queued right after it). A spin runs a fixed number of SM cycles, so its time reads the SM
    clock before and after the call: a call that ran slow at a slow clock shows it there, and one whose host time
    exceeded the spin waited for its launches."""

    PROBE_MS = 0.25

    def __init__(self, device: torch.device, queue_ahead_ms: float = 0.0):
        self.cuda = device.type == "cuda"
        self.spin_cycles = self.probe_cycles = 0
        self.last: dict = {}
        if self.cuda:
            rate = spin_cycles_per_second(device)
            self.probe_cycles = int(self.PROBE_MS * 1e-3 * rate)
            if queue_ahead_ms > 0:
                self.spin_cycles = int(queue_ahead_ms * 1e-3 * rate)

    def __call__(self, fn) -> float:
        """Seconds fn takes (device time on CUDA)."""
        seconds, details = self.back_to_back([fn])
        self.last = details[0]
        return seconds[0]

    def back_to_back(self, fns) -> tuple[list[float], list[dict]]:
        """Seconds each of fns takes, and its details (as ``last``), queued one after another with nothing but
        the probe spins between them and one synchronization at the end: the device stays busy from the first call
        to the last, as a ring rank's device is through its steps, so its clocks settle where a continuous load
        puts them (calls timed one by one from a quiet device run at a higher clock than a long call does, and
        the call right after a long one at a lower one). The host must issue faster than the device runs; a call
        whose issue fell behind shows a host time above the device time of the calls queued before it."""
        if not self.cuda:
            seconds, details = [], []
            for fn in fns:
                t0 = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - t0)
                details.append(dict(host_ms=seconds[-1] * 1e3))
            return seconds, details
        spin = torch.cuda.Event(enable_timing=True)
        marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in fns]  # start, end, probe end
        spin.record()
        if self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)
        hosts = []
        for fn, (start, end, probe) in zip(fns, marks):
            start.record()
            t0 = time.perf_counter()
            fn()
            hosts.append((time.perf_counter() - t0) * 1e3)
            end.record()
            torch.cuda._sleep(self.probe_cycles)
            probe.record()
        marks[-1][2].synchronize()
        seconds, details = [], []
        for i, ((start, end, probe), host) in enumerate(zip(marks, hosts)):
            seconds.append(start.elapsed_time(end) / 1e3)
            # before the first call the spin; before the others the device's gap after the previous call's probe
            # (~0 while the host keeps ahead)
            before = spin.elapsed_time(start) if i == 0 else marks[i - 1][2].elapsed_time(start)
            details.append(dict(host_ms=host, before_ms=before, probe_ms=end.elapsed_time(probe)))
        return seconds, details


def interleaved_rounds(timer, full, groups: list[list], reps: int, log: list | None = None,
                       back_to_back: bool = False) -> list[list[float]]:
    """Seconds of ``full`` and of every fn of ``groups`` (each a list of per-rank fns) in ``reps`` rounds, after one
    warm-up call each (compiles, allocator). Each round times ``full`` first and last (their mean is the round's
    T_full) and every group's fns in between, rotated by the round's index: the device's clocks drift within a
    round as it heats (ranks timed later ran up to 7% slower, which the slowest rank then picks up), so every
    rank takes each place in turn and the whole-sequence call brackets them. A round's calls are timed one by one,
    or with ``back_to_back`` queued as one stream (``Timer.back_to_back``). Returns rounds x (1 + all fns), the
    fns in their given order. With ``log``, every timed call appends a record there: its round, its place in the
    round, who ran ("full" or (group, rank)), its ms and the timer's details of it (if it gives them)."""
    for fn in [full] + [fn for group in groups for fn in group]:
        fn()
    rounds = []
    for i in range(reps):
        sequence = [("full", full)]
        for g, group in enumerate(groups):
            sequence += [((g, r), group[r]) for r in ((i + j) % len(group) for j in range(len(group)))]
        sequence.append(("full", full))
        if back_to_back:
            seconds, details = timer.back_to_back([fn for _, fn in sequence])
        else:
            seconds, details = [], []
            for _, fn in sequence:
                seconds.append(timer(fn))
                details.append(dict(getattr(timer, "last", {})))
        if log is not None:
            log += [dict(round=i, place=place, who=who, ms=sec * 1e3, **det)
                    for place, ((who, _), sec, det) in enumerate(zip(sequence, seconds, details))]
        got = dict(zip((who for who, _ in sequence[1:-1]), seconds[1:-1]))
        rounds.append([(seconds[0] + seconds[-1]) / 2]
                      + [got[(g, r)] for g, group in enumerate(groups) for r in range(len(group))])
    return rounds


def device_kernels(events) -> list:
    """The CUDA kernels among torch.profiler's ``events`` (those with device time), in start order."""
    return sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0),
                  key=lambda e: e.time_range.start)


def span_ms(kernels) -> float:
    """From the first kernel's start to the last one's end, in ms (0 for none)."""
    if not kernels:
        return 0.0
    return (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3


def call_kernels(events, calls: int, spin_first: bool) -> list[dict]:
    """Device kernels of a ``Timer.back_to_back`` stream run under torch.profiler, split per call by the probe
    spins between calls (``torch.cuda._sleep``'s kernel; a queue-ahead spin first where ``spin_first``): per call its
    kernels' busy ms, its span from the first kernel's start to the last one's end, and its kernels' ms by name."""
    kernels = device_kernels(events)
    out, current, skip = [], [], spin_first
    for e in kernels:
        if "spin_kernel" in e.name:
            if skip:
                skip = False
                continue
            out.append(current)
            current = []
        else:
            current.append(e)
    if len(out) != calls:
        raise RuntimeError(f"profiled stream split into {len(out)} calls, expected {calls}")
    result = []
    for ks in out:
        by_name: dict = {}
        for e in ks:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / 1e3
        result.append(dict(busy_ms=sum(by_name.values()), span_ms=span_ms(ks),
                           kernels=sorted(by_name.items(), key=lambda kv: -kv[1])))
    return result


def steady_rounds(timer, full, groups: list[list], reps: int, passes: int, log: list | None = None,
                  profile_last: bool = False) -> list[list[float]]:
    """``interleaved_rounds`` in steady state: each round queues ``passes`` + 1 whole-sequence calls back to back,
    then ``passes`` + 1 passes over every group's fns (rotated by the pass), all as one stream, and keeps the median
    of each fn's calls after its block's first pass. Each block is then a continuous load of one kind, as a real
    ring keeps every GPU busy with rank work while a single GPU would run the whole-sequence call: on a power-capped
    device the clock settles at a different level for each (the dense whole-sequence kernel draws more), and the
    calls timed right after a switch ran at the other load's clock (the forty-ninth session's logs: the first ranks
    after the whole-sequence call up to 12% slower than the last ones of the same round). Returns rounds x (1 + all
    fns) as ``interleaved_rounds`` does; ``log`` records every call, kept or not (``kept``)."""
    fns = [fn for group in groups for fn in group]
    for fn in [full] + fns:
        fn()
    rounds = []
    for i in range(reps):
        sequence = [("full", p, full) for p in range(passes + 1)]
        for p in range(passes + 1):
            for g, group in enumerate(groups):
                sequence += [((g, r), p, group[r]) for r in ((i + p + j) % len(group) for j in range(len(group)))]
        if profile_last and i == reps - 1:  # the last round under the profiler: each call's kernels
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                seconds, details = timer.back_to_back([fn for _, _, fn in sequence])
            try:
                split = call_kernels(prof.events(), len(sequence), bool(timer.spin_cycles))
            except RuntimeError as err:  # (a profile that lost a probe: the timings stand, the breakdown goes)
                print(f"    profiled round not split: {err}", flush=True)
                split = [{}] * len(sequence)
            for det, ks in zip(details, split):
                det.update(ks)
        else:
            seconds, details = timer.back_to_back([fn for _, _, fn in sequence])
        kept: dict = {}
        for place, ((who, p, _), sec, det) in enumerate(zip(sequence, seconds, details)):
            if p > 0:
                kept.setdefault(who, []).append(sec)
            if log is not None:
                log.append(dict(round=i, place=place, who=who, ms=sec * 1e3, kept=p > 0, **det))
        rounds.append([statistics.median(kept["full"])]
                      + [statistics.median(kept[(g, r)]) for g, group in enumerate(groups) for r in range(len(group))])
    return rounds


def pool_t_full(rows: list[dict]) -> list[tuple]:
    """Each row's eff~ against the whole-sequence call's median over every row of the same sequence, cp-independent
    call (``full_call``) and balancer-independent, instead of its own rounds' alone: the rows' own T_full differ by
    a few percent with what their rounds ran before the whole-sequence block (in steady timing, the plain forward's
    rounds also time the kernels-alone group: its T_full read 2-5% below the grouped rows' in the fiftieth session).
    Sets ``efficiency_of_medians_pooled`` and ``t_full_pooled_ms`` on every row; returns (row, pooled ms) pairs."""
    pooled = {}
    for row in rows:
        pooled.setdefault((row["seqlen"], row["full_call"]), []).extend(row["t_full_rounds_ms"])
    out = []
    for row in rows:
        t_full = statistics.median(pooled[(row["seqlen"], row["full_call"])])
        row["t_full_pooled_ms"] = t_full
        row["efficiency_of_medians_pooled"] = t_full / (row["cp"] * row["max_rank_ms"])
        out.append((row, t_full))
    return out


def steady_profile(log: list[dict], cp: int) -> dict | None:
    """The profiled steady round's kept calls (``steady_rounds(profile_last=True)``): the whole-sequence call's and
    a rank's (group 0) median elapsed ms, kernels' busy ms and span, the busy efficiency (whole-sequence busy / (cp x
    a rank's)) and a rank's kernels by name (ms per call, averaged over the kept rank calls)."""
    profiled = [rec for rec in log if rec.get("kept") and "busy_ms" in rec]
    full = [rec for rec in profiled if rec["who"] == "full"]
    ranks = [rec for rec in profiled if rec["who"] != "full" and rec["who"][0] == 0]
    if not full or not ranks:
        return None

    def medians(recs):
        return {key: statistics.median(rec[key] for rec in recs) for key in ("ms", "busy_ms", "span_ms")}

    by_name: dict = {}
    for rec in ranks:
        for name, ms in rec["kernels"]:
            by_name[name] = by_name.get(name, 0.0) + ms / len(ranks)
    f, r = medians(full), medians(ranks)
    return dict(full=f, rank=r, busy_efficiency=f["busy_ms"] / (cp * r["busy_ms"]),
                rank_kernels=sorted(by_name.items(), key=lambda kv: -kv[1]))


def slowest_rank_places(log: list[dict], cp: int) -> list[dict]:
    """Per round, the slowest rank of group 0 (the ranks' runs): which rank, its place in the round, its time
    against that rank's median over the rounds, and the timer's details of that call beside the round's medians
    of them (whether it ran at a slower clock, or waited for its host)."""
    runs = [rec for rec in log if rec["who"] != "full" and rec["who"][0] == 0 and rec.get("kept", True)]
    median_ms = {r: statistics.median(rec["ms"] for rec in runs if rec["who"][1] == r) for r in range(cp)}
    out = []
    for i in sorted({rec["round"] for rec in runs}):
        here = [rec for rec in runs if rec["round"] == i]
        slow = max(here, key=lambda rec: rec["ms"])
        row = dict(round=i, rank=slow["who"][1], place=slow["place"], ms=slow["ms"],
                   vs_own_median=slow["ms"] / median_ms[slow["who"][1]])
        for key in ("host_ms", "before_ms", "probe_ms"):
            if key in slow:
                row[key] = slow[key]
                row[key + "_round_median"] = statistics.median(rec[key] for rec in here)
        out.append(row)
    return out


def simulate(args, device, dtype, seqlen: int, heads: int, kv_heads: int, headdim: int, backend: str):
    timer = Timer(device, args.queue_ahead_ms)
    gen = torch.Generator(device=device).manual_seed(seqlen)
    shape_q, shape_kv = (1, seqlen, heads, headdim), (1, seqlen, kv_heads, headdim)
    q = torch.randn(shape_q, device=device, dtype=dtype, generator=gen)
    k = torch.randn(shape_kv, device=device, dtype=dtype, generator=gen)
    v = torch.randn(shape_kv, device=device, dtype=dtype, generator=gen)
    dout = torch.randn(shape_q, device=device, dtype=dtype, generator=gen)
    window = (args.window, -1) if args.window is not None else (-1, -1)
    mask = dict(causal=True, window=window)
    rows = []
    full = {}
    out_full, lse_full = attention_forward(q, k, v, backend=backend, **mask)
    # one call on the whole sequence, timed in every round beside the ranks' runs
    full["fwd"] = lambda: attention_forward(q, k, v, backend=backend, **mask)
    full["fwd_pdl"] = full["fwd_pdl_events"] = full["fwd"]
    full["bwd"] = lambda: attention_backward(dout, q, k, v, out_full, lse_full, backend=backend, **mask)
    # bwd_lse: a loss of out and lse (return_lse=True): the lse's gradient joins the row sums, on one device and in
    # every ring step alike
    dlse = torch.randn(lse_full.shape, device=device, dtype=lse_full.dtype, generator=gen)
    full["bwd_lse"] = lambda: attention_backward(dout, q, k, v, out_full, lse_full, backend=backend, dlse=dlse, **mask)
    opts = KernelOptions(softmax_scale=None, softcap=None, backend=backend, deterministic=False)
    acc = accum_dtype(dtype)
    elt, acc_elt = torch.finfo(dtype).bits // 8, torch.finfo(acc).bits // 8
    for cp in args.cp:
        for balancer in args.balancers:
            plan = make_plan(seqlen, cp, balancer, **mask)
            sched = Schedule(plan, 1, plan.mask)
            shards = [[plan.shard(t, rank=r) for t in (q, k, v, dout)] for r in range(cp)]
            dlse_shards = [plan.shard(dlse, seq_dim=2, rank=r).contiguous() for r in range(cp)]
            # the key rows rank r receives from rank s (what the ring engine sends it), packed as it would be
            held = {(r, s): KVBuffer.gather(shards[s][1], shards[s][2], sched.needed(r, s), 1)
                    for r in range(cp) for s in range(cp) if s != r and sched.needed(r, s)}
            row_bytes = kv_heads * headdim * 2  # K and V elements per received key row
            largest = max([sched.recv_len(r, t) for r in range(cp) for t in range(1, cp)] + [0])
            bytes_fwd = largest * row_bytes * elt
            bytes_bwd = bytes_fwd + largest * row_bytes * acc_elt
            model = plan.balance_report()
            steps = [1 + len(sched.member_steps(r)) for r in range(cp)]
            runs = [(d, g) for d in args.directions for g in (args.steps_per_launch if d in GROUPED else [1])]
            for direction, per_launch in runs:
                label = direction if per_launch == 1 else f"{direction}/{per_launch or 'all'}"
                runners, profiles = [], {}
                for r in range(cp):
                    qr, kr, vr, dr = shards[r]
                    if direction in ("fwd", "fwd_pdl", "fwd_pdl_events"):
                        launches = rank_launches(sched, r, held, per_launch)

                        def run_rank(r=r, qr=qr, kr=kr, vr=vr, launches=launches,
                                     overlap=direction.startswith("fwd_pdl"),
                                     landed=landed_event(device) if direction == "fwd_pdl_events" else None):
                            run_rank_fwd(sched, r, qr, kr, vr, launches, headdim, opts, overlap, landed)
                    else:
                        fwd = run_rank_fwd(sched, r, qr, kr, vr, rank_launches(sched, r, held, 1), headdim, opts)
                        out_r, lse_r = fwd.out.to(dtype), fwd.lse

                        # the dK / dV partials rank r gets back for the rows it sent at each step: views of a zero
                        # buffer per step (their values do not matter here: the owner's adds are what is timed)
                        returned = {t: ReturningGrads(None, returned_partial(kr, vr, sched.send_ranges(r, t), acc, t),
                                                      sched.send_ranges(r, t), 1)
                                    for t in sched.steps() if sched.send_ranges(r, t)}

                        def run_rank(r=r, qr=qr, kr=kr, vr=vr, dr=dr, out_r=out_r, lse_r=lse_r,
                                     incoming=rank_incoming(sched, r, held, per_launch),
                                     groups=sched.launch_groups(per_launch),
                                     sched=sched, returned=returned,
                                     dlse_r=dlse_shards[r] if direction == "bwd_lse" else None):
                            # the ring engine's own order (member_backward_steps) with keys and returns at hand
                            member = MemberBackward(sched, r, dr, qr, kr, vr, out_r, lse_r, opts, dlse_r,
                                                    remote=bool(sched.steps()))
                            member_backward_steps(member, groups, lambda i, group: incoming[i],
                                                  lambda t, partial: returned.get(t))
                    runners.append(run_rank)
                    if r in args.profile_ranks:
                        profiles[r] = profile_kernels(run_rank, device, cprofile=args.cprofile if not profiles else 0)
                if args.profile_ranks:  # the whole-sequence call's kernels beside the ranks'
                    profiles["full"] = profile_kernels(full[direction], device)
                kernels = []
                # the same calls without the merges: what a fused epilogue would approach
                if direction == "fwd" and per_launch == 1:
                    kernels = [lambda r=r, shards=shards, held=held: run_rank_kernels(sched, r, shards[r], held, opts)
                               for r in range(cp)]
                # per round: the whole-sequence call around every rank's run and every rank's kernels alone; the
                # efficiency is the median of the rounds' own ratios
                log = []
                groups = [runners] + ([kernels] if kernels else [])
                if args.steady:
                    rounds = steady_rounds(timer, full[direction], groups, args.reps, args.steady, log=log,
                                           profile_last=args.profile_steady)
                else:
                    rounds = interleaved_rounds(timer, full[direction], groups, args.reps, log=log,
                                                back_to_back=args.back_to_back)
                t_full = statistics.median(rd[0] for rd in rounds)
                rank_times = [statistics.median(rd[1 + r] for rd in rounds) for r in range(cp)]
                efficiency = statistics.median(rd[0] / (cp * max(rd[1:1 + cp])) for rd in rounds)
                kernel_eff = None
                if kernels:
                    kernel_eff = statistics.median(rd[0] / (cp * max(rd[1 + cp:])) for rd in rounds)
                slowest = max(rank_times)
                slowest_steps = steps[rank_times.index(slowest)]
                nbytes = bytes_fwd if direction.startswith("fwd") else bytes_bwd
                comm_ms, step_ms = nbytes / (LINK_GBPS * 1e9) * 1e3, slowest / slowest_steps * 1e3
                sizes = [len(g) for g in sched.launch_groups(per_launch)]
                if direction.startswith("fwd"):
                    exposed = exposed_transfer_ms(sizes, comm_ms, step_ms)
                else:  # keys out, fp32 dK / dV back
                    keys_ms = bytes_fwd / (LINK_GBPS * 1e9) * 1e3
                    exposed = exposed_backward_transfer_ms(sizes, keys_ms, comm_ms - keys_ms, step_ms)
                row = dict(
                    seqlen=seqlen, cp=cp, balancer=balancer, direction=label, window=list(window),
                    steps_per_launch=per_launch if direction in GROUPED else 1,
                    t_full_ms=t_full * 1e3, t_rank_ms=[t * 1e3 for t in rank_times],
                    max_rank_ms=slowest * 1e3, efficiency=efficiency,
                    # the slowest rank's median against the whole-sequence call's: per-rank noise averaged out
                    # before the max (a round's max picks up whichever rank ran at a low clock)
                    efficiency_of_medians=t_full / (cp * slowest),
                    # the whole-sequence call this row compares with (rows of one call pool their T_full: pool_t_full)
                    full_call=next(key for key in ("fwd", "bwd", "bwd_lse") if full[key] is full[direction]),
                    t_full_rounds_ms=[rd[0] * 1e3 for rd in rounds],
                    timing="steady" if args.steady else "back_to_back" if args.back_to_back else "one_by_one",
                    efficiency_rounds=[rd[0] / (cp * max(rd[1:1 + cp])) for rd in rounds],
                    model_efficiency=model.efficiency, steps=steps, steps_run=[0, *sched.steps()],
                    bytes_per_step=nbytes, comm_ms_at_400GBps=comm_ms, step_compute_ms=step_ms,
                    calls=[sched.member_calls(r) for r in range(cp)], kernel_only_efficiency=kernel_eff,
                    exposed_transfer_ms_modeled=exposed,
                    efficiency_with_transfers_modeled=None if exposed is None else
                    t_full * 1e3 / (cp * (slowest * 1e3 + exposed)),
                    profiles=profiles,
                    calls_log=log, slowest_places=slowest_rank_places(log, cp),
                )
                row["steady_profile"] = steady_profile(log, cp) if args.profile_steady else None
                rows.append(row)
                print(f"{seqlen:>7} {cp:>3} {balancer:>10} {label:>4} {row['t_full_ms']:>9.2f} "
                      f"{row['max_rank_ms']:>9.2f} {row['efficiency']:>6.3f} {row['efficiency_of_medians']:>6.3f} "
                      f"{row['model_efficiency']:>6.3f} "
                      f"{max(steps):>3}/{cp:<3} {nbytes / 2**20:>9.1f} {row['comm_ms_at_400GBps']:>8.3f} "
                      f"{row['step_compute_ms']:>8.3f} "
                      f"{'' if kernel_eff is None else format(kernel_eff, '6.3f'):>6} "
                      f"{'' if exposed is None else format(row['efficiency_with_transfers_modeled'], '6.3f'):>6}  "
                      f"rounds {' '.join(format(e, '.3f') for e in row['efficiency_rounds'])}", flush=True)
                for slow in row["slowest_places"]:
                    print(f"    round {slow['round']}: slowest rank {slow['rank']} at place {slow['place']}, "
                          f"{slow['ms']:.3f} ms = {slow['vs_own_median']:.3f}x its median; " + ", ".join(
                              f"{key} {slow[key]:.3f} (round median {slow[key + '_round_median']:.3f})"
                              for key in ("host_ms", "before_ms", "probe_ms") if key in slow), flush=True)
                if row["steady_profile"]:
                    sp = row["steady_profile"]
                    print(f"    profiled steady round: whole sequence {sp['full']['ms']:.2f} ms, kernels busy "
                          f"{sp['full']['busy_ms']:.2f}; a rank {sp['rank']['ms']:.2f} ms, busy "
                          f"{sp['rank']['busy_ms']:.2f}, span {sp['rank']['span_ms']:.2f} (medians); busy "
                          f"efficiency {sp['busy_efficiency']:.3f}; a rank's kernels: " + "; ".join(
                              f"{name[:48]} {ms:.3f}" for name, ms in sp["rank_kernels"][:6]), flush=True)
                for r, prof in profiles.items():
                    print(f"    {'whole sequence' if r == 'full' else f'rank {r}'} {direction}: "
                          f"{prof['busy_ms']:.3f} ms of kernels in a {prof['span_ms']:.3f} ms span, host "
                          f"{prof['host_ms']:.3f} ms, {len(prof['syncs'])} syncs; " + "; ".join(
                              f"{k['name'][:48]} x{k['calls']} {k['ms']:.3f} ms" for k in prof["kernels"][:8]),
                          flush=True)
                    for sync in prof["syncs"][:4]:
                        print(f"        sync: {sync}", flush=True)
                    if prof["python_profile"]:
                        print(prof["python_profile"], flush=True)
            del shards, held
    return rows


def profile_kernels(fn, device: torch.device, top: int = 40, cprofile: int = 0) -> dict:
    """One call of fn under torch.profiler: its kernels (CPU ops on the CPU) by total device time, the largest
    first, as dicts of name, calls and ms (``kernels``); their sum (``busy_ms``), the device span from the first
    kernel's start to the last one's end (``span_ms``: span minus busy is the device's idle time inside the call),
    the host time fn takes to return (``host_ms``: the median of three calls outside the profiler), the
    synchronizing operations fn runs (``syncs``: torch's sync debug mode, one more call), and with ``cprofile`` N
    the N functions of one more call with the most own host time (``python_profile``: cProfile's table)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    fn()
    syncs = []
    if cuda:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (the mode's own notice that it is a prototype is not a synchronization)
        syncs = [str(w.message).splitlines()[0][:160] for w in caught
                 if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
        torch.cuda.synchronize()
    hosts = []
    for _ in range(3):  # the host time to return, outside the profiler (whose per-launch cost would count)
        t0 = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - t0)
        if cuda:
            torch.cuda.synchronize()
    host = statistics.median(hosts)
    stats = io.StringIO()
    if cprofile:
        import cProfile
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        fn()
        prof_py.disable()
        if cuda:
            torch.cuda.synchronize()
        pstats.Stats(prof_py, stream=stats).sort_stats("tottime").print_stats(cprofile)
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append(dict(name=e.key, calls=e.count, ms=us / 1e3))
    span = span_ms(device_kernels(prof.events())) if cuda else 0.0
    rows.sort(key=lambda k: -k["ms"])
    return dict(kernels=rows[:top], busy_ms=sum(k["ms"] for k in rows), span_ms=span, host_ms=host * 1e3,
                syncs=syncs, python_profile=stats.getvalue())


_ZEROS: dict = {}  # (dtype, device) -> the largest zero buffer returned_partial has handed out views of


def returned_partial(k, v, ranges, dtype, slot: int = 0) -> KVBuffer:
    """A dK / dV partial for the rows `ranges` of k / v (fp32 zeros): a view of the zero buffer of `slot` (one per
    ring step, shared by the ranks, grown as needed), so that the simulation holds cp - 1 partials, not one per rank
    and step, and a launch group's returns are distinct memory as in a real ring (one buffer for all of them let
    the fused sum of a group's returns read it from cache: the fiftieth session's first reading)."""
    ks, vs = KVBuffer.shapes(k, v, sum(n for _, n in ranges), 1)
    numel = math.prod(ks) + math.prod(vs)
    key = (dtype, k.device, slot)
    zeros = _ZEROS.get(key)
    if zeros is None or zeros.numel() < numel:
        zeros = _ZEROS[key] = torch.zeros(numel, dtype=dtype, device=k.device)
    return KVBuffer(zeros[:numel], ks, vs)


def run_rank_kernels(sched, r, shard, held, opts):
    """Rank r's forward blocks, each to a fresh output (no merge): kernel time alone."""
    qr, kr, vr, _ = shard
    for s in [r] + [sched.source(r, t) for t in sched.member_steps(r)]:
        keys = HeldKV(kr, vr) if s == r else held[(r, s)]
        for item in sched.items(r, s):
            attention_forward(qr.narrow(1, item.q_start, item.q_len), keys.k.narrow(1, item.k_start, item.k_len),
                              keys.v.narrow(1, item.k_start, item.k_len), backend=opts.backend,
                              softmax_scale=opts.softmax_scale, softcap=opts.softcap, **item.mask_kwargs())


def rank_incoming(sched, r, held, steps_per_launch: int) -> list:
    """Rank r's remote launch groups (``Schedule.launch_groups``) as the ring receives them, one ``IncomingKeys``
    each (nothing pending): a step's own key rows for a group of one, else the group's rows in one buffer, each
    step's in place (``Schedule.group_items``), with the work list and the steps' places (``held`` None where the
    group brings nothing); built outside the timing as ``held`` is."""
    out = []
    for group in sched.launch_groups(steps_per_launch):
        if len(group) == 1:
            t = group[0]
            buf = held.get((r, sched.source(r, t)))
            items = sched.items(r, sched.source(r, t)) if buf is not None else ()
            out.append(IncomingKeys(None, buf, items, ((t, 0, sched.recv_len(r, t)),)))
            continue
        places, items = sched.group_items(r, group)
        parts = [(held[(r, sched.source(r, t))], at, n) for t, at, n in places if n]
        buf = None
        if parts:
            buf = KVBuffer.empty(parts[0][0].k, parts[0][0].v, sum(n for _, _, n in parts), 1)
            for part, at, n in parts:
                buf.k.narrow(1, at, n).copy_(part.k)
                buf.v.narrow(1, at, n).copy_(part.v)
        out.append(IncomingKeys(None, buf, items if buf is not None else (), places))
    return out


def rank_launches(sched, r, held, steps_per_launch: int) -> list:
    """Rank r's remote launches as ``ring_forward`` makes them, [(key rows, work list)]: one per step, or with
    ``steps_per_launch`` != 1 one per launch group (:func:`rank_incoming`), groups that bring nothing left out."""
    return [(inc.held, inc.items) for inc in rank_incoming(sched, r, held, steps_per_launch) if inc.held is not None]


def exposed_backward_transfer_ms(group_sizes, keys_ms: float, grads_ms: float, step_ms: float) -> float:
    """The transfer time a ring backward with launch groups of `group_sizes` remote steps leaves exposed, by a
    model: the first group's keys travel while the first half of the own step computes (`step_ms` / 2); while group
    i computes (its steps x `step_ms`) the keys of group i + 1 and the returned dK / dV of group i - 1 travel; the
    last group's returns travel while the own step's second half computes. A step's keys take `keys_ms`, its
    returns `grads_ms`, one after another on the member's links."""
    sizes = list(group_sizes)
    if not sizes:
        return 0.0
    windows = [(step_ms / 2, sizes[0] * keys_ms)]
    for i, size in enumerate(sizes):
        traffic = (sizes[i + 1] * keys_ms if i + 1 < len(sizes) else 0.0) + (sizes[i - 1] * grads_ms if i else 0.0)
        windows.append((size * step_ms, traffic))
    windows.append((step_ms / 2, sizes[-1] * grads_ms))
    return sum(max(0.0, traffic - cover) for cover, traffic in windows)


def exposed_transfer_ms(group_sizes, comm_ms: float, step_ms: float) -> float:
    """The transfer time a ring forward with launch groups of `group_sizes` remote steps leaves exposed, by a model:
    the own step (`step_ms`) computes while the first group's transfers travel, each group's while the group before
    it computes (its steps x `step_ms`), and a group's transfers arrive one after another (`comm_ms` each: they
    share the member's links) before it starts."""
    exposed, covering = 0.0, step_ms
    for size in group_sizes:
        exposed += max(0.0, size * comm_ms - covering)
        covering = size * step_ms
    return exposed


def landed_event(device):
    """On CUDA an event of another stream that completes once the work queued so far has (None off CUDA): what a
    ring member's stream waits on before each remote launch, as for a transfer that already landed; made once,
    outside the timed calls."""
    if torch.device(device).type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side.record_event()


def run_rank_fwd(sched, r, qr, kr, vr, launches, headdim, opts, overlap: bool = False, landed=None):
    """As ``ring_forward``: the own step, then each of `launches` (:func:`rank_launches`), merged into one running
    result (``MemberForward``). ``overlap``: each launch after the first may start while the one before it finishes
    (``MemberForward``'s overlap_launches: programmatic dependent launch on the cute backend). ``landed``
    (:func:`landed_event`): before each remote launch the stream waits on it, as the ring's transfer wait puts an
    event wait between two launches, to see whether the overlap survives it."""
    fwd = MemberForward(sched.members[r], qr, headdim, False, sched.items(r, r), overlap_launches=overlap)
    for i, (kv, items) in enumerate([(HeldKV(kr, vr), sched.items(r, r))] + launches):
        if i and landed is not None:
            torch.cuda.current_stream(qr.device).wait_event(landed)
        fwd.launch(qr, IncomingKeys(None, kv, items), opts)
    return fwd.result()


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Sizes the simulation cannot run, refused by option name before any work (they failed deep inside make_plan
    or the kernels, or --reps 0 in statistics.median after the whole sweep)."""
    for name in ("cp", "seqlens", "steps_per_launch", "profile_ranks"):
        minimum = 0 if name in ("steps_per_launch", "profile_ranks") else 1
        bad = [x for x in getattr(args, name) or () if x < minimum]
        if bad:
            p.error(f"--{name.replace('_', '-')} takes integers >= {minimum}, got {bad}")
    if args.profile_steady and not args.steady:
        p.error("--profile-steady profiles a steady round: give --steady PASSES too")
    if args.profile_steady and args.device == "cpu":
        p.error("--profile-steady splits a CUDA stream's kernels by its probe spins: it needs --device cuda")
    if args.steady < 0:
        p.error(f"--steady takes the passes kept per round (>= 1; 0 is off), got {args.steady}")
    for name in ("heads", "kv_heads", "headdim", "reps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.window is not None and args.window < 0:
        p.error(f"--window is the keys before each query (>= 0; leave it out for plain causal), got {args.window}")
    never = [r for r in args.profile_ranks if r >= max(args.cp)]
    if never:  # (no simulated cp size has them: nothing would be profiled)
        p.error(f"--profile-ranks {never}: no simulated --cp {args.cp} has those ranks")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small sizes (a CPU smoke run)")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 16384 32768 65536 131072")
    p.add_argument("--heads", type=int, default=None, help="default 16 (2 with --tiny)")
    p.add_argument("--kv-heads", type=int, default=None, help="default = heads")
    p.add_argument("--headdim", type=int, default=None, help="default 128 (16 with --tiny)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --device cpu)")
    p.add_argument("--balancers", nargs="+", default=list(BALANCERS), choices=BALANCERS)
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"],
                   choices=["fwd", "fwd_pdl", "fwd_pdl_events", "bwd", "bwd_lse"],
                   help="bwd_lse: the backward of a loss of out and lse (dlse in every step's row sums); fwd_pdl: "
                        "each remote launch may start while the one before it finishes (programmatic dependent "
                        "launch), one launch per step; fwd_pdl_events: the same with a wait on another stream's "
                        "(complete) event before each remote launch, as the ring's transfer waits")
    p.add_argument("--steps-per-launch", type=int, nargs="+", default=[1],
                   help="the ring's remote steps per launch (its launch groups, forward and backward; 0: all remote "
                        "steps in one), one fwd and one bwd row each (labelled fwd/N, bwd/N)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--window", type=int, default=None,
                   help="causal sliding window: each query sees itself and the WINDOW keys before it "
                        "(window=(WINDOW, 0)); default: plain causal")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="with --profile-ranks: cProfile's N functions of most own host time, first profiled rank")
    p.add_argument("--queue-ahead-ms", type=float, default=0.0,
                   help="time each call behind a device-side spin of this many ms (its host launch latency hidden: "
                        "device time, as when the call follows other queued work); default 0: from an idle device")
    p.add_argument("--back-to-back", action="store_true",
                   help="time each round's calls queued as one stream (behind the --queue-ahead-ms spin), the device "
                        "busy throughout as a ring rank's is: its clocks settle as under a continuous load (calls "
                        "timed one by one from a quiet device run faster than a long call, and the call right after "
                        "a long one slower)")
    p.add_argument("--steady", type=int, default=0, metavar="PASSES",
                   help="steady-state rounds (implies --back-to-back): PASSES + 1 whole-sequence calls in a row, then "
                        "PASSES + 1 passes over the ranks, one stream, each block's first pass dropped, so that each "
                        "is timed at the clock its own continuous load settles at (steady_rounds)")
    p.add_argument("--profile-steady", action="store_true",
                   help="with --steady, run each row's last round under torch.profiler: every call's kernels, split "
                        "by the probe spins, and a summary of the whole-sequence call's and a rank's busy time (that "
                        "round's times count among the rounds': give --reps 3 or more for timings)")
    p.add_argument("--tag", default="", help="names the JSON cp_sim-TAG.json (several runs in one $OUT)")
    p.add_argument("--profile-ranks", type=int, nargs="*", default=[],
                   help="also profile one step list of these simulated ranks and the whole-sequence call: their "
                        "kernels by device time (a rank the work model calls balanced that runs slower shows where)")
    args = p.parse_args(argv)
    _check_args(p, args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu --tiny")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if device.type == "cpu":
        torch.set_num_threads(1)  # steadier CPU timings (tiny sizes are overhead-bound anyway)
    # --tiny shrinks the defaults only: sizes given on the command line are the ones run (it clamped --heads to 2
    # and --headdim to 16, keeping --kv-heads: --heads 8 --kv-heads 4 failed with "query heads (2)")
    default_seqlens, default_heads, default_headdim = ([256, 512], 2, 16) if args.tiny else \
        ([16384, 32768, 65536, 131072], 16, 128)
    seqlens = args.seqlens or default_seqlens
    heads = args.heads or default_heads
    headdim = args.headdim or default_headdim
    kv_heads = args.kv_heads or heads
    if heads % kv_heads:
        p.error(f"--kv-heads ({kv_heads}) must divide --heads ({heads})")
    backend = args.backend
    print(f"cp_sim: device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, backend {backend} (available: {available_backends(device)}), "
          f"heads {heads}/{kv_heads}, head dim {headdim}, {dtype}, causal"
          + (f", window ({args.window}, 0)" if args.window is not None else ""))
    print(f"{'seqlen':>7} {'cp':>3} {'balancer':>10} {'dir':>4} {'T_full ms':>9} {'max rank':>9} {'eff':>6} "
          f"{'eff~':>6} {'model':>6} {'steps':>7} {'MiB/step':>9} {'comm ms':>8} {'step ms':>8} {'kernel':>6} "
          f"{'+xfer':>6}")
    rows = []
    for s in seqlens:
        rows += simulate(args, device, dtype, s, heads, kv_heads, headdim, backend)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(rows) > 1:
        print("pooled: eff~ against the whole-sequence call's median over every row that times the same call")
        for row, t_full in pool_t_full(rows):
            print(f"{row['seqlen']:>7} {row['cp']:>3} {row['balancer']:>10} {row['direction']:>8} T_full "
                  f"{t_full:9.2f} (own {row['t_full_ms']:.2f}) max rank {row['max_rank_ms']:9.2f} eff~ "
                  f"{row['efficiency_of_medians_pooled']:.3f}")
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"cp_sim{'-' + args.tag if args.tag else ''}.json")
    meta = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, backend=backend, heads=heads, kv_heads=kv_heads, headdim=headdim,
        dtype=str(dtype), link_GBps=LINK_GBPS, window=args.window, queue_ahead_ms=args.queue_ahead_ms,
        back_to_back=args.back_to_back, steady=args.steady,
    )
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
