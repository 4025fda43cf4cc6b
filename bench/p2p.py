"""Moving a ring step's K/V between the GPUs of one host: NCCL send/recv against copy-engine peer copies (torch's
symmetric memory), alone and under a concurrent matmul (NCCL's kernels take SMs; copy engines do not).

    torchrun --nproc-per-node 2 bench/p2p.py

Every rank sends a buffer to the next rank and receives one from the previous (the ring pattern).  Reported per
size: GB/s per direction for each transport, and how much a bf16 matmul loop on the compute stream slows down while
the transfer runs on a side stream.  Writes $OUT/<date>-p2p.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
from timing import cuda_median_ms, require_cuda, require_torchrun  # bench/, the script's folder


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return p.parse_args(argv)


class Nccl:
    name = "nccl"

    def __init__(self, n, device):
        self.send = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
        self.recv = torch.empty_like(self.send)

    def transfer(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        ops = [dist.P2POp(dist.isend, self.send, (rank + 1) % world), dist.P2POp(dist.irecv, self.recv,
                                                                                    (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


class PeerCopy:
    """Copy into the next rank's symmetric buffer (cudaMemcpy over NVLink: a copy engine), then a barrier."""

    name = "copy engine (symmetric memory)"

    def __init__(self, n, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.send = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
        self.recv = symm_mem.empty(n // 2, dtype=torch.bfloat16, device=device)
        self.handle = symm_mem.rendezvous(self.recv, dist.group.WORLD)
        nxt = (dist.get_rank() + 1) % dist.get_world_size()
        self.peer = self.handle.get_buffer(nxt, self.recv.shape, self.recv.dtype)

    def transfer(self):
        self.peer.copy_(self.send, non_blocking=True)
        self.handle.barrier()


def _time(fn, reps, device) -> float:
    """Seconds (median, bench/timing.py)."""
    return cuda_median_ms(fn, reps, device) / 1e3


def main(argv=None):
    args = parse_args(argv)
    require_torchrun('p2p.py')
    require_cuda('p2p.py')
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmuls():
        for _ in range(8):
            a @ a

    t_mm = _time(matmuls, args.reps, device)
    side = torch.cuda.Stream(device)
    rows = []
    for mib in args.mib:
        n = mib * 2**20
        for kind in (Nccl, PeerCopy):
            try:
                t = kind(n, device)
            except Exception as err:  # noqa: BLE001 - an unavailable transport is a result, reported as such
                rows.append(dict(transport=kind.name, mib=mib, error=f"{type(err).__name__}: {err}"[:300]))
                continue
            dist.barrier()
            seconds = _time(t.transfer, args.reps, device)

            def both():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    t.transfer()
                matmuls()
                torch.cuda.current_stream().wait_stream(side)

            dist.barrier()
            t_both = _time(both, args.reps, device)
            rows.append(dict(transport=t.name, mib=mib, gb_per_s=n / seconds / 1e9, transfer_ms=seconds * 1e3,
                             matmul_ms=t_mm * 1e3, matmul_with_transfer_ms=t_both * 1e3,
                             matmul_slowdown=t_both / max(t_mm, seconds) - 1.0))
    if rank == 0:
        for r in rows:
            if "error" in r:
                print(f"{r['transport']:<32} {r['mib']:>5} MiB  unavailable: {r['error']}")
            else:
                print(f"{r['transport']:<32} {r['mib']:>5} MiB  {r['gb_per_s']:7.1f} GB/s  transfer "
                      f"{r['transfer_ms']:7.3f} ms  matmuls {r['matmul_ms']:.2f} ms alone, "
                      f"{r['matmul_with_transfer_ms']:.2f} ms with it ({100 * r['matmul_slowdown']:+.1f}% vs max)",
                      flush=True)
        date = datetime.date.today().isoformat()
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"{date}-p2p.json"), "w") as f:
            json.dump(dict(date=date, world=dist.get_world_size(), rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
