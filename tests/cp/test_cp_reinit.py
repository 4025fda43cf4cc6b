"""A process group made again on the same store (a re-init on torchrun's store, or ``store=``): group names and
exchange numbers start over with the new world, and the last exchange's rows of the old one are still in the store.
Each rank takes its own back at its first use of the new world (comm.world_generation), so the new world's
exchanges do not read them as their own (they did: ranks that read different stale rows took different paths and
waited out the timeout)."""

import datetime
import multiprocessing
import queue
import socket

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_worlds(rank, world, port, results):
    import torch.distributed as dist

    import fa4dist
    from fa4dist.modules import FA4ContextParallelAttention

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    errors = []
    try:
        for steps, length in ((3, 64), (7, 96)):  # the second world passes the first one's last exchange number
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            attn = FA4ContextParallelAttention(dist.group.WORLD, strategy="ring", backend="reference", timeout=10)
            plan = attn.make_plan(length)
            gen = torch.Generator().manual_seed(length)
            q, k, v = (torch.randn(1, length, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
            want = attn.shard(fa4dist.attention(q, k, v, causal=True, backend="reference"), plan)
            for _ in range(steps):
                out = attn(*(attn.shard(t, plan) for t in (q, k, v)), plan=plan)
                errors.append(float((out - want).abs().max()))
            dist.barrier()
            dist.destroy_process_group()
        results.put((rank, max(errors)))
    except BaseException as err:  # noqa: BLE001
        results.put((rank, f"{type(err).__name__}: {err}"))


def test_a_second_world_on_the_same_store_runs():
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_two_worlds, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    except queue.Empty:
        pytest.fail("a rank did not finish in 120 s (the second world's exchanges waited for each other)")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {0: 0.0, 1: 0.0} or all(isinstance(e, float) and e < 1e-12 for e in got.values()), got
