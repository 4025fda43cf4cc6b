"""cp_invariant=True: out, dq, dk and dv are the same bytes at every cp size (1 to 4), strategy (ring, Ulysses,
hybrid) and balancer, for one sequence and packed documents, fp32 and bf16, with GQA (replicated key/value heads
under Ulysses included), and equal to single-device ``fa4dist.attention(..., cp_invariant=True)``; with sinks, so
is the sum of the ranks' sink gradients."""

import pytest
import torch

import cp_cases
from cp_harness import shared_pool
from fa4dist.context_parallel.ulysses import CHUNKS_ENV

pytestmark = pytest.mark.timeout(300)

DOCS = [0, 37, 38, 90, 161, 200]


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def invariant_case(rank, world, layouts, dtype, packed, heads, device="cpu", backend="reference", head_dim=16,
                   docs=DOCS, total=200, window=(-1, -1), softcap=None, chunks_per_rank=None, head_dim_outer=False,
                   sinks=False, lse_loss=False, ulysses_chunks=None):
    """For each (cp, strategy, balancer, ulysses degree): whether the global out/dq/dk/dv bytes equal the single
    device's (every rank computes the single-device result itself).  ``head_dim_outer``: the local shards are
    views whose head_dim is not the innermost axis (the reference's inputs stay contiguous: same values).
    ``sinks``: learnable sinks too, and (a fifth entry) whether the sum of the ranks' sink gradients has the single
    device's bytes.  ``lse_loss``: the lse returned too (``return_lse=True``, its bytes compared after out's) and
    a loss of out and lse.  ``ulysses_chunks``: the Ulysses head chunks asked for (FA4DIST_ULYSSES_CHUNKS)."""
    import fa4dist
    from fa4dist.context_parallel import make_plan

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    total = docs[-1] if packed else total
    q, k, v, dout = (t.to(device) for t in cp_cases.global_inputs(7, total, heads[0], heads[1], head_dim, dtype,
                                                                   None if packed else 2))
    sd = 0 if packed else 1
    cu = torch.tensor(docs, dtype=torch.int32, device=device) if packed else None
    sink_logits = torch.randn(heads[0], generator=torch.Generator().manual_seed(3)).to(device) if sinks else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    extra = [sink_logits.clone().requires_grad_()] if sinks else []
    ref = fa4dist.attention(*leaves, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend,
                            cp_invariant=True, window=window, softcap=softcap, sinks=extra[0] if sinks else None,
                            return_lse=lse_loss)
    lse_sd = (1 if packed else 2) if lse_loss else None
    if lse_loss:
        ref, ref_lse = ref
        dlse = torch.randn(ref_lse.shape, generator=torch.Generator().manual_seed(5)).to(device)
        torch.autograd.backward([ref, ref_lse], [dout, dlse])
    else:
        ref.backward(dout)
    want = [ref] + ([ref_lse] if lse_loss else []) + [t.grad for t in leaves + extra]
    results = []
    for cp, strategy, balancer, u in layouts:
        module, _ = cp_cases.cp_module(rank, cp, strategy, True, ulysses_degree=u, backend=backend,
                                       cp_invariant=True, window=window, softcap=softcap)
        if module is not None:
            num_chunks = cp * chunks_per_rank if chunks_per_rank else None
            plan = make_plan(docs if packed else total, cp, balancer, num_chunks, causal=True, ulysses_degree=u or 1)
            local = [module.shard(t, plan) for t in (q, k, v)]
            if head_dim_outer:
                local = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in local]
            local = [t.requires_grad_() for t in local]
            mine_sinks = sink_logits.clone().requires_grad_() if sinks else None
            with cp_cases.environment({CHUNKS_ENV: ulysses_chunks}):
                if lse_loss:
                    out, lse = module(*local, plan=plan, sinks=mine_sinks, return_lse=True)
                    torch.autograd.backward([out, lse], [module.shard(dout, plan), module.shard(dlse, plan, lse_sd)])
                else:
                    out, lse = module(*local, plan=plan, sinks=mine_sinks), None
                    out.backward(module.shard(dout, plan))
            mine = [(out, sd)] + ([(lse, lse_sd)] if lse_loss else []) + [(t.grad, sd) for t in local]
            got = [plan.unshard(_gather(t, cp, dim), seq_dim=dim) for t, dim in mine]
            if sinks:  # each rank's share, summed over the group (as a gradient reduction would)
                got.append(sum(_gather(mine_sinks.grad[None], cp, 0))[0])
            want = [w.detach().cpu() for w in want]
            same = [torch.equal(_bytes(g), _bytes(w)) for g, w in zip(got, want)]
            results.append((cp, strategy, balancer, u, same))
        _sync_world()
    return results


