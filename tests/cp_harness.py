"""A pool of worker processes forming one gloo process group, kept alive for a whole test module.

Spawning processes (and importing torch in each) dominates multi-process test time on a 2-core CI machine, so a
module starts one pool and runs many cases in it: ``pool.run(fn, **kwargs)`` calls ``fn(rank=..., world=...,
**kwargs)`` on every rank (fn must be a module-level function of an importable module, e.g. the test module) and
returns the per-rank results, or raises with every failing rank's traceback.  Every run has a deadline; a pool
that missed one is torn down and the next run says so.

Inside a worker, :data:`GROUPS` holds ready-made groups: ``GROUPS[n]`` is ranks 0..n-1 for every n <= world (n ==
world is WORLD), plus for a world of 4 the 2-D split ``GROUPS["ulysses"]`` ({0,1},{2,3}) and ``GROUPS["ring"]``
({0,2},{1,3}).  :func:`fresh_group` makes a throw-away group (for tests that break a group on purpose).
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback

import torch

GROUPS: dict = {}


def _worker(rank, world, init_file, commands, results, sys_path, threads):
    sys.path[:] = sys_path
    torch.set_num_threads(threads)
    import torch.distributed as dist

    try:
        reinit(rank, world, init_file, destroy=False)
        results.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = commands.get()
        if job is None:
            break
        module, name, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            value = fn(rank=rank, world=world, **kwargs)
            results.put((rank, "ok", value))
        except BaseException:  # noqa: BLE001
            results.put((rank, "error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def reinit(rank, world, init_file, destroy=True, before_groups=None):
    """(Re)starts this worker's process group (after destroying the current one) from the file store `init_file`
    and builds :data:`GROUPS` on it; ``before_groups``: a function called first on the new world (a test that needs
    groups of its own made before the harness's, e.g. for their names)."""
    import torch.distributed as dist

    if destroy:
        dist.destroy_process_group()
    GROUPS.clear()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    extra = before_groups() if before_groups is not None else None
    for n in range(1, world):
        GROUPS[n] = dist.new_group(list(range(n)))
    GROUPS[world] = dist.group.WORLD
    if world == 4:
        for name, sets in (("ulysses", ([0, 1], [2, 3])), ("ring", ([0, 2], [1, 3]))):
            for ranks in sets:
                g = dist.new_group(ranks)
                if rank in ranks:
                    GROUPS[name] = g
    return extra


_SHARED: dict = {}


def shared_pool(world: int) -> "DistPool":
    """One pool per world size for the whole pytest session (closed at exit); a broken pool is replaced."""
    pool = _SHARED.get(world)
    if pool is None or pool.broken:
        pool = _SHARED[world] = DistPool(world)
    return pool


def replace_shared_pool(world: int) -> "DistPool":
    """Closes the shared pool of `world` ranks and starts a fresh one (after a case that left its groups out of
    step on purpose)."""
    pool = _SHARED.pop(world, None)
    if pool is not None:
        pool.close()
    return shared_pool(world)


def _close_shared():
    for pool in _SHARED.values():
        pool.close()


atexit.register(_close_shared)


def fresh_group(ranks):
    """A new group of `ranks` (every world rank must call this, in the same order)."""
    import torch.distributed as dist

    return dist.new_group(list(ranks))


class DistPool:
    def __init__(self, world: int, start_timeout: float = 120.0, threads: int = 1):
        import torch.multiprocessing as mp

        self.world = world
        self._dir = tempfile.mkdtemp(prefix="fa4dist-cp-")
        init_file = os.path.join(self._dir, "store")
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(world)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, self._commands[r], self._results, list(sys.path),
                                              threads), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self.broken = None
        self._collect("start the worker pool", start_timeout)

    def _collect(self, what, timeout):
        deadline = time.monotonic() + timeout
        got, errors = {}, {}
        while len(got) + len(errors) < self.world:
            remaining = deadline - time.monotonic()
            try:
                rank, status, value = self._results.get(timeout=max(0.05, min(remaining, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got and r not in errors]
                if dead:
                    self._break(f"worker(s) {dead} died during {what}")
                if remaining <= 0:
                    missing = sorted(set(range(self.world)) - set(got) - set(errors))
                    self._break(f"ranks {missing} did not finish {what} within {timeout:g}s")
                continue
            if status == "error":
                errors[rank] = value
            else:
                got[rank] = value
        if errors:
            detail = "\n".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{what} failed on ranks {sorted(errors)}:\n{detail}")
        return [got[r] for r in range(self.world)]

    def _break(self, why):
        self.broken = why
        self.close()
        raise AssertionError(f"distributed test pool: {why}")

    def run(self, fn, timeout: float = 120.0, **kwargs):
        """fn(rank=, world=, **kwargs) on every rank; the list of results in rank order."""
        if self.broken:
            raise AssertionError(f"the distributed test pool is unusable: {self.broken}")
        for c in self._commands:
            c.put((fn.__module__, fn.__name__, kwargs))
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        return self._collect(f"{fn.__name__}({args})", timeout)

    def close(self):
        for c in self._commands:
            try:
                c.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)  # the file store's directory, one per pool
