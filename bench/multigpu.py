"""Context parallelism on the GPUs of one host (NCCL, one process per GPU): scaling against one GPU, torch's own
context parallel in the same run, and where a step's time goes.

    torchrun --nproc-per-node 2 bench/multigpu.py                        # the default sweep
    torchrun --nproc-per-node 2 bench/multigpu.py --tokens-per-gpu 32768 --heads 32:8 --profile

For every (tokens per GPU, heads, strategy): T_full = one GPU running fa4dist.attention forward+backward on the whole
sequence (cp x tokens per GPU), T = one context-parallel step (forward+backward of the local shards, slowest rank),
efficiency = T_full / (cp x T).  ``--peer`` runs torch.distributed.tensor.experimental.context_parallel with the
cuDNN SDPA backend on the same sizes (its own T_full: cuDNN SDPA on one GPU).  ``--profile`` traces one ring step on
rank 0 and reports compute-busy time, communication time and the communication not hidden under compute.  Also
measured: the per-call agreement check (verify=True against verify=False).  ``--forward-only`` times the forward
alone (no autograd) on one GPU and across the ranks.

Prints a table and writes $OUT/<date>-multigpu.json (or bench/results/) with rows
``strategy, balancer, cp, tokens_per_gpu, heads, kv_heads, step_ms, t_full_ms, efficiency, peer``.
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

import timing  # noqa: E402  (bench/, the script's folder)
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-gpu", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--heads", nargs="+", default=["32:8", "32:32"], help="query:key/value heads")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--strategies", nargs="+", default=["ring", "ulysses"])
    p.add_argument("--balancer", default="lpt")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peer", action="store_true", help="also time torch's own context parallel (cuDNN SDPA)")
    p.add_argument("--profile", action="store_true", help="trace one ring step (first size and heads)")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--window", type=int, default=0,
                   help="causal sliding window of W tokens, the query included (window=(W - 1, 0)); 0: none")
    p.add_argument("--invariant", action="store_true", help="also time cp_invariant=True (first size)")
    p.add_argument("--ulysses-chunks", type=int, nargs="+", default=[1],
                   help="Ulysses head chunks to time (FA4DIST_ULYSSES_CHUNKS, every rank alike; ulysses and hybrid "
                        "rows, one row each): each chunk's exchange overlaps the previous chunk's attention")
    p.add_argument("--transports", nargs="+", default=["group"], choices=["group", "peer"],
                   help="FA4DIST_CP_TRANSPORT values, each a row of every strategy (peer: copy-engine copies)")
    p.add_argument("--forward-only", action="store_true",
                   help="time the forward alone (no autograd), on one GPU and across the ranks alike")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return p.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, reps: int, device, collective: bool = True) -> float:
    """Median seconds of fn over `reps` runs after one warm-up; with `collective`, the slowest rank's time."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if collective:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        t = torch.tensor([time.perf_counter() - t0], device=device)
        if collective:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def _on_rank0(fn, reps, device) -> float:
    """fn timed on rank 0 alone (the one-GPU baseline); every rank gets the number."""
    t = torch.zeros(1, device=device, dtype=torch.float64)
    if dist.get_rank() == 0:
        t.fill_(_timed(fn, reps, device, collective=False))
    dist.broadcast(t, 0)
    return float(t)


def _inputs(total, heads, kv_heads, d, device, layout="bshd"):
    gen = torch.Generator(device=device).manual_seed(total + heads)
    shape = (lambda h: (1, total, h, d)) if layout == "bshd" else (lambda h: (1, h, total, d))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [torch.randn(*shape(h), device=device, dtype=dtype, generator=gen)
            for h in (heads, kv_heads, kv_heads, heads)]


def _window(args) -> tuple[int, int]:
    return (args.window - 1, 0) if args.window else (-1, -1)


