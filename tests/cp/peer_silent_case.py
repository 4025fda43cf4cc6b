"""Run by tests/cp/test_peer_gpu.py under ``torch.distributed.run --nproc-per-node 2`` (two ranks on GPU 0, gloo):
one batch over the peer copies in each direction, then rank 0 posts a second receive that rank 1 never sends.  Rank
0's stream then waits for a word that never comes; the transport's watchdog must abort it after the 5 s timeout
with a message naming the wait."""

import os
import time

import torch
import torch.distributed as dist

from fa4dist.context_parallel.comm import Transport


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    t = Transport(dist.group.WORLD, timeout=5.0, label="peer test")
    t.use_peer_copies(True)
    mine, theirs = torch.full((1000,), float(rank), device="cuda"), torch.empty(1000, device="cuda")
    t.post_tagged([(mine, 1 - rank, 30)], [(theirs, 1 - rank, 30)], "K/V of the first step").wait()
    assert float(theirs[0]) == 1 - rank
    if rank == 0:
        t.post_tagged([], [(theirs, 1, 30)], "K/V of a test step").wait()
        torch.cuda.synchronize()  # never returns: the watchdog ends the process
        print("rank 0 was not stopped", flush=True)
    else:
        time.sleep(60)


if __name__ == "__main__":
    main()
