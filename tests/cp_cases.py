"""Context-parallel test cases, run inside the worker pool of :mod:`cp_harness` (one call per rank).

Every rank builds the same global inputs from the seed, runs its shards through the CP module, and compares with
the single-process fp64 oracle of the whole sequence (tests/oracle.py, which shares no code with fa4dist)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random

import torch

from cp_harness import GROUPS
from fa4dist.context_parallel import make_plan
from fa4dist.modules import FA4ContextParallelAttention
from oracle import naive_attention


def random_docs(seed: int, n: int, max_len: int, allow_empty: bool = True) -> list[int]:
    rng = random.Random(seed)
    cu = [0]
    for i in range(n):
        low = 0 if allow_empty and i % 5 == 3 else 1
        cu.append(cu[-1] + rng.randint(low, max_len))
    return cu


def global_inputs(seed, total, heads_q, heads_kv, head_dim, dtype, batch=None, head_dim_v=None):
    """q, k, v, dout for the whole sequence: (batch, total, h, d), or (total, h, d) when batch is None."""
    gen = torch.Generator().manual_seed(seed)
    lead = (total,) if batch is None else (batch, total)
    dv = head_dim_v or head_dim
    q = torch.randn(*lead, heads_q, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(*lead, heads_kv, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(*lead, heads_kv, dv, generator=gen, dtype=torch.float64)
    dout = torch.randn(*lead, heads_q, dv, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def cp_module(rank, cp, strategy, causal, plan_u=1, ulysses_degree=None, topology="group", backend="reference",
              deterministic=None, timeout=60.0, window=(-1, -1), softcap=None, **options):
    """(module, cp rank) for ranks 0..cp-1 of the pool (cp = 1: no group), or (None, None) for the others."""
    if rank >= cp:
        return None, None
    kw = dict(strategy=strategy, causal=causal, backend=backend, deterministic=deterministic, timeout=timeout,
              window=window, softcap=softcap, **options)
    if cp == 1:
        return FA4ContextParallelAttention(None, **kw), 0
    if topology == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        module = FA4ContextParallelAttention(mesh=mesh, **kw)
    elif topology == "groups":
        module = FA4ContextParallelAttention(ulysses_group=GROUPS["ulysses"], ring_group=GROUPS["ring"], **kw)
    else:
        module = FA4ContextParallelAttention(GROUPS[cp], ulysses_degree=ulysses_degree, **kw)
    return module, module.cp_rank


@contextlib.contextmanager
def environment(values: dict):
    """The environment variables ``values`` (name -> value; None: left as it is) set for the block, then restored."""
    before = {name: os.environ.get(name) for name, value in values.items() if value is not None}
    os.environ.update({name: str(value) for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def run_case(rank, world, *, ring_steps_per_launch=None, ulysses_chunks=None, ring_max_range_messages=None,
             transport=None, **case):
    """Max abs errors of the local out, dq, dk, dv against the fp64 oracle (None on ranks outside the group):
    :func:`_run_case`'s, with ``ring_steps_per_launch`` (the ring forward's launch groups,
    FA4DIST_RING_STEPS_PER_LAUNCH), ``ulysses_chunks`` (the Ulysses head chunks, FA4DIST_ULYSSES_CHUNKS),
    ``ring_max_range_messages`` (the ring's ranges per step sent as one message pair each, ring.MAX_RANGE_MESSAGES)
    and ``transport`` (FA4DIST_CP_TRANSPORT) set for this call."""
    from fa4dist.context_parallel import ring
    from fa4dist.context_parallel.peer import TRANSPORT_ENV
    from fa4dist.context_parallel.ulysses import CHUNKS_ENV

    default_ranges = ring.MAX_RANGE_MESSAGES
    if ring_max_range_messages is not None:
        ring.MAX_RANGE_MESSAGES = ring_max_range_messages
    try:
        with environment({ring.STEPS_PER_LAUNCH_ENV: ring_steps_per_launch, CHUNKS_ENV: ulysses_chunks,
                          TRANSPORT_ENV: transport}):
            return _run_case(rank, world, **case)
    finally:
        ring.MAX_RANGE_MESSAGES = default_ranges


def _run_case(rank, world, *, cp, strategy="ring", causal=True, seqlen=None, docs=None, heads=(4, 2), head_dim=8,
              head_dim_v=None, batch=1, balancer="lpt", num_chunks=None, plan_u=1, ulysses_degree=None,
              topology="group", seed=0, dtype=torch.float64, device="cpu", backend="reference", window=(-1, -1),
              softcap=None, sinks=False, align=1, lse_loss=None, deterministic=None):
    """:func:`run_case`'s case; its result also holds "digest", a hash of the bytes of this rank's out, dq, dk and
    dv (for byte equality between runs).

    ``lse_loss``: the module returns the lse too (``return_lse=True``) and the loss has a term of it, a random
    gradient: "and" (out's and lse's) or "only" (the lse's alone); also its error ("lse").

    With ``sinks``: also this rank's share of the sinks' gradient ("dsinks", to be summed over the ranks) and the
    oracle's whole gradient ("dsinks_ref")."""
    if topology == "mesh" and cp != world:
        raise ValueError("mesh cases use the whole pool")
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    module, cp_rank = cp_module(rank, cp, strategy, causal, plan_u, ulysses_degree, topology, backend=backend,
                                window=window, softcap=softcap, deterministic=deterministic)
    if module is None:
        return None
    packed = docs is not None
    total = docs[-1] if packed else seqlen
    plan = make_plan(docs if packed else seqlen, cp, balancer, num_chunks, causal=causal, window=window,
                     ulysses_degree=module.cp.plan_ulysses_degree() if plan_u is None else plan_u, align=align)
    q, k, v, dout = global_inputs(seed, total, heads[0], heads[1], head_dim, torch.float64,
                                  None if packed else batch, head_dim_v)
    sink_logits = torch.randn(heads[0], generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    sd = 0 if packed else 1
    leaves = [plan.shard(t, seq_dim=sd, rank=cp_rank).to(device, dtype).requires_grad_() for t in (q, k, v)]
    sinks_leaf = sink_logits.to(device, dtype, copy=True).requires_grad_() if sinks else None
    lse_sd = out_sd = sd
    if lse_loss is None:
        out = module(*leaves, plan=plan, sinks=sinks_leaf)
        out.backward(plan.shard(dout, seq_dim=sd, rank=cp_rank).to(device, dtype))
    else:  # lse (batch, heads, tokens), packed (heads, tokens)
        lse_sd = 1 if packed else 2
        dlse = torch.randn(*(() if packed else (batch,)), heads[0], total, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(seed + 2))
        out, lse = module(*leaves, plan=plan, sinks=sinks_leaf, return_lse=True)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), lse.dtype
        results = [lse] if lse_loss == "only" else [out, lse]
        seeds = [plan.shard(dlse, seq_dim=lse_sd, rank=cp_rank).to(device, lse.dtype)]
        if lse_loss != "only":
            seeds.insert(0, plan.shard(dout, seq_dim=sd, rank=cp_rank).to(device, dtype))
        torch.autograd.backward(results, seeds)
        lse = lse.detach().cpu()
    assert out.device.type == torch.device(device).type
    out, grads = out.cpu(), [leaf.grad.cpu() for leaf in leaves]
    digest = hashlib.sha256(b"".join(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                     for t in [out] + grads)).hexdigest()

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = sink_logits.clone().requires_grad_() if sinks else None
    cu = torch.tensor(docs, dtype=torch.int32) if packed else None
    ref, ref_lse = naive_attention(*ref_leaves, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, window=window,
                                   softcap=softcap, sinks=ref_sinks)
    if lse_loss is None:
        ref.backward(dout)
    else:
        torch.autograd.backward(*(([ref_lse], [dlse]) if lse_loss == "only" else ([ref, ref_lse], [dout, dlse])))
    errors = {}
    compared = [("out", out, ref, out_sd)] + [
        (n, g, r.grad if r.grad is not None else torch.zeros_like(r), sd)
        for n, g, r in zip(("dq", "dk", "dv"), grads, ref_leaves)]
    if lse_loss is not None:
        compared.append(("lse", lse, ref_lse, lse_sd))
    for name, got, want, dim in compared:
        want = plan.shard(want.detach(), seq_dim=dim, rank=cp_rank)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert got.dtype == dtype or name == "lse", (name, got.dtype)
        errors[name] = float((got.detach().double() - want).abs().max()) if want.numel() else 0.0
    errors["digest"] = digest
    errors["strategy"] = module.cp.strategy_name(module.cp.degree(heads[0], heads[1], plan))
    if sinks:
        errors["dsinks"] = sinks_leaf.grad.cpu().double().tolist()
        errors["dsinks_ref"] = ref_sinks.grad.tolist()
    return errors


def case_kwargs(cp: int, case: dict) -> dict:
    """A case table's kwargs for run_case at degree ``cp`` (``chunks_per_rank`` becomes ``num_chunks``)."""
    case = dict(case)
    per = case.pop("chunks_per_rank", None)
    if per is not None:
        case["num_chunks"] = per * cp
    return case


def check_results(results, strategy=None, tol=1e-10) -> list:
    """run_case's results over the pool: every rank in the group within ``tol`` of the oracle (out, dq, dk, dv),
    on the strategy asked for, and the ranks' sink-gradient shares summing to the oracle's whole gradient."""
    seen = [r for r in results if r is not None]
    assert seen
    for r in seen:
        for name in ("out", "dq", "dk", "dv", "lse"):
            assert r.get(name, 0.0) < tol, (name, r)
        if strategy is not None:
            assert r["strategy"] == strategy
    if "dsinks" in seen[0]:  # every rank holds its rows' share: the sum is the whole gradient
        total = torch.tensor([r["dsinks"] for r in seen], dtype=torch.float64).sum(0)
        want = torch.tensor(seen[0]["dsinks_ref"], dtype=torch.float64)
        torch.testing.assert_close(total, want, atol=tol, rtol=tol)
    return seen



def deepcopy_case(rank, world, *, cp, strategy="ring"):
    """A deep copy of the module (as of a model: a frozen reference, EMA weights) shares the process group and
    gives the original's bytes, called before and after it; (bool, bool) on the group's ranks."""
    import copy

    module, cp_rank = cp_module(rank, cp, strategy, True)
    if module is None:
        return None
    twin = copy.deepcopy(module)
    plan = make_plan(40, cp, "lpt")
    q, k, v, _ = global_inputs(3, 40, 4, 2, 8, torch.float64, 1)
    local = [plan.shard(t, seq_dim=1, rank=cp_rank) for t in (q, k, v)]
    outs = [m(*local, plan=plan) for m in (twin, module, twin)]
    from fa4dist.models.invariant_grads import FixedPointGrads  # cp_invariant's gradients hold the group too

    grads = FixedPointGrads(module.cp.group)
    shared = twin.cp.group is module.cp.group and copy.deepcopy(grads).group is grads.group
    return shared, all(torch.equal(o, outs[1]) for o in outs)


def reinit_reused_name_case(rank, world, *, init_file, broken=False):
    """Ranks 0 and 1 call the functional form on their group of two; then the process group is destroyed and made
    anew, with a group of ranks 1 and 2 that gets the old group's name (names start over with each world): its call
    must run (the agreement exchanges' numbers start over too), not wait out the timeout for a number that only
    rank 1 would reach.  ``broken``: ranks 0 and 1 also break the old group first (an exchange whose ranks sent
    different counts), which must not follow its name into the new world.  Max abs error against
    fa4dist.attention on ranks 1 and 2 (None elsewhere)."""
    import torch.distributed as dist

    import fa4dist
    from cp_harness import reinit
    from fa4dist.context_parallel import context_parallel_attention

    q, k, v, _ = global_inputs(3, 40, 4, 2, 8, torch.float64, 1)
    want = fa4dist.attention(q, k, v, causal=True, backend="reference")
    plan = make_plan(40, 2)

    def call(group, cp_rank):
        local = [plan.shard(t, seq_dim=1, rank=cp_rank) for t in (q, k, v)]
        out = context_parallel_attention(*local, plan, group, backend="reference", timeout=5.0)
        return float((out - plan.shard(want, seq_dim=1, rank=cp_rank)).abs().max())

    if rank < 2:
        for _ in range(3):
            assert call(GROUPS[2], rank) == 0.0
        if broken:
            import pytest

            from fa4dist.context_parallel.comm import CommError, GroupBroken, Transport

            transport = Transport(GROUPS[2], timeout=5.0)
            with pytest.raises(CommError, match="out of step"):
                transport.host_gather_ints([0] * (2 + rank), "a broken exchange")
            with pytest.raises(GroupBroken):
                call(GROUPS[2], rank)
    names = [getattr(GROUPS[2], "group_name", None)]
    dist.broadcast_object_list(names, src=0)
    name = names[0]

    def groups():
        for _ in range(int(name) - 1):  # names are a count of the world's groups: the next one gets the old name
            dist.new_group(list(range(world)))
        return dist.new_group([1, 2])

    group = reinit(rank, world, init_file, before_groups=groups)
    if rank not in (1, 2):
        return None
    assert group.group_name == name, (group.group_name, name)
    return call(group, rank - 1)


def destroyed_groups_case(rank, world, *, rounds=3):
    """The functional form on a fresh group of every rank, destroyed after its call, `rounds` times: (the max abs
    error against fa4dist.attention, the number of functional objects held on destroyed groups, open file
    descriptors after each round)."""
    import torch.distributed as dist

    import fa4dist
    from fa4dist.context_parallel import context_parallel_attention, core
    from fa4dist.context_parallel.comm import group_alive

    q, k, v, _ = global_inputs(4, 30, 4, 2, 8, torch.float64, 1)
    plan = make_plan(30, world)
    want = plan.shard(fa4dist.attention(q, k, v, causal=True, backend="reference"), seq_dim=1, rank=rank)
    local = [plan.shard(t, seq_dim=1, rank=rank) for t in (q, k, v)]
    error, fds = 0.0, []
    for _ in range(rounds):
        group = dist.new_group(list(range(world)))
        out = context_parallel_attention(*local, plan, group, backend="reference", timeout=30.0)
        error = max(error, float((out - want).abs().max()))
        dist.destroy_process_group(group)
        del group
        fds.append(len(os.listdir("/proc/self/fd")))
    held = sum(1 for groups, _, _ in core._FUNCTIONAL.values() if not all(
        group_alive(g) for g in (groups[0], groups[2], groups[3]) if g is not None))
    return error, held, fds


def destroyed_module_group_case(rank, world):
    """A module on a fresh group of every rank, called, then called again after the group is destroyed: the error
    of the second call (type name, message) and the seconds it took."""
    import time

    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    module = FA4ContextParallelAttention(group, backend="reference", timeout=30.0)
    plan = module.make_plan(30)
    local = [plan.shard(t, seq_dim=1, rank=module.cp_rank) for t in global_inputs(5, 30, 2, 2, 8, torch.float64, 1)[:3]]
    module(*local, plan=plan)
    dist.destroy_process_group(group)
    start = time.monotonic()
    try:
        module(*local, plan=plan)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), time.monotonic() - start
    return None


def call_errors(*calls):
    """(exception type name, message) of each callable that raises, None for each that does not."""
    errors = []
    for call in calls:
        try:
            call()
            errors.append(None)
        except Exception as err:  # noqa: BLE001
            errors.append((type(err).__name__, str(err)))
    return errors


def pickle_case(rank, world, *, cp):
    """pickle.dumps and torch.save of a module on a process group (alone and inside a model): the error's (type,
    message) for each, on the group's ranks; and that a deep copy still works."""
    import copy
    import io
    import pickle

    module, _ = cp_module(rank, cp, "ring", True)
    if module is None:
        return None
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), module)
    errors = call_errors(lambda: pickle.dumps(module), lambda: torch.save(model, io.BytesIO()))
    twin = copy.deepcopy(model)
    torch.save(model.state_dict(), io.BytesIO())  # what the message says to save
    return errors, twin[1].cp.group is module.cp.group


