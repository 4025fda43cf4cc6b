"""The ring's buffers (context_parallel/ring.py): a member's running (out, lse) and its dK / dV start unfilled
where the first step's fresh calls write them, with the bytes of the filled start; a member's backward in the
ring's order."""

import pytest
import torch

from fa4dist.context_parallel import Schedule, make_plan
from fa4dist.context_parallel.ring import (Accumulators, HeldKV, KernelOptions, KVBuffer, backward_step,
                                          forward_items)
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
            forward_items(q, HeldKV(k, v), first, a, opts)
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


def _members(packed: bool, cp: int, tensors: int, seed: int):
    """A causal LPT schedule of five documents (or 200 dense tokens) over `cp` members, the reference backend's
    options, the token dim, `tensors` random fp64 tensors per member (its rows, 2 heads of 8) and the generator."""
    plan = make_plan(torch.tensor([0, 37, 40, 130, 131, 200]) if packed else 200, cp, "lpt", causal=True)
    sched = Schedule(plan, 1, plan.mask)
    opts = KernelOptions(softmax_scale=None, softcap=None, backend="reference", deterministic=False)
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda n: (n, 2, 8)) if packed else (lambda n: (1, n, 2, 8))
    shards = [[torch.randn(shape(sched.members[m].length), dtype=torch.float64, generator=gen)
               for _ in range(tensors)] for m in range(cp)]
    return sched, opts, 0 if packed else 1, shards, gen


@pytest.mark.parametrize("packed", [False, True])
def test_member_backward_written_fresh_equals_zero_filled(packed):
    """MemberBackward (the ring's backward order: own half, remote steps, own half): its dK / dV and partials
    written by their first step equal the same steps' adds into zero-filled buffers byte for byte, and the own halves
    together equal one call on all the own keys (fp64, reference backend)."""
    from fa4dist.context_parallel.ring import IncomingKeys, MemberBackward
    from fa4dist.kernels.worklist import share_queries

    sched, opts, tok, shards, gen = _members(packed, 3, 5, seed=11)
    for m in range(3):
        dout, q, k, v, out = shards[m]
        n = sched.members[m].length
        lse = 3 + torch.randn((2, n) if packed else (1, 2, n), dtype=torch.float64, generator=gen)  # (heads, rows)
        received = {t: KVBuffer.gather(shards[sched.source(m, t)][2], shards[sched.source(m, t)][3],
                                       sched.needed(m, sched.source(m, t)), tok) for t in sched.member_steps(m)}
        member = MemberBackward(sched, m, dout, q, k, v, out, lse, opts, remote=True)
        member.own_start()
        partials = [member.remote(IncomingKeys(None, received[t], sched.items(m, sched.source(m, t)))).flat
                    for t in sched.member_steps(m)]
        member.own_end()
        written = [*member.finish(), *partials]
        # the same steps, every buffer zero-filled first and added into (fresh_dkv off)
        shared = share_queries(dout, q, out, lse, deterministic=False, backend="reference")
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
        first, last = sched.own_halves(m)
        backward_step(sched, m, m, dout, q, HeldKV(k, v), out, lse, dq, HeldKV(dk, dv), opts, first, shared)
        added = []
        for t in sched.member_steps(m):
            partial = KVBuffer(torch.zeros(received[t].flat.shape, dtype=torch.float64), received[t].k_shape,
                               received[t].v_shape)
            backward_step(sched, m, None, dout, q, received[t], out, lse, dq, partial, opts,
                          sched.items(m, sched.source(m, t)), shared)
            added.append(partial.flat)
        backward_step(sched, m, m, dout, q, HeldKV(k, v), out, lse, dq, HeldKV(dk, dv), opts, last, shared)
        if shared is not None:
            shared.finish(dq)
        assert len(written) == 3 + len(added)
        for a, b in zip(written, [dq, dk, dv, *added]):
            assert torch.equal(a, b)
        whole = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
        backward_step(sched, m, m, dout, q, HeldKV(k, v), out, lse, whole[0], HeldKV(whole[1], whole[2]), opts)
        own_only = MemberBackward(sched, m, dout, q, k, v, out, lse, opts, remote=True)
        own_only.own_start()
        own_only.own_end()
        for a, b in zip(own_only.finish(), whole):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("per_launch", [2, 0])
