"""The ring's buffers (context_parallel/ring.py): a member's running (out, lse) and its dK / dV start unfilled
where the first step's fresh calls write them, with the bytes of the filled start."""

import pytest
import torch

from fa4dist.context_parallel import Schedule, make_plan
from fa4dist.context_parallel.ring import Accumulators, HeldKV, KernelOptions, KVBuffer, backward_step, forward_step
from fa4dist.kernels import WorkItem


@pytest.mark.parametrize("packed", [False, True])
def test_rows_the_first_items_miss_start_as_the_empty_result(packed):
    plan = make_plan(torch.tensor([0, 30, 64]) if packed else 64, 2, "contiguous", causal=True)
    layout = Schedule(plan, 1, plan.mask).members[0]
    q = torch.zeros((32, 2, 8) if packed else (1, 32, 2, 8))
    acc = Accumulators.empty(layout, q, 8, packed, [WorkItem(3, 5, 0, 4), WorkItem(6, 10, 0, 4), WorkItem(20, 0, 0, 4)])
    missed = torch.ones(32, dtype=torch.bool)
    missed[3:16] = False
    out_rows = acc.out.movedim(0 if packed else 1, 0)
    assert torch.equal(out_rows[missed], torch.zeros_like(out_rows[missed]))
    assert bool((acc.lse[..., missed] == float("-inf")).all()) and acc.fresh


@pytest.mark.parametrize("packed", [False, True])
def test_a_members_first_step_writes_its_rows_unfilled(packed):
    """Accumulators.empty leaves the rows the member's first step covers unfilled (its fresh call writes them) and
    sets the others to (0, -inf); over garbage in those rows the step gives the bytes of the fully filled start,
    and the ring's dK / dV written fresh equal the zero-filled run's (reference backend)."""
    docs = torch.tensor([0, 37, 40, 130, 131, 200])
    plan = make_plan(docs if packed else 200, 3, "lpt", causal=True)
    sched = Schedule(plan, 1, plan.mask)
    opts = KernelOptions(softmax_scale=None, softcap=None, backend="reference", deterministic=False)
    gen = torch.Generator().manual_seed(3)
    for m in range(3):
        n = sched.members[m].length
        shape = (n, 2, 8) if packed else (1, n, 2, 8)
        q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))
        first = sched.items(m, m)
        acc = Accumulators.empty(sched.members[m], q, 8, packed, first)
        covered = torch.zeros(n, dtype=torch.bool)
        for it in first:
            covered[it.q_start:it.q_start + it.q_len] = True
        tok = 0 if packed else 1
        out_rows = acc.out.movedim(tok, 0)
        out_rows[covered] = float("nan")  # whatever torch.empty gave
        acc.lse[..., covered] = float("nan")
        filled = Accumulators.empty(sched.members[m], q, 8, packed)
        for a in (acc, filled):
            forward_step(sched, m, m, q, HeldKV(k, v), a, opts)
        assert torch.equal(acc.out, filled.out) and torch.equal(acc.lse, filled.lse)
        # the backward's own step over garbage dK / dV with fresh_dkv against zeros
        out, lse = filled.out.to(q.dtype), filled.lse
        grads = []
        for fresh in (True, False):
            fill = torch.full if fresh else (lambda s, _: torch.zeros(s))
            dkv = HeldKV(fill(k.shape, float("nan")), fill(v.shape, float("nan")))
            dq = torch.zeros(q.shape)
            backward_step(sched, m, m, dout, q, HeldKV(k, v), out, lse, dq, dkv, opts, first, fresh_dkv=fresh)
            grads.append((dq, dkv.k, dkv.v))
        for a, b in zip(*grads):
            assert torch.equal(a, b)
        empty = KVBuffer.empty_like(KVBuffer.empty(k, v, 5, tok))  # a received step without items: zeros
        empty.flat.fill_(float("nan"))
        backward_step(sched, m, m, dout, q, HeldKV(k, v), out, lse, torch.zeros(q.shape), empty, opts, (),
                      fresh_dkv=True)
        assert not empty.flat.any()