def concurrent_threads_case(rank, world, *, key):
    """Ranks 0 and 1: rank 0 calls one module from two threads at once (rank 1 calls once, after rank 0's second
    call was refused, or after 8 s without it).  Then both ranks call it serially, and take a forward's gradients on
    another thread than the forward's.  Rank 0: the two threads' (error type, message, seconds); both ranks: the
    serial and the other-thread errors against the oracle."""
    import threading
    import time

    from torch.distributed import distributed_c10d

    if rank >= 2:
        return None
    store = distributed_c10d._get_default_store()
    module, cp_rank = cp_module(rank, 2, "ring", True, timeout=10.0)
    plan = make_plan(40, 2)
    q, k, v, dout = global_inputs(0, 40, 2, 2, 8, torch.float64, batch=1)
    want, _ = naive_attention(q, k, v, causal=True)
    local = [plan.shard(t, seq_dim=1, rank=cp_rank) for t in (q, k, v)]
    threads = None
    if rank == 0:
        results, start, barrier = {}, {}, threading.Barrier(2)

        def call(name):
            barrier.wait()
            start[name] = time.monotonic()
            try:
                module(*local, plan=plan)
                results[name] = None
            except Exception as err:  # noqa: BLE001
                results[name] = (type(err).__name__, str(err), time.monotonic() - start[name])
                store.set(f"{key}/refused", "1")
        workers = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        threads = [results[name] for name in ("a", "b")]
    else:
        try:
            store.wait([f"{key}/refused"], __import__("datetime").timedelta(seconds=8))
        except Exception:  # noqa: BLE001  (without a refusal rank 0's threads time out alike)
            return None, None, None
        module(*local, plan=plan)
    # serially, in step again; and the backward on a thread of its own
    local = [t.requires_grad_() for t in local]
    out = module(*local, plan=plan)
    serial = float((out.detach() - plan.shard(want, seq_dim=1, rank=cp_rank)).abs().max())
    grads = {}
    worker = threading.Thread(target=lambda: grads.update(
        g=torch.autograd.grad(out, local, plan.shard(dout, seq_dim=1, rank=cp_rank))))
    worker.start()
    worker.join()
    glob = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*glob, causal=True)
    want_grads = torch.autograd.grad(ref, glob, dout)
    other_thread = max(float((g - plan.shard(w, seq_dim=1, rank=cp_rank)).abs().max())
                       for g, w in zip(grads["g"], want_grads))
    return threads, serial, other_thread