def ours(args, world, device, tokens, heads, kv_heads, rows, t_full_cache):
    import fa4dist
    from fa4dist.context_parallel.peer import TRANSPORT_ENV
    from fa4dist.context_parallel.ulysses import CHUNKS_ENV
    from fa4dist.modules import FA4ContextParallelAttention

    total = tokens * world
    q, k, v, dout = _inputs(total, heads, kv_heads, args.headdim, device)
    key = (total, heads, kv_heads)
    if key not in t_full_cache:
        leaves = [t.detach().clone().requires_grad_() if dist.get_rank() == 0 else t for t in (q, k, v)]

        def full():
            for t in leaves:
                t.grad = None
            if args.forward_only:
                with torch.no_grad():
                    fa4dist.attention(*leaves, causal=True, window=_window(args), deterministic=args.deterministic)
                return
            fa4dist.attention(*leaves, causal=True, window=_window(args),
                              deterministic=args.deterministic).backward(dout)

        t_full_cache[key] = _on_rank0(full, args.reps, device)
        leaves = None
    t_full = t_full_cache[key]
    first = tokens == args.tokens_per_gpu[0]
    for strategy in args.strategies:
        variants = [dict(verify=True, cp_invariant=False)]
        if strategy != "ring":  # one row per head-chunk count of the Ulysses exchange
            variants = [dict(variant, ulysses_chunks=n) for variant in variants for n in args.ulysses_chunks]
        variants = [dict(variant, transport=name) for name in args.transports for variant in variants]
        if strategy == "ring" and first:
            variants.append(dict(verify=False, cp_invariant=False))  # the per-call agreement check's cost
        if args.invariant and first:
            variants.append(dict(verify=True, cp_invariant=True))  # cp_invariant's cost
        for variant in variants:
            options = {name: value for name, value in variant.items() if name not in ("ulysses_chunks", "transport")}
            os.environ[CHUNKS_ENV] = str(variant.get("ulysses_chunks", 1))  # (read per call, every rank alike)
            os.environ[TRANSPORT_ENV] = variant["transport"]
            module = FA4ContextParallelAttention(dist.group.WORLD, strategy=strategy, causal=True,
                                                 window=_window(args), deterministic=args.deterministic, **options)
            try:
                plan = module.make_plan(total, balancer=args.balancer)
                local = [module.shard(t, plan).requires_grad_() for t in (q, k, v)]
            except ValueError as err:  # e.g. a head split Ulysses cannot do
                if dist.get_rank() == 0:
                    print(f"skip {strategy} {heads}/{kv_heads}: {err}", flush=True)
                continue
            local_dout = module.shard(dout, plan)

            def step():
                for t in local:
                    t.grad = None
                if args.forward_only:
                    with torch.no_grad():
                        module(*local, plan=plan)
                    return
                module(*local, plan=plan).backward(local_dout)

            t = _timed(step, args.reps, device)
            row = dict(strategy=strategy, balancer=args.balancer, cp=world, tokens_per_gpu=tokens, heads=heads,
                       kv_heads=kv_heads, step_ms=t * 1e3, t_full_ms=t_full * 1e3,
                       efficiency=t_full / (world * t), peer=None, deterministic=args.deterministic,
                       window=args.window or None, speedup=t_full / t,
                       direction="fwd" if args.forward_only else "fwd+bwd", **variant)
            rows.append(row)
            _print(row)
            local = None


