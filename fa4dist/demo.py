"""Context-parallel attention demo: one long causal sequence, forward and backward through
`FA4ContextParallelAttention` on N ranks, checked against single-process attention of the whole sequence.

    torchrun --nproc-per-node 4 -m fa4dist.demo                  # N ranks (gloo on CPU, NCCL on GPUs)
    python -m fa4dist.demo --nproc 4                             # the same without torchrun (spawns N processes)
    torchrun --nproc-per-node 4 -m fa4dist.demo --docs 12        # a packed batch of 12 documents instead
    torchrun --nproc-per-node 8 -m fa4dist.demo --seqlen 131072 --strategy hybrid --ulysses-degree 2

On GPUs each rank takes its own device with NCCL; with more ranks than GPUs (one H200, N > 1) the ranks share the
device over gloo and the transport stages tensors through pinned host memory.  Prints the strategy, the balance
report, tokens/s, peak memory per rank and the max error against the single-process result (every rank
computes it, so that every rank exits with the verdict).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=None, help="total tokens (default 2048 on CPU, 32768 on GPU)")
    p.add_argument("--docs", type=int, default=0, help="packed documents of random lengths (0: one sequence)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch (one-sequence mode)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (a divisor of --heads: GQA)")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--strategy", default="ring", choices=["auto", "ring", "ulysses", "hybrid"], help="default ring")
    p.add_argument("--ulysses-degree", type=int, default=None,
                   help="the Ulysses group size of --strategy hybrid (ring over the rest)")
    p.add_argument("--balancer", default="lpt", choices=["lpt", "zigzag", "contiguous"],
                   help="the plan's balancer (default lpt)")
    p.add_argument("--num-chunks", type=int, default=None,
                   help="chunks the tokens are cut into, a multiple of the ranks (default: 2 per rank for one "
                        "sequence, 8 per rank for --docs)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32", "float64"],
                   help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--backend", default="auto", help="kernel backend: auto, reference, sdpa, cute, ...")
    p.add_argument("--iters", type=int, default=2, help="timed forward+backward iterations (after one warm-up)")
    p.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    p.add_argument("--deterministic", action="store_true", help="deterministic backward kernels")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any wait on another rank may take before it fails naming what it waited for")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn when not started by torchrun (default 2; under torchrun, its world size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and of --docs' document lengths")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Sizes the demo cannot run refused by name, before any process starts (the library checks the rest, e.g.
    heads the Ulysses degree must divide, on every rank)."""
    from fa4dist.kernels.problem import check_seed

    positive = ["batch", "heads", "kv_heads", "headdim", "iters"]
    optional = ("seqlen", "num_chunks", "ulysses_degree", "nproc")
    positive += [name for name in optional if getattr(args, name) is not None]
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.docs < 0:
        p.error(f"--docs must be 0 (one sequence) or a positive number of documents, got {args.docs}")
    if args.docs > 0 and args.batch != 1:
        p.error("--batch applies to the one-sequence mode; packed documents (--docs) are one batch")
    if args.seqlen is not None and args.docs > args.seqlen:
        p.error(f"--docs {args.docs} needs at least as many tokens (--seqlen {args.seqlen})")
    if args.strategy == "ring" and args.ulysses_degree not in (None, 1):  # (ring is the default: say so)
        p.error(f"--ulysses-degree {args.ulysses_degree} needs --strategy hybrid (or auto); --strategy ring, the "
                "default, runs no Ulysses group")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    if not 0 < args.timeout < math.inf:  # (the module refuses inf too, but only once every rank has started)
        p.error(f"--timeout must be a positive, finite number of seconds, got {args.timeout}")
    try:  # (past torch's range: "Overflow when unpacking long long" on every rank, their group up)
        check_seed("--seed", args.seed)
    except ValueError as err:
        p.error(str(err))
    from fa4dist.kernels.registry import get_backend

    try:  # (a misspelt backend failed on every rank once the group was up; the name only: whether it runs on the
        # rank's device is asked there, without touching CUDA before each rank has picked its GPU)
        if args.backend != "auto":
            get_backend(args.backend)
    except ValueError as err:
        p.error(f"--backend: {err}")
    world = _launched_world()
    if world is None:
        args.nproc = 2 if args.nproc is None else args.nproc
    elif args.nproc not in (None, world):  # the launcher started the ranks: --nproc was ignored silently
        p.error(f"--nproc {args.nproc} contradicts the launcher's world size {world} (WORLD_SIZE): --nproc is the "
                "number of processes to spawn without torchrun; leave it out under torchrun (--nproc-per-node sets it)")
    else:
        args.nproc = world
    # the strategy's Ulysses degree against the ranks, by the demo's option names (the module's own refusals, on
    # every rank once the group is up, name its ulysses_degree= argument)
    if args.nproc > 1 and args.strategy == "hybrid" and args.ulysses_degree is None:
        p.error("--strategy hybrid needs --ulysses-degree U (Ulysses over U ranks, ring over the rest)")
    if args.ulysses_degree is not None and args.nproc % args.ulysses_degree:  # (1 rank too: it was ignored)
        p.error(f"--ulysses-degree {args.ulysses_degree} must divide the number of ranks ({args.nproc})")
    if args.nproc > 1 and args.strategy == "ulysses" and args.ulysses_degree not in (None, args.nproc):
        p.error(f"--ulysses-degree {args.ulysses_degree} contradicts --strategy ulysses, which runs Ulysses over all "
                f"{args.nproc} ranks (--strategy hybrid runs it over fewer)")
    # the plan's chunk counts by the demo's option names (make_plan refuses them on every rank once the group is up,
    # naming its num_chunks= argument); auto's Ulysses degree depends on the heads: its ring is left to make_plan
    if args.num_chunks is not None:
        if args.num_chunks % args.nproc:
            p.error(f"--num-chunks {args.num_chunks} must be a multiple of the number of ranks ({args.nproc}): every "
                    "rank holds as many chunks")
        u = {"ring": 1, "ulysses": args.nproc, "hybrid": args.ulysses_degree}.get(args.strategy)
        if args.balancer == "zigzag" and u and args.num_chunks % (2 * (args.nproc // u)):
            p.error(f"--balancer zigzag needs --num-chunks to be a multiple of {2 * (args.nproc // u)} (two chunks per "
                    f"ring member and round; {args.nproc // u} ring member(s)), got {args.num_chunks}")


def _launched_world():
    """The world size when a launcher (torchrun, or this demo's own spawn) started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


class _Progress:
    """A one-line bar redrawn in place on a terminal; plain lines when stdout is a log or a pipe; silent off rank 0."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.total, self.enabled, self.desc, self.n = total, enabled, desc, 0
        self.tty = enabled and sys.stdout.isatty()

    def update(self, seconds: float):
        self.n += 1
        if not self.enabled:
            return
        width = 30
        done = width * self.n // max(1, self.total)
        line = f"{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} ({seconds * 1e3:.1f} ms)"
        if self.tty:
            print("\r" + line, end="\n" if self.n == self.total else "", flush=True)
        else:
            print(line, flush=True)


class StartFailed(RuntimeError):
    """The ranks' process group did not start (a rank missing, or the connections timed out)."""


def _setup(timeout: float):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world:  # (the rendezvous waited for a rank that cannot come)
        raise ValueError(f"RANK {rank} must be in [0, WORLD_SIZE {world})")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
        backend = "nccl" if gpus >= local_world else "gloo"  # several ranks per GPU: gloo + host staging
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    kw = dict(device_id=device) if backend == "nccl" else {}
    # --timeout bounds the start too: a rank that never comes fails the rendezvous then, not after 30 minutes
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **kw)
    except RuntimeError as err:  # (the store's rendezvous, or the backend's connections: their own error types)
        raise StartFailed(f"the process group did not start within --timeout {timeout:g}s: "
                          f"{type(err).__name__}: {err}") from err
    return rank, world, device, backend


def _peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cu_seqlens(total: int, docs: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), min(docs, total) - 1)) if docs > 1 else []
    return [0] + cuts + [total]