def test_member_backward_in_launch_groups_equals_one_launch_per_step(packed, per_launch):
    """member_backward_steps over launch groups (one buffer and one call per group, Schedule.group_items): dq, dk,
    dv and every step's returned rows (the group partial's rows, K and V contiguous) equal the one-launch-per-step
    order's (fp64, reference backend), and every step of every group is handed back once, in step order."""
    from fa4dist.context_parallel.ring import IncomingKeys, MemberBackward, member_backward_steps

    cp = 4
    sched, opts, tok, shards, gen = _members(packed, cp, 5, seed=12)
    for m in range(cp):
        dout, q, k, v, out = shards[m]
        n = sched.members[m].length
        lse = 3 + torch.randn((2, n) if packed else (1, 2, n), dtype=torch.float64, generator=gen)
        received = {t: KVBuffer.gather(shards[sched.source(m, t)][2], shards[sched.source(m, t)][3],
                                       sched.needed(m, sched.source(m, t)), tok)
                    for t in sched.steps() if sched.recv_len(m, t)}
        results = []
        for size in (1, per_launch):
            incoming = []
            for group in sched.launch_groups(size):
                places, items = sched.group_items(m, group)
                if len(group) == 1:  # as the ring posts a single step
                    t = group[0]
                    items = sched.items(m, sched.source(m, t)) if t in received else ()
                total = sum(n for _, _, n in places)
                buf = KVBuffer.empty(k, v, total, tok) if total else None
                for t, at, n in places:
                    if n:
                        buf.rows(at, n, tok).k.copy_(received[t].k)
                        buf.rows(at, n, tok).v.copy_(received[t].v)
                incoming.append(IncomingKeys(None, buf, items, places))
            handed = []

            def give_back(t, rows, handed=handed):
                if rows is not None:
                    assert rows.k.is_contiguous() and rows.v.is_contiguous()
                    handed.append((t, rows.k.clone(), rows.v.clone()))
                else:
                    handed.append((t, None, None))
                return None

            member = MemberBackward(sched, m, dout, q, k, v, out, lse, opts, remote=True)
            grads = member_backward_steps(member, sched.launch_groups(size), lambda i, g: incoming[i], give_back)
            assert [t for t, _, _ in handed] == list(sched.steps())
            results.append((grads, handed))
        (per_step, handed_1), (grouped, handed_g) = results
        for a, b in zip(per_step, grouped):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for (t, k1, v1), (_, kg, vg) in zip(handed_1, handed_g):
            assert (k1 is None) == (kg is None) == (t not in received)
            if k1 is not None:
                torch.testing.assert_close(k1, kg, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(v1, vg, rtol=1e-12, atol=1e-12)


def test_ring_sends_are_views_of_the_keys_one_message_pair_per_range():
    """The ring sends a member's K / V rows as one message pair per row range, views of its own tensors (no pack
    copy; a strided caller's range copied alone), where rows are contiguous per range (one sequence, packed
    documents); a dense batch of two packs its ranges into one pair, once per call and ranges.  The receiver's
    places match the sender's messages one for one."""
    from fa4dist.context_parallel.ring import RingPeers, _Exchange

    plan = make_plan(64, 2, "contiguous", causal=True)
    sched = Schedule(plan, 1, plan.mask)
    ranges = ((0, 4), (10, 6))
    for batch in (1, 2):
        k, v = torch.randn(batch, 32, 2, 8), torch.randn(batch, 32, 2, 8)
        exchange = _Exchange(sched, RingPeers(None, [0, 1], 0), k, v, "forward")
        parts = exchange._send_parts(ranges)
        held = KVBuffer.empty(k, v, 10, 1)
        places = exchange._recv_parts(held, 0, ranges)
        assert [tuple(p.shape) for pair in parts for p in pair] == [tuple(p.shape) for pair in places for p in pair]
        for (kp, vp), (kh, vh) in zip(parts, places):  # what the transport does with each message
            kh.copy_(kp)
            vh.copy_(vp)
        assert torch.equal(held.k, torch.cat([k[:, 0:4], k[:, 10:16]], 1))
        assert torch.equal(held.v, torch.cat([v[:, 0:4], v[:, 10:16]], 1))
        if batch == 1:
            assert len(parts) == 2 and parts[1][0].data_ptr() == k[:, 10:].data_ptr()  # views: the same memory
        else:
            assert len(parts) == 1 and exchange._send_parts(ranges)[0][0].data_ptr() == parts[0][0].data_ptr()
    many = tuple((3 * i, 2) for i in range(10))  # more ranges than MAX_RANGE_MESSAGES: packed into one pair
    k1, v1 = k[:1].contiguous(), v[:1].contiguous()
    exchange = _Exchange(sched, RingPeers(None, [0, 1], 0), k1, v1, "forward")
    assert len(exchange._send_parts(many)) == len(exchange._recv_parts(KVBuffer.empty(k1, v1, 20, 1), 0, many)) == 1
    strided = torch.randn(1, 2, 32, 8).transpose(1, 2)  # (1, 32, 2, 8) with a strided sequence dim
    exchange = _Exchange(sched, RingPeers(None, [0, 1], 0), strided, strided, "forward")
    kp, _ = exchange._send_parts(((3, 5),))[0]
    assert kp.is_contiguous() and torch.equal(kp, strided[:, 3:8])


@pytest.mark.parametrize("packed", [False, True])
def test_returns_added_in_step_order_with_shared_stretches_summed_at_once(packed, monkeypatch):
    """add_returns: every row of dK / dV gets its returned partials' rows in step order (the bytes of adding the
    returns one after another, fp32), returns of nothing (None, or no buffer) skipped; the stretches two or more
    returns cover go to the fused sum (kernels/cute/sum_into.py on CUDA) with their sources in step order."""
    from fa4dist.context_parallel import ring

    tok = 0 if packed else 1
    gen = torch.Generator().manual_seed(5)
    shape = (lambda n: (n, 2, 8)) if packed else (lambda n: (1, n, 2, 8))
    dk, dv = (torch.randn(shape(40), generator=gen) for _ in range(2))
    range_sets = [((0, 10), (20, 12)), ((5, 20),), (), ((30, 10), (2, 4)), ((8, 30),)]
    returns = []
    for ranges in range_sets:
        n = sum(n for _, n in ranges)
        incoming = ring.KVBuffer.empty(dk, dv, n, tok) if n else None
        if incoming is not None:
            incoming.flat.copy_(torch.randn(incoming.flat.shape, generator=gen) * 1e3)
        returns.append(ring.ReturningGrads(None, incoming, ranges, tok))
    returns.insert(2, None)
    want_k, want_v = _added_in_turn(returns, dk, dv, tok)
    calls = []

    def fused(rows, sources):  # what sum_into does, in torch: the sources in the order given
        calls.append((rows.shape[tok], len(sources)))
        for src in sources:
            rows.add_(src)
        return True

    monkeypatch.setattr(ring, "_fused_sum", lambda t: fused)
    ring.add_returns(returns, dk, dv, tok)
    assert torch.equal(dk, want_k) and torch.equal(dv, want_v)
    # rows 8-9 see returns 0, 1 and 4 (three sources, K and V each); a stretch of one return is a plain add
    assert calls.count((2, 3)) >= 2 and all(n >= 2 for _, n in calls)
    # without the fused sum (the CPU, or no CuTe DSL): torch's adds, the same bytes
    monkeypatch.setattr(ring, "_fused_sum", lambda t: None)
    again_k, again_v = _added_in_turn(returns, want_k, want_v, tok)
    ring.add_returns(returns, want_k, want_v, tok)
    assert torch.equal(want_k, again_k) and torch.equal(want_v, again_v)


def _added_in_turn(returns, dk, dv, tok):
    """Copies of dk / dv with the returns (ReturningGrads; None or empty skipped) added one after another."""
    dk, dv = dk.clone(), dv.clone()
    for g in returns:
        if g is not None and g.incoming is not None:
            at = 0
            for start, n in g.ranges:
                dk.narrow(tok, start, n).add_(g.incoming.k.narrow(tok, at, n))
                dv.narrow(tok, start, n).add_(g.incoming.v.narrow(tok, at, n))
                at += n
    return dk, dv


def test_auto_steps_per_launch_is_half_the_remote_steps(monkeypatch):
    """FA4DIST_RING_STEPS_PER_LAUNCH=auto: ceil(remote steps / 2) per launch (two launch groups), from the schedule
    alone (a window's fewer steps too); 1 where groups cannot land in place (a dense batch of several sequences);
    any other word is refused naming the variable and its values."""
    from fa4dist.context_parallel.ring import STEPS_PER_LAUNCH_ENV, requested_steps_per_launch, ring_steps_per_launch

    k1, k2 = torch.zeros(1, 8, 1, 4), torch.zeros(2, 8, 1, 4)
    for value in ("auto", "AUTO", " auto "):
        monkeypatch.setenv(STEPS_PER_LAUNCH_ENV, value)
        assert requested_steps_per_launch() == "auto"
    for cp, want in [(2, 1), (3, 1), (4, 2), (5, 2), (8, 4)]:
        plan = make_plan(64 * cp, cp, "lpt", causal=True)
        sched = Schedule(plan, 1, plan.mask)
        assert len(sched.steps()) == cp - 1
        got = ring_steps_per_launch(sched, k1)
        assert got == want and [len(g) for g in sched.launch_groups(got)] == [want, cp - 1 - want][:2 if cp > 2 else 1]
        assert ring_steps_per_launch(sched, k2) == 1
    plan = make_plan(512, 8, "contiguous", causal=True, window=(150, 0))  # a chunk sees the three before it
    sched = Schedule(plan, 1, plan.mask)
    assert sched.steps() == (1, 2, 3) and ring_steps_per_launch(sched, k1) == 2
    monkeypatch.setenv(STEPS_PER_LAUNCH_ENV, "half")
    with pytest.raises(ValueError, match="FA4DIST_RING_STEPS_PER_LAUNCH must be an int >= 0 .*or auto.*'half'"):
        requested_steps_per_launch()