def intrusion(rank, key, group, holder, intruder, wait: float = 20.0):
    """Ranks 0 and 1 of `group`: rank 0 makes ``holder()`` on one thread (it waits for rank 1, which is held back)
    and, once that call holds the group (or after 1 s), ``intruder()`` on another; then rank 1 makes the holder
    call.  Rank 0: the intruder's (error type, message, seconds) or None, and the holder's (type, message) or None;
    rank 1: its holder call's error or None."""
    import datetime
    import threading
    import time

    from torch.distributed import distributed_c10d

    from fa4dist.context_parallel import comm

    store = distributed_c10d._get_default_store()

    def attempt(fn):
        start = time.monotonic()
        try:
            fn()
            return None
        except Exception as err:  # noqa: BLE001
            return type(err).__name__, str(err), time.monotonic() - start

    if rank == 1:
        store.wait([f"{key}/go"], datetime.timedelta(seconds=wait))
        return attempt(holder)
    held = {}
    worker = threading.Thread(target=lambda: held.update(result=attempt(holder)))
    worker.start()
    deadline = time.monotonic() + 1.0
    while not any(name == group.group_name for _, name in comm._IN_USE) and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = attempt(intruder)
    store.set(f"{key}/go", "1")
    worker.join()
    result = held["result"]
    return refused, None if result is None else result[:2]


