"""What the invariant gradients' per-site exchanges cost per backward: CPU, gloo, 2 processes, a tiny FA4Llama.

    PYTHONPATH=. python bench/invariant_grads_sites.py [--layers 2 16] [--tokens 64] [--reps 10] [--rounds 5]
        [--src DIR ...] [--store tcp|file]

Each process builds the same model (the "tiny" config with ``--layers`` layers: 9 weights per layer, plus the
embedding, the final norm and the LM head: 21 and 147 sites by default), installs
``set_invariant_grads(True, WORLD)`` and times ``loss.backward()`` (the forward and ``finish()`` are outside the timed
part): the median over ``--reps`` backward passes, after warm-up.
The same backward without a group (no exchange at all) gives the compute part.  ``--src``: checkouts whose
fa4dist is imported instead (to compare commits with one script): each round runs a fresh pair of processes per
checkout, in turn, so that a busy machine's slow spells fall on all of them alike; the table has the median over
the ``--rounds``. Writes the table's rows to $OUT/<date>-invariant-grads-sites.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 16])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--store", choices=["tcp", "file"], default="tcp",
                   help="the rendezvous store: a TCPStore (torchrun's) or a FileStore (the test harness's)")
    p.add_argument("--src", nargs="+", default=[None], help="checkouts to import fa4dist from (default: as is)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return p.parse_args(argv)


def _backward_ms(model, tokens, reps, warmup, barrier):
    """Median ms of model(tokens).backward() over reps (after warmup); finish() after each, untimed."""
    import torch

    times = []
    for i in range(warmup + reps):
        loss = model(tokens, torch.arange(tokens.numel())).float().logsumexp(-1).sum()
        barrier()
        start = time.perf_counter()
        loss.backward()
        barrier()  # the slower rank's time: the step waits for it
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        model.invariant_grads.finish()
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _worker(rank, world, init, src, args, out):
    if src:
        sys.path.insert(0, os.path.abspath(src))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from fa4dist.models import FA4Llama, get_config

    alone = [dist.new_group([r]) for r in range(world)][rank]
    rows = []
    for layers in args.layers:
        tokens = torch.randint(0, 256, (args.tokens,), generator=torch.Generator().manual_seed(rank))
        per = {}
        for mode, group in (("local", alone), ("group", dist.group.WORLD)):  # alone: a group of one, no exchange
            torch.manual_seed(0)
            model = FA4Llama(get_config("tiny", n_layers=layers), None, backend="reference")
            grads = model.set_invariant_grads(True, group)
            per[mode] = _backward_ms(model, tokens, args.reps, args.warmup, dist.barrier)
        rows.append((layers, len(grads.sites), per["local"], per["group"]))
    if rank == 0:
        import fa4dist

        out.put((os.path.dirname(os.path.dirname(fa4dist.__file__)), rows))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(args, src):
    """One pair of processes on a fresh store: (where fa4dist came from, rows)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}" if args.store == "file" else f"tcp://127.0.0.1:{_free_port()}"
        procs = [ctx.Process(target=_worker, args=(r, 2, init, src, args, out)) for r in range(2)]
        for p in procs:
            p.start()
        found = out.get(timeout=1200)
        for p in procs:
            p.join()
    return found


def main(argv=None):
    args = parse_args(argv)
    runs: dict = {}
    for _ in range(args.rounds):
        for src in args.src:
            where, rows = _pair(args, src)
            runs.setdefault(where, []).append(rows)
    table = []
    print(f"store: {args.store}, {args.tokens} tokens, median of {args.reps} backward passes per round, median over "
          f"{args.rounds} round(s)")
    for where, rounds in runs.items():
        print(f"fa4dist from {where}")
        print(f"{'layers':>6} {'sites':>5} {'local ms':>9} {'2 ranks ms':>10} {'exchange ms':>11} "
              f"{'per site us':>11}")
        for i, (layers, sites, _, _) in enumerate(rounds[0]):
            local = statistics.median(r[i][2] for r in rounds)
            group = statistics.median(r[i][3] for r in rounds)
            print(f"{layers:>6} {sites:>5} {local:>9.2f} {group:>10.2f} {group - local:>11.2f} "
                  f"{(group - local) / sites * 1e3:>11.1f}")
            table.append(dict(fa4dist=str(where), layers=layers, sites=sites, local_ms=local, group_ms=group,
                              exchange_ms=group - local))
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{date}-invariant-grads-sites.json"), "w") as fh:
        json.dump(dict(date=date, store=args.store, tokens=args.tokens, rows=table), fh, indent=1)


if __name__ == "__main__":
    main()
