"""Schedule.items' coalesced work lists (worklist.coalesce, a causal item joined with the fully visible keys before
it) over random plans: dense and packed documents, every balancer, cp 2-8, Ulysses groups, windows. Each
(member, source) list, each own_halves pair and each launch group's list holds exactly the visible (query row, key
row) pairs of the uncoalesced lists, once each (the mask written out by hand here), and computes their attention
and gradients (fp64, reference backend; fresh forward rows and fresh dK / dV as the ring runs them)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

import fa4dist.context_parallel.schedule as schedule_module
from fa4dist.context_parallel import Schedule, make_plan
from fa4dist.kernels import attention_backward_items, attention_forward_items
from oracle import visible_item_pairs

F64 = torch.float64


def _random_plan(rng):
    cp = rng.randint(2, 8)
    u = rng.choice([d for d in (1, 2, 4) if cp % d == 0])
    balancer = rng.choice(["lpt", "zigzag", "contiguous"])
    causal = rng.random() < 0.85
    window = (-1, -1)
    if rng.random() < 0.25:
        window = (rng.randint(0, 40), -1 if causal else rng.randint(0, 40))
    if rng.random() < 0.5:
        lens = [rng.randint(1, 60) for _ in range(rng.randint(1, 5))]
        seq = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    else:
        seq = rng.randint(2 * cp, 160)
    return make_plan(seq, cp, balancer, causal=causal, window=window, ulysses_degree=u), u


def _schedules(monkeypatch, plan, u):
    """(the plan's schedule, one whose lists are not coalesced)."""
    with monkeypatch.context() as m:
        m.setattr(schedule_module, "coalesce", tuple)
        raw = Schedule(plan, u, plan.mask)
        lists = {(a, b): raw.items(a, b) for a in range(raw.ring_size) for b in range(raw.ring_size)}
    return Schedule(plan, u, plan.mask), lists


@pytest.mark.parametrize("seed", range(6))
def test_coalesced_lists_hold_the_visible_pairs_of_the_blocks(monkeypatch, seed):
    rng = random.Random(seed)
    joined = 0
    for _ in range(12):
        plan, u = _random_plan(rng)
        sched, raw = _schedules(monkeypatch, plan, u)
        for (m, s), items in raw.items():
            got = sched.items(m, s)
            want = visible_item_pairs(items)
            assert visible_item_pairs(got) == want and max(want.values(), default=1) == 1, (plan, m, s)
            joined += len(got) < len(items)
            if m == s:
                first, last = sched.own_halves(m)
                assert visible_item_pairs(first) + visible_item_pairs(last) == want
        for per_launch in (0, 2):
            for m in range(sched.ring_size):
                for group in sched.launch_groups(per_launch):
                    places, items = sched.group_items(m, group)
                    want = Counter()
                    for t, at, n in places:
                        for (qr, kr), c in visible_item_pairs(raw[(m, sched.source(m, t))]).items():
                            want[(qr, kr + at)] += c
                    assert visible_item_pairs(items) == want, (plan, m, group)
    assert joined


@pytest.mark.parametrize("seed", range(4))
def test_coalesced_own_lists_compute_the_blocks(monkeypatch, seed):
    """A member's own-step list as the ring runs it (fresh forward; backward in own_halves, the first writing dK /
    dV): the uncoalesced list's (out, lse) and gradients."""
    rng = random.Random(100 + seed)
    for trial in range(6):
        plan, u = _random_plan(rng)
        sched, raw = _schedules(monkeypatch, plan, u)
        for m in range(sched.ring_size):
            n = sched.members[m].length
            gen = torch.Generator().manual_seed(1000 * seed + 10 * trial + m)
            q, k, v, dout = (torch.randn(n, 2, 8, dtype=F64, generator=gen) for _ in range(4))
            forwards = []
            for items in (raw[(m, m)], sched.items(m, m)):
                out = torch.zeros(n, 2, 8, dtype=F64)
                lse = torch.full((2, n), float("-inf"), dtype=F64)
                attention_forward_items(q, k, v, list(items), out, lse, fresh=True, backend="reference")
                forwards.append((out, lse))
            torch.testing.assert_close(forwards[1][0], forwards[0][0], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(forwards[1][1], forwards[0][1], rtol=1e-10, atol=1e-12)
            grads = []
            for lists in ((raw[(m, m)],), sched.own_halves(m)):
                dq = torch.zeros_like(q)
                dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
                for i, items in enumerate(lists):
                    attention_backward_items(dout, q, k, v, *forwards[0], list(items), dq, dk, dv,
                                             backend="reference", fresh_dkv=i == 0)
                grads.append((dq, dk, dv))
            for got, want in zip(grads[1], grads[0]):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