def intruding_call(name, group, rank, timeout):
    """A call on `group` named `name` (ranks 0 and 1, the same on both), for :func:`intrusion`."""
    from fa4dist.models import cp_cross_entropy, reduce_value
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    gen = torch.Generator().manual_seed(rank)
    if name == "attention":
        module = FA4ContextParallelAttention(group, strategy="ring", backend="reference", timeout=timeout)
        plan = make_plan(8, 2)
        q, k, v, _ = global_inputs(0, 8, 1, 1, 8, torch.float64, batch=1)
        local = [plan.shard(t, seq_dim=1, rank=rank) for t in (q, k, v)]
        return lambda: module(*local, plan=plan)
    logits, labels = torch.randn(4, 5, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    if name == "cp_cross_entropy":
        return lambda: cp_cross_entropy(logits, labels, group, timeout=timeout)
    if name == "tiled_cp_cross_entropy":
        weight = torch.randn(5, 3, generator=gen)
        return lambda: tiled_cp_cross_entropy(logits[:, :3], weight, labels, group, timeout=timeout)
    if name == "reduce_value":
        return lambda: reduce_value(torch.ones(2), group, timeout=timeout)
    if name == "invariant_grads":  # a backward with one trainable weight, its gradient summed over the group
        from fa4dist.models import FA4Llama, get_config

        torch.manual_seed(0)
        model = FA4Llama(get_config("tiny"), None, backend="reference").requires_grad_(False)
        model.norm.weight.requires_grad_(True)
        model.set_invariant_grads(True, group)
        loss = model(torch.arange(8), torch.arange(8)).float().logsumexp(-1).sum()
        return loss.backward
    raise ValueError(name)


def intruding_thread_case(rank, world, *, key, holder, intruder):
    """:func:`intrusion` of two named calls (:func:`intruding_call`) on a fresh group of ranks 0 and 1; the
    intruder waits 3 s at most for the other rank (which never makes it)."""
    from cp_harness import fresh_group

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    return intrusion(rank, key, group, intruding_call(holder, group, rank, 20.0),
                     intruding_call(intruder, group, rank, 3.0) if rank == 0 else None)


def not_a_group_case(rank, world):
    """Every rank passes what is not a process group where one is taken (a DeviceMesh positionally, a string): the
    (error type, message) of each call."""
    from torch.distributed.device_mesh import init_device_mesh

    from fa4dist.models import FA4Llama, cp_cross_entropy, get_config, reduce_value
    from fa4dist.models.invariant_grads import FixedPointGrads

    mesh = init_device_mesh("cpu", (world,))
    logits, labels = torch.randn(3, 5), torch.zeros(3, dtype=torch.long)
    calls = (lambda: FA4ContextParallelAttention(mesh), lambda: FA4ContextParallelAttention("cp"),
             lambda: FA4ContextParallelAttention(ulysses_group="u", ring_group=GROUPS[world]),
             lambda: FA4Llama(get_config("tiny"), "cp"), lambda: FixedPointGrads(mesh),
             lambda: reduce_value(torch.ones(1), "cp"), lambda: cp_cross_entropy(logits, labels, "cp"))
    return call_errors(*calls)


def lse_on_some_ranks_case(rank, world, *, cp, strategy, lse_ranks, out_ranks):
    """``return_lse=True`` where only ``lse_ranks``' losses use the lse and only ``out_ranks``' use out (the others'
    gradients of that output are None): max abs errors of the gradients against the fp64 oracle with those rows'
    gradients zero (the backward runs on every rank when any rank's loss used an output), and how many ring
    backward passes ran (the lse's gradient joins out's: one)."""
    from unittest import mock

    from fa4dist.context_parallel import core

    module, cp_rank = cp_module(rank, cp, strategy, True, ulysses_degree=2 if strategy == "hybrid" else None)
    if module is None:
        return None
    total, heads = 45, (4, 2)
    plan = module.make_plan(total, heads=heads)
    q, k, v, dout = global_inputs(3, total, *heads, 8, torch.float64, 1)
    dlse = torch.randn(1, heads[0], total, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    leaves = [plan.shard(t, seq_dim=1, rank=cp_rank).requires_grad_() for t in (q, k, v)]
    out, lse = module(*leaves, plan=plan, return_lse=True)
    terms = []
    if cp_rank in out_ranks:
        terms.append((out * plan.shard(dout, seq_dim=1, rank=cp_rank)).sum())
    if cp_rank in lse_ranks:
        terms.append((lse * plan.shard(dlse, seq_dim=2, rank=cp_rank)).sum())
    with mock.patch.object(core, "ring_backward", wraps=core.ring_backward) as ring_backward:
        sum(terms).backward()
    # the oracle's loss: each output's gradient on the rows of the ranks that used it, zero elsewhere
    keep_out, keep_lse = torch.zeros(total, dtype=torch.bool), torch.zeros(total, dtype=torch.bool)
    for r in range(cp):
        rows = plan.shard(torch.arange(total), seq_dim=0, rank=r)
        keep_out[rows] |= r in out_ranks
        keep_lse[rows] |= r in lse_ranks
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_attention(*ref_leaves, causal=True)
    ((ref * dout * keep_out[None, :, None, None]).sum() + (ref_lse * dlse * keep_lse).sum()).backward()
    errors = {name: float((leaf.grad - plan.shard(r.grad, seq_dim=1, rank=cp_rank)).abs().max())
              for name, leaf, r in zip(("dq", "dk", "dv"), leaves, ref_leaves)}
    return errors, ring_backward.call_count


def return_lse_disagreement_case(rank, world):
    """Rank 1 alone asks for the lse: (type name, message) of the error on every rank."""
    module, cp_rank = cp_module(rank, world, "ring", True)
    plan = module.make_plan(30)
    local = [plan.shard(t, seq_dim=1, rank=cp_rank) for t in global_inputs(5, 30, 2, 2, 8, torch.float64, 1)[:3]]
    return call_errors(lambda: module(*local, plan=plan, return_lse=rank == 1))[0]


def ulysses_chunks_case(rank, world, *, cp, strategy, chunks, ulysses_degree=None, packed=False, lse_loss=True):
    """With ``chunks`` Ulysses head chunks (FA4DIST_ULYSSES_CHUNKS) against one: the largest difference of out,
    the lse (with ``lse_loss``, and a loss of it) and the gradients of q, k, v and the sinks relative to the
    largest value (every head is computed alone in either: the backend's rounding may differ with the heads a call
    takes), and how many exchanges to heads each run posted (forward and backward)."""
    from unittest import mock

    from fa4dist.context_parallel.ulysses import CHUNKS_ENV, UlyssesGroup

    module, cp_rank = cp_module(rank, cp, strategy, True, ulysses_degree=ulysses_degree, window=(20, -1),
                                softcap=5.0)
    if module is None:
        return None
    heads, total = (8, 4), 90
    docs = [0, 17, 18, 60, 90] if packed else None
    plan = module.make_plan(torch.tensor(docs) if packed else total, heads=heads)
    q, k, v, dout = global_inputs(11, total, *heads, 8, torch.float64, None if packed else 2)
    sd = 0 if packed else 1
    dlse = torch.randn(*(() if packed else (2,)), heads[0], total, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(12))
    sink_logits = torch.randn(heads[0], generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    runs = []
    for n in (1, chunks):
        leaves = [plan.shard(t, seq_dim=sd, rank=cp_rank).requires_grad_() for t in (q, k, v)]
        sinks = sink_logits.clone().requires_grad_()
        with environment({CHUNKS_ENV: n}), mock.patch.object(
                UlyssesGroup, "post_seq_to_head", autospec=True, side_effect=UlyssesGroup.post_seq_to_head) as posts:
            if lse_loss:
                out, lse = module(*leaves, plan=plan, sinks=sinks, return_lse=True)
                torch.autograd.backward([out, lse], [plan.shard(dout, seq_dim=sd, rank=cp_rank),
                                                     plan.shard(dlse, seq_dim=1 if packed else 2, rank=cp_rank)])
                results = [out, lse]
            else:
                out = module(*leaves, plan=plan, sinks=sinks)
                out.backward(plan.shard(dout, seq_dim=sd, rank=cp_rank))
                results = [out]
        runs.append(([t.detach() for t in results] + [t.grad for t in leaves] + [sinks.grad], posts.call_count))
    differences = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(runs[1][0], runs[0][0])]
    return differences, runs[0][1], runs[1][1]


def lse_loss_on_test_backend_case(rank, world, *, backend, lse_loss="and", **case):
    """run_case with a loss of the lse (``lse_loss``: "and" out's, or "only") and ``case`` on a backend of
    :mod:`worklist_backends`, registered in this worker for the call: its errors, for ``Sharing`` how many item calls
    the shared query sides took with the lse's gradient (the ring makes one per backward with it), and for
    ``TwoPass`` how many backward passes it ran."""
    from fa4dist.kernels import registry

    import worklist_backends

    impl = getattr(worklist_backends, backend)()
    saved = dict(registry._BACKENDS)
    registry.register_backend(impl)
    try:
        errors = run_case(rank, world, backend=impl.name, lse_loss=lse_loss, **case)
    finally:
        registry._BACKENDS.clear()
        registry._BACKENDS.update(saved)
    made = getattr(impl, "made", ())
    return errors, sum(side.taken for side in made if side.dlse is not None), getattr(impl, "calls", None)