def peer(args, world, device, tokens, heads, rows):
    """torch's own context parallel (SDPA with cuDNN, rotate by all-to-all) on the same problem."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    total = tokens * world
    q, k, v, dout = _inputs(total, heads, heads, args.headdim, device, layout="bhsd")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        full_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)] if dist.get_rank() == 0 else None

        def full():
            for t in full_leaves:
                t.grad = None
            F.scaled_dot_product_attention(*full_leaves, is_causal=True).backward(dout)

        t_full = _on_rank0(full, args.reps, device)
        full_leaves = None  # free before the distributed run
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
        set_rotate_method("alltoall")
        leaves = [t.detach().clone() for t in (q, k, v)]  # sharded in place on entry: grads only after that
        d = dout.clone()
        with context_parallel(mesh, buffers=[*leaves, d], buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={*leaves, d}):
            for t in leaves:
                t.requires_grad_()

            def step():
                for t in leaves:
                    t.grad = None
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(d)

            t = _timed(step, args.reps, device)
    row = dict(strategy="ring (alltoall rotate)", balancer="head-tail", cp=world, tokens_per_gpu=tokens, heads=heads,
               kv_heads=heads, step_ms=t * 1e3, t_full_ms=t_full * 1e3, efficiency=t_full / (world * t),
               peer="torch_context_parallel_cudnn")
    rows.append(row)
    _print(row)


def profile(args, world, device, tokens, heads, kv_heads) -> dict:
    """One ring step under torch.profiler on every rank; rank 0's kernel timeline summarized."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from fa4dist.modules import FA4ContextParallelAttention

    total = tokens * world
    q, k, v, dout = _inputs(total, heads, kv_heads, args.headdim, device)
    module = FA4ContextParallelAttention(dist.group.WORLD, strategy="ring", causal=True, window=_window(args))
    plan = module.make_plan(total, balancer=args.balancer)
    local = [module.shard(t, plan).requires_grad_() for t in (q, k, v)]
    local_dout = module.shard(dout, plan)

    def step():
        module(*local, plan=plan).backward(local_dout)

    step()
    torch.cuda.synchronize(device)
    dist.barrier()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    spans = {"comm": [], "compute": []}
    for e in kernels:
        kind = "comm" if "nccl" in e.name.lower() else "compute"
        start = e.time_range.start
        spans[kind].append((start, start + e.device_time))
    union = {kind: _union(s) for kind, s in spans.items()}
    lo = min(a for s in spans.values() for a, _ in s)
    hi = max(b for s in spans.values() for _, b in s)
    busy_all = _union(spans["comm"] + spans["compute"])
    summary = dict(
        rank=dist.get_rank(), step_us=hi - lo, compute_busy_us=_length(union["compute"]),
        comm_busy_us=_length(union["comm"]), comm_not_under_compute_us=_length(busy_all) - _length(union["compute"]),
        gpu_idle_us=(hi - lo) - _length(busy_all),
        top_kernels=[(e.key, round(e.device_time_total / 1e3, 3), e.count) for e in sorted(
            prof.key_averages(), key=lambda e: -e.device_time_total)[:12]],
    )
    with open(os.path.join(args.out_dir, f"profile-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(summary, f, indent=1)  # every rank's kernels: the critical rank need not be rank 0
    if dist.get_rank() == dist.get_world_size() - 1:
        path = os.path.join(args.out_dir, "multigpu-trace.json")
        prof.export_chrome_trace(path)
        if os.path.getsize(path) > 15 * 2**20:
            os.remove(path)
    return summary


def _union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _print(row):
    if dist.get_rank() == 0:
        print(f"{row['strategy']:<24} cp={row['cp']} {row['tokens_per_gpu']:>7} tok/GPU {row['heads']:>2}/"
              f"{row['kv_heads']:<2} step {row['step_ms']:9.1f} ms  one GPU {row['t_full_ms']:9.1f} ms  "
              f"efficiency {row['efficiency']:.3f}"
              + (f"  window {row['window']}: {row['speedup']:.2f}x one GPU" if row.get("window") else "")
              + (f"  verify={row['verify']} cp_invariant={row['cp_invariant']}" if 'verify' in row else "")
              + (f"  chunks {row['ulysses_chunks']}" if row.get("ulysses_chunks", 1) > 1 else "")
              + (f"  transport {row['transport']}" if row.get("transport", "group") != "group" else "")
              + ("  (forward)" if row.get("direction") == "fwd" else "")
              + (f"  [{row['peer']}]" if row["peer"] else ""), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.forward_only and (args.peer or args.profile or args.invariant):
        raise SystemExit("multigpu.py: --forward-only times our forward alone; --peer, --profile and --invariant time "
                         "forward+backward steps: run them without it")
    timing.require_torchrun('multigpu.py')
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30), device_id=device)
        name = f"{torch.cuda.get_device_name(device)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    else:  # a smoke run of the script on CPUs (gloo, tiny sizes): no peer, no profile
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        args.peer = args.profile = False
        name = "CPU (smoke run)"
    os.makedirs(args.out_dir, exist_ok=True)
    if rank == 0:
        print(f"multigpu: {world} x {name}, torch {torch.__version__}", flush=True)
    rows, t_full_cache, extra = [], {}, {}
    for tokens in args.tokens_per_gpu:
        for spec in args.heads:
            heads, kv_heads = map(int, spec.split(":"))
            ours(args, world, device, tokens, heads, kv_heads, rows, t_full_cache)
            if args.peer and heads == kv_heads:
                try:
                    peer(args, world, device, tokens, heads, rows)
                except Exception as err:  # noqa: BLE001 - the peer's failure is a result, not our crash
                    if rank == 0:
                        print(f"peer failed: {type(err).__name__}: {err}"[:500], flush=True)
                    rows.append(dict(strategy="torch context parallel", cp=world, tokens_per_gpu=tokens, heads=heads,
                                     kv_heads=heads, peer="torch_context_parallel_cudnn",
                                     error=f"{type(err).__name__}: {err}"[:500]))
            torch.cuda.empty_cache()
    if args.profile:
        heads, kv_heads = map(int, args.heads[0].split(":"))
        try:
            mine = profile(args, world, device, args.tokens_per_gpu[0], heads, kv_heads)
        except Exception as err:  # noqa: BLE001
            mine = dict(step_us=0.0, compute_busy_us=0.0, comm_busy_us=0.0, comm_not_under_compute_us=0.0,
                        gpu_idle_us=0.0, top_kernels=[f"profile failed: {type(err).__name__}: {err}"[:500]])
            print(mine["top_kernels"][0], flush=True)
        t = torch.tensor([mine["step_us"], mine["compute_busy_us"], mine["comm_busy_us"],
                          mine["comm_not_under_compute_us"], mine["gpu_idle_us"]], device=device, dtype=torch.float64)
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
        summaries = [dict(zip(("step_us", "compute_busy_us", "comm_busy_us", "comm_not_under_compute_us",
                               "gpu_idle_us"), g.tolist())) for g in gathered]
        extra["profile"] = dict(ranks=summaries, rank0_top_kernels=mine["top_kernels"],
                                tokens_per_gpu=args.tokens_per_gpu[0], heads=heads, kv_heads=kv_heads)
        if rank == 0:
            for r, s in enumerate(summaries):
                print(f"profile rank {r}: step {s['step_us'] / 1e3:.1f} ms, compute busy "
                      f"{s['compute_busy_us'] / 1e3:.1f} ms, comm {s['comm_busy_us'] / 1e3:.1f} ms, "
                      "comm not under compute "
                      f"{s['comm_not_under_compute_us'] / 1e3:.2f} ms, GPU idle {s['gpu_idle_us'] / 1e3:.2f} ms",
                      flush=True)
        if rank == world - 1:
            for name, ms, count in mine["top_kernels"]:
                print(f"  rank {rank}: {ms:8.3f} ms  x{count:<4} {name[:110]}", flush=True)
    if rank == 0:
        date = datetime.date.today().isoformat()
        path = os.path.join(args.out_dir, f"{date}-multigpu.json")
        with open(path, "w") as f:
            json.dump(dict(date=date, world=world, device=name,
                           torch=torch.__version__, args=vars(args), rows=rows, **extra), f, indent=1)
        print(f"wrote {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