def _gather(t, cp, sd):
    """Every cp rank's local tensor (lengths differ), through the pool's group of the first cp ranks."""
    import torch.distributed as dist

    from cp_harness import GROUPS

    group = GROUPS[cp] if cp > 1 else None
    if group is None:
        return [t.detach().cpu()]
    t = t.detach().cpu()  # gloo
    n = torch.tensor([t.shape[sd]])
    sizes = [torch.zeros_like(n) for _ in range(cp)]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(sizes))
    pad = list(t.shape)
    pad[sd] = longest - t.shape[sd]
    padded = torch.cat([t, t.new_zeros(pad)], dim=sd)
    parts = [torch.empty_like(padded) for _ in range(cp)]
    dist.all_gather(parts, padded, group=group)
    return [p.narrow(sd, 0, int(s)) for p, s in zip(parts, sizes)]


def _sync_world():
    import torch.distributed as dist

    dist.barrier()


LAYOUTS = [(1, "ring", "lpt", None), (2, "ring", "lpt", None), (3, "ring", "zigzag", None),
           (4, "ring", "contiguous", None), (2, "ulysses", "lpt", None), (4, "ulysses", "lpt", None),
           (4, "hybrid", "lpt", 2), (3, "ring", "lpt", None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_bitwise_identical_across_layouts(pool, dtype, packed, heads):
    results = pool.run(invariant_case, layouts=LAYOUTS, dtype=dtype, packed=packed, heads=heads)
    checked = 0
    for per_rank in results:
        for cp, strategy, balancer, u, same in per_rank:
            assert all(same), f"cp={cp} {strategy} {balancer} u={u}: out/dq/dk/dv bytes equal: {same}"
            checked += 1
    assert checked >= sum(cp for cp, *_ in LAYOUTS)


def test_bitwise_identical_with_a_window_and_softcap(pool):
    layouts = [(1, "ring", "lpt", None), (3, "ring", "lpt", None), (4, "hybrid", "lpt", 2)]
    results = pool.run(invariant_case, layouts=layouts, dtype=torch.float32, packed=True, heads=(4, 2),
                       window=(20, -1), softcap=3.0)
    for per_rank in results:
        for cp, strategy, balancer, u, same in per_rank:
            assert all(same), f"cp={cp} {strategy} {balancer} u={u}: out/dq/dk/dv bytes equal: {same}"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_bitwise_identical_over_many_key_tiles(pool, packed):
    """Sequences of several canonical key tiles (fixed_point.KEY_TILE = 128) cut into chunks that start and end
    inside tiles: the dq of a tile split over members comes from one member, the others' keys there get dk/dv
    from a dk/dv-only call, and the int64 dq is summed over the members."""
    layouts = [(1, "ring", "lpt", None), (2, "ring", "zigzag", None), (3, "ring", "lpt", None),
               (4, "ring", "contiguous", None), (4, "hybrid", "lpt", 2)]
    docs = [0, 300, 301, 690]
    results = pool.run(invariant_case, layouts=layouts, dtype=torch.float32, packed=packed, heads=(4, 2),
                       head_dim=8, docs=docs, total=690)
    for per_rank in results:
        for cp, strategy, balancer, u, same in per_rank:
            assert all(same), f"cp={cp} {strategy} {balancer} u={u}: out/dq/dk/dv bytes equal: {same}"


def test_bitwise_identical_with_chunks_smaller_than_a_key_tile(pool):
    """Chunks of ~20-40 tokens: a 128-key tile spans several members' keys (its dq comes from the member holding
    its first key, reading the others' keys as halo), with a window and soft-capping, packed and dense."""
    layouts = [(1, "ring", "lpt", None), (3, "ring", "lpt", None), (4, "ring", "zigzag", None),
               (4, "hybrid", "lpt", 2)]
    for packed in (True, False):
        results = pool.run(invariant_case, layouts=layouts, dtype=torch.float32, packed=packed, heads=(4, 2),
                           head_dim=8, docs=[0, 300, 301, 690], total=500, window=(150, -1), softcap=4.0,
                           chunks_per_rank=6)
        for per_rank in results:
            for cp, strategy, balancer, u, same in per_rank:
                assert all(same), f"packed={packed} cp={cp} {strategy} {balancer} u={u}: bytes equal: {same}"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_bitwise_identical_with_head_dim_outer_views(pool, packed):
    """Local shards whose head_dim is not their innermost axis (transposed views) give the contiguous single
    device's bytes at every cp size and strategy (they gave other scores in the reference's invariant arithmetic,
    which Ulysses' copies hid and the ring did not)."""
    layouts = [(1, "ring", "lpt", None), (3, "ring", "lpt", None), (4, "ulysses", "lpt", None),
               (4, "hybrid", "lpt", 2)]
    results = pool.run(invariant_case, layouts=layouts, dtype=torch.float32, packed=packed, heads=(4, 2),
                       head_dim=32, total=90, head_dim_outer=True)
    for per_rank in results:
        for cp, strategy, balancer, u, same in per_rank:
            assert all(same), f"cp={cp} {strategy} {balancer} u={u}: out/dq/dk/dv bytes equal: {same}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_identical_with_sinks(pool, dtype):
    """Learnable sinks: out, dq, dk, dv and the summed sink gradient have the single device's bytes at every cp
    size and strategy (the sinks join each row once; their gradient is one exact sum over every row, held by one
    rank per head), with a window and soft-capping, dense and packed."""
    layouts = [(1, "ring", "lpt", None), (2, "ring", "lpt", None), (3, "ring", "zigzag", None),
               (4, "ulysses", "lpt", None), (4, "hybrid", "lpt", 2)]
    for packed in (True, False):
        results = pool.run(invariant_case, layouts=layouts, dtype=dtype, packed=packed, heads=(4, 2), head_dim=8,
                           window=(30, -1), softcap=5.0, sinks=True)
        for per_rank in results:
            for cp, strategy, balancer, u, same in per_rank:
                assert len(same) == 5 and all(same), \
                    f"packed={packed} cp={cp} {strategy} {balancer} u={u}: out/dq/dk/dv/dsinks bytes equal: {same}"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_bitwise_identical_with_a_loss_of_the_lse(pool, packed):
    """``return_lse=True`` and a loss of out and lse (its gradient a second invariant pass with v = 0): out, lse,
    dq, dk, dv and the summed sink gradient have the single device's bytes at every cp size and strategy, fp32 and
    bf16, with GQA, a window and soft-capping."""
    layouts = [(1, "ring", "lpt", None), (2, "ring", "lpt", None), (3, "ring", "zigzag", None),
               (4, "ulysses", "lpt", None), (4, "hybrid", "lpt", 2)]
    for dtype in (torch.float32, torch.bfloat16):
        results = pool.run(invariant_case, layouts=layouts, dtype=dtype, packed=packed, heads=(4, 2), head_dim=8,
                           window=(30, -1), softcap=5.0, sinks=True, lse_loss=True)
        for per_rank in results:
            for cp, strategy, balancer, u, same in per_rank:
                assert len(same) == 6 and all(same), \
                    f"{dtype} cp={cp} {strategy} {balancer} u={u}: out/lse/dq/dk/dv/dsinks bytes equal: {same}"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_bitwise_identical_with_ulysses_head_chunks(pool, packed):
    """FA4DIST_ULYSSES_CHUNKS=2 (each member's two key/value heads exchanged and computed one after the other):
    out, lse, dq, dk, dv and the summed sink gradient still have the single device's bytes, with sinks, a window,
    softcap and a loss of out and lse, in fp32 and bf16."""
    layouts = [(1, "ring", "lpt", None), (2, "ulysses", "lpt", None), (4, "hybrid", "lpt", 2)]
    for dtype in (torch.float32, torch.bfloat16):
        results = pool.run(invariant_case, layouts=layouts, dtype=dtype, packed=packed, heads=(8, 4), head_dim=8,
                           window=(30, -1), softcap=5.0, sinks=True, lse_loss=True, ulysses_chunks=2)
        for per_rank in results:
            for cp, strategy, balancer, u, same in per_rank:
                assert len(same) == 6 and all(same), \
                    f"{dtype} cp={cp} {strategy} {balancer} u={u}: out/lse/dq/dk/dv/dsinks bytes equal: {same}"
