"""A process group made again on the same store (a re-init on torchrun's store, or ``store=``): group names and
exchange numbers start over with the new world, and the last exchange's rows of the old one are still in the store.
Each rank takes its own back at its first use of the new world (comm.world_generation), so the new world's
exchanges do not read them as their own (they did: ranks that read different stale rows took different paths and
waited out the timeout).  torch's own re-init on one store hangs now and then in init_process_group (here too, on
gloo, about one run in seven): such a run skips, naming where."""

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
    """World 0 makes 3 store exchanges on the default group, world 1 (same store, group names and exchange numbers
    started over) makes 7: each must read its own world's rows (the store exchanges alone: gloo's own transfers
    after a re-init on one store are torch's to keep apart)."""
    import torch.distributed as dist

    from fa4dist.context_parallel.comm import Transport

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    try:
        for number, steps in enumerate((3, 7)):  # the second world passes the first's last exchange number
            results.put((rank, "stage", f"torch's init_process_group of world {number}"))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            results.put((rank, "stage", f"fa4dist exchanges in world {number}"))
            transport = Transport(dist.group.WORLD, timeout=10)
            for n in range(steps):
                rows = transport.host_gather_ints([100 * number + n, rank], f"exchange {n}")
                want = [[100 * number + n, r] for r in range(world)]
                assert rows == want, f"world {number} exchange {n}: {rows}, not {want}"
            results.put((rank, "stage", f"torch's destroy_process_group of world {number}"))
            dist.destroy_process_group()
        results.put((rank, "done", None))
    except BaseException as err:  # noqa: BLE001
        results.put((rank, "done", f"{type(err).__name__}: {err}"))


def test_a_second_world_on_the_same_store_runs():
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_two_worlds, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got, stage = {}, {}
    try:
        while len(got) < len(procs):
            rank, kind, value = results.get(timeout=45)
            (got if kind == "done" else stage)[rank] = value
    except queue.Empty:
        stuck = {rank: stage.get(rank) for rank in range(len(procs)) if rank not in got}
        if any(where and where.startswith("torch's") for where in stuck.values()):
            pytest.skip(f"torch's own re-init hung (not fa4dist's exchanges): {stuck}")
        pytest.fail(f"ranks did not finish in 45 s: {stuck} (the new world's exchanges waited for each other)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert got == {0: None, 1: None}, got
