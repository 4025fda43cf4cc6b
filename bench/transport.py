"""The context-parallel transport itself (fa4dist.context_parallel.comm.Transport) moving a ring step's buffers: the
process group's own send/recv against copy-engine peer copies (FA4DIST_CP_TRANSPORT=peer), in one run.

    torchrun --nproc-per-node 2 bench/transport.py            # one process per GPU (NCCL), or all on GPU 0 (gloo)
    torchrun --nproc-per-node 2 bench/transport.py --chunk-mib 256   # the peer copies' slot size (default 32 MiB)

Every rank sends a buffer to the next rank and receives one from the previous, as a ring step does, through
``Transport.post_tagged`` and its ``wait``; the rounds of the two transports alternate.  Reported per size: the
median time per exchange and GB/s per direction.  With fewer GPUs than processes the ranks share GPU 0 over gloo
(the group's transport then stages through host memory; the peer copies stay on the device).  Writes
$OUT/<date>-transport.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from timing import require_cuda, require_torchrun  # bench/, the script's folder


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk-mib", type=int, default=None,
                   help="the peer copies' slot (chunk) size in MiB; default the library's (peer.CHUNK_BYTES)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require_torchrun("transport.py")
    require_cuda("transport.py")
    from fa4dist.context_parallel import peer
    from fa4dist.context_parallel.comm import Transport

    if args.chunk_mib is not None:  # (read when the group's links are made, below)
        peer.CHUNK_BYTES = args.chunk_mib << 20
    chunk_mib = peer.CHUNK_BYTES / 2**20

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    own_gpus = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if own_gpus else 0)
    torch.cuda.set_device(device)
    backend = "nccl" if own_gpus else "gloo"
    dist.init_process_group(backend, **({"device_id": device} if own_gpus else {}))
    transports = {"group": Transport(dist.group.WORLD, 120.0, "transport bench"),
                  "peer": Transport(dist.group.WORLD, 120.0, "transport bench")}
    transports["group"].ready()
    transports["peer"].use_peer_copies(True)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    times: dict = {}
    posts: dict = {}  # host microseconds of the post call
    for mib in args.mib:
        n = mib * 2**20 // 2
        send = torch.randn(n, device=device, dtype=torch.bfloat16)
        recv = torch.empty_like(send)
        for _ in range(args.rounds):
            for name, t in transports.items():
                for rep in range(args.reps + 1):
                    dist.barrier()
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    pending = t.post_tagged([(send, nxt, 30)], [(recv, prv, 30)], f"{mib} MiB")
                    host = time.perf_counter() - t0
                    pending.wait()
                    end.record()
                    end.synchronize()
                    if rep:  # (the first: setup and growth)
                        times.setdefault((name, mib), []).append(start.elapsed_time(end))
                        posts.setdefault((name, mib), []).append(host * 1e6)
        expected = torch.empty_like(send)
        transports["group"].post_tagged([(send, nxt, 31)], [(expected, prv, 31)], "check").wait()
        transports["peer"].post_tagged([(send, nxt, 31)], [(recv, prv, 31)], "check").wait()
        torch.cuda.synchronize()
        assert torch.equal(recv, expected), "the two transports delivered different bytes"
    rows = []
    for (name, mib), ms in times.items():
        med = statistics.median(ms)
        rows.append(dict(transport=name, backend=backend, mib=mib, ms=med, gb_per_s=mib * 2**20 / med / 1e6,
                         post_host_us=statistics.median(posts[(name, mib)]), world=world, shared_gpu=not own_gpus,
                         peer_chunk_mib=chunk_mib))
    if rank == 0:
        print(f"{world} ranks, {'one GPU each, NCCL' if own_gpus else 'sharing GPU 0, gloo'}; device "
              f"{torch.cuda.get_device_name(device)}; peer chunks of {chunk_mib:g} MiB")
        for mib in args.mib:
            line = {r["transport"]: r for r in rows if r["mib"] == mib}
            g, p = line["group"], line["peer"]
            print(f"{mib:>5} MiB  group {g['ms']:8.3f} ms ({g['gb_per_s']:7.1f} GB/s, post {g['post_host_us']:6.0f} us"
                  f" on the host)  peer {p['ms']:8.3f} ms ({p['gb_per_s']:7.1f} GB/s, post {p['post_host_us']:6.0f}"
                  f" us)  peer / group time {p['ms'] / g['ms']:.3f}", flush=True)
        date = datetime.date.today().isoformat()
        os.makedirs(args.out_dir, exist_ok=True)
        suffix = "" if args.chunk_mib is None else f"-chunk{args.chunk_mib}"
        with open(os.path.join(args.out_dir, f"{date}-transport{suffix}.json"), "w") as f:
            json.dump(dict(date=date, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