def run(args) -> int:
    import fa4dist
    from fa4dist.kernels import invariant
    from fa4dist.modules import FA4ContextParallelAttention

    rank, world, device, comm = _setup(args.timeout)
    lead = rank == 0
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    total = args.seqlen if args.seqlen is not None else (32768 if device.type == "cuda" else 2048)
    packed = args.docs > 0
    if packed and args.docs > total:
        raise ValueError(f"--docs {args.docs} needs at least as many tokens (the default --seqlen is {total})")
    module = FA4ContextParallelAttention(
        dist.group.WORLD, strategy=args.strategy, causal=True, backend=args.backend, timeout=args.timeout,
        ulysses_degree=args.ulysses_degree, deterministic=True if args.deterministic else None,
    )
    cu = _cu_seqlens(total, args.docs, args.seed) if packed else None
    plan = module.make_plan(cu if packed else total, balancer=args.balancer, num_chunks=args.num_chunks,
                            heads=(args.heads, args.kv_heads))  # (auto: balanced for the degree it will run)
    u = module.cp.degree(args.heads, args.kv_heads, plan) if world > 1 else 1
    cp_rank = module.cp_rank

    gen = torch.Generator(device=device).manual_seed(args.seed)
    lead_shape = (total,) if packed else (args.batch, total)
    sd = 0 if packed else 1

    def randn(h):
        return torch.randn(*lead_shape, h, args.headdim, generator=gen, device=device, dtype=dtype)

    q, k, v, dout = randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads)
    local = [plan.shard(t, seq_dim=sd, rank=cp_rank).requires_grad_() for t in (q, k, v)]
    local_dout = plan.shard(dout, seq_dim=sd, rank=cp_rank)
    if lead:
        kind = f"{args.docs} packed documents, {total} tokens" if packed else f"batch {args.batch} x {total} tokens"
        # the modes that change the numerics and the time; cp_invariant comes from the environment alone (a
        # FA4DIST_CP_INVARIANT=1 left exported from a recipe's run made the demo ~3x slower without a word)
        modes = (", deterministic" if args.deterministic else "") + (
            f", cp_invariant ({invariant.ENV}={os.environ.get(invariant.ENV)!r})" if module.cp.cp_invariant else "")
        print(f"fa4dist demo: {world} ranks ({comm}, {device.type}), {kind}, heads {args.heads}/{args.kv_heads}, "
              f"head dim {args.headdim}, {str(dtype).replace('torch.', '')}, causal, backend {args.backend}{modes}")
        print(f"strategy: {module.cp.strategy_name(u) if world > 1 else 'single process'}"
              + (f" (ulysses {u} x ring {world // u})" if 1 < u < world else ""))
        print(plan.balance_report())
        if module.cp.cp_invariant and world // u > 1:  # (the report's ring steps are the plan's, not this mode's)
            print("cp_invariant: every ring member gathers the whole sequence's K/V (and in the backward its Q, dO, "
                  "out) instead of running the ring steps above (fa4dist/context_parallel/gather.py)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    times = []
    bar = _Progress(args.iters + 1, lead, "forward+backward")
    for it in range(args.iters + 1):
        for t in local:
            t.grad = None
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        out = module(*local, plan=plan)
        out.backward(local_dout)
        _sync(device)
        elapsed = time.perf_counter() - start
        if it > 0:  # the first iteration warms up (kernel compiles, allocator)
            times.append(elapsed)
        bar.update(elapsed)
    # per-rank statistics through a tensor collective (object collectives would need numpy)
    mine = torch.tensor([_peak_memory_mb(device), sum(times) / max(1, len(times))], dtype=torch.float64)
    stats = _all_gather(mine, world, device)
    if lead:
        slowest = max(float(s[1]) for s in stats)
        tokens = total * (1 if packed else args.batch)
        print(f"forward+backward: {slowest * 1e3:.1f} ms per step (slowest rank, mean of {len(times)}), "
              f"{tokens / slowest:,.0f} tokens/s")
        unit = "GPU memory allocated" if device.type == "cuda" else "max RSS"
        print(f"peak memory ({unit}): " + ", ".join(f"rank {r} {float(s[0]):.0f} MiB" for r, s in enumerate(stats)))

    ok = True
    if not args.no_check:
        # every rank's local out and gradients, gathered in rank order (the demo's group is WORLD: cp rank ==
        # world rank); every rank checks, so every rank knows the verdict
        mine = [out.detach()] + [t.grad for t in local]
        gathered = [_all_gather(t.contiguous(), world, device) for t in mine]
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        cut = plan.cu_seqlens_tensor(device) if packed else None
        ref = fa4dist.attention(*leaves, causal=True, cu_seqlens_q=cut, cu_seqlens_k=cut, backend=args.backend)
        ref.backward(dout)
        refs = [ref.detach()] + [t.grad for t in leaves]
        tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2e-2)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = plan.unshard(gathered[i], seq_dim=sd).cpu().double()
            want = refs[i].cpu().double()
            err = float((got - want).abs().max())
            rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
            good = rel < tol  # False for NaN
            ok &= good
            if lead:
                print(f"check {name:>3}: max abs error {err:.2e}, rel. error {rel:.2e} vs single-process attention "
                      f"({'ok' if good else 'FAILED'}, tolerance {tol:g})")
    if lead:
        verdict = ("PASS" if ok else "FAIL") if not args.no_check else "DONE"  # (PASS: a comparison passed)
        checked = "checked against single-process attention" if not args.no_check else "not checked (--no-check)"
        print(f"{verdict}: fa4dist demo, {world} ranks, {module.cp.strategy_name(u) if world > 1 else 'single'}, "
              f"{checked}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _all_gather(t: torch.Tensor, world: int, device) -> list:
    """Every rank's tensor (they may differ in length along dim 0 or 1 — local shards do), in rank order."""
    t = t.to(device)
    dim = 0 if t.dim() <= 3 else 1  # packed (tokens, ...) or dense (batch, tokens, ...)
    n = torch.tensor([t.shape[dim] if t.dim() else 0], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(x) for x in sizes)
    if t.dim():
        pad = list(t.shape)
        pad[dim] = longest - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return [p.narrow(dim, 0, int(n)) if p.dim() else p for p, n in zip(parts, sizes)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now (a local rendezvous: the demo's spawned ranks, the
    recipes' world of one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_process(code: int = 0):
    """Ends a launched job's process (the demo's ranks, the recipes' ``__main__``) once its work is done and its
    process group destroyed: flushes the output and leaves with ``os._exit``, without the interpreter's teardown of
    torch's C++ objects. On CPU a gloo thread can still be joinable at that teardown and abort a process whose run
    had finished ("terminate called without an active exception" after the summary, on rank 1 of a cp = 2 FSDP2
    recipe run in CI on 2026-12-02, past the barrier before the group's destruction; about once in twenty CI runs,
    not reproduced in 20 runs on the same machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def error_line(text: str) -> None:
    """Writes ``text`` and its line end to stderr in one write, as a rank's one-line failure: the ranks share
    torchrun's pipe, and print() writes the text and the line end separately there (stderr on a pipe is
    write-through), so two ranks' lines ran together ("... got 3fa4dist demo: rank 3 failed: ...")."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def _spawned(local_rank: int, nproc: int, port: int, argv):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    exit_process(run(_args(argv)))


def main(argv=None) -> int:
    args = _args(argv)
    if _launched_world() is not None:
        from fa4dist.context_parallel.comm import CommError

        try:
            return run(args)
        except (ValueError, TypeError, CommError, StartFailed) as err:
            # the library's refusal of a size or option (every rank raises it), or a wait on another rank past
            # --timeout (the start's included): one line per rank, as the self-launched demo prints, instead of a
            # traceback per rank from deep inside the module
            error_line(f"fa4dist demo: rank {os.environ['RANK']} failed: {type(err).__name__}: {err}")
            return 1
    import torch.multiprocessing as mp

    port = free_port()
    try:
        mp.spawn(_spawned, args=(args.nproc, port, argv if argv is not None else sys.argv[1:]), nprocs=args.nproc)
    except mp.ProcessExitedException as err:
        print(f"fa4dist demo: a rank failed ({err})", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as err:
        # the rank's own traceback ends the message; its last line names the error
        last = str(err).strip().splitlines()[-1]
        print(f"fa4dist demo: a rank failed: {last}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
