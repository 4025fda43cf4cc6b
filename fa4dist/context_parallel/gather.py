"""The cp_invariant engine: every ring member computes exactly what one device computes for its own rows and keys.

Drop-in for the ring engine (:mod:`fa4dist.context_parallel.ring`) when ``cp_invariant=True``; the numerics rule is
in :mod:`fa4dist.kernels.invariant`.  Forward: the members' K/V are all-gathered into the whole sequence, and each
member makes, for each of its blocks (each document piece of it), the one call a single device makes for those
rows: against all keys of the document.  Backward, in one pass: Q, dO, out, lse and K/V are gathered; each member
makes, for the canonical key tiles its keys start, one call of all of the document's queries against them (dq in
int64 fixed point for every query, dk/dv of its keys), plus a dk/dv-only call for a tile it holds the tail of.
The int64 dq of all rows is then summed over the members (each receives its own rows: integer sums, exact in any
order) and converted once.  No merge and no cross-rank sum ever rounds anything, so the bits do not depend on the
layout.

It trades the ring's memory (only two K/V blocks in flight) for that: the whole sequence's K/V, Q, dO and out sit
on every member in the backward, with an int64 dq of all its rows (8 bytes per element), and one exchange of
that dq (each member sends every other member the rows it owns).
"""

from __future__ import annotations

import torch

from ..kernels import fixed_point, invariant
from ..kernels.problem import check_softmax_scale
from ..kernels.worklist import WorkItem
from .ring import Accumulators, RingPeers
from .schedule import Schedule


def gather_members(sched: Schedule, ring: RingPeers, x: torch.Tensor, seq_dim: int, what: str) -> torch.Tensor:
    """The whole sequence (all members' blocks in global order, ``plan.total_len`` along ``seq_dim``) from every
    member's local tensor in member layout."""
    layouts = sched.members
    me = ring.index
    shape = list(x.shape)
    shape[seq_dim] = max(layout.length for layout in layouts)
    send = x.new_zeros(shape)
    send.narrow(seq_dim, 0, x.shape[seq_dim]).copy_(x)
    bufs = {m: (send if m == me else torch.empty_like(send)) for m in range(sched.ring_size)}
    if sched.ring_size > 1:
        peers = [m for m in range(sched.ring_size) if m != me]
        ring.transport.post_tagged([(send, ring.ranks[m], 30) for m in peers],
                                   [(bufs[m], ring.ranks[m], 30) for m in peers], what).wait()
    shape[seq_dim] = sched.plan.total_len
    full = x.new_empty(shape)
    for m, layout in enumerate(layouts):
        for b in layout.blocks:
            full.narrow(seq_dim, b.start, b.length).copy_(bufs[m].narrow(seq_dim, b.offset, b.length))
    return full


def _pieces(sched: Schedule, member: int):
    """(local row, length, global start, position in document, document start, document length) of each document
    piece of the member's blocks (one piece per block for one sequence)."""
    plan = sched.plan
    for b in sched.members[member].blocks:
        if not plan.packed:
            yield b.offset, b.length, b.start, b.start, 0, plan.total_len
            continue
        for p in plan.pieces(b.start, b.start + b.length):
            doc_start = plan.cu_seqlens[p.doc]
            yield b.offset + p.start, p.length, b.start + p.start, p.position, doc_start, \
                plan.cu_seqlens[p.doc + 1] - doc_start


def row_items(sched: Schedule, member: int) -> list[WorkItem]:
    """The member's rows (local) against all keys of their document (in the gathered sequence)."""
    mask = dict(causal=sched.mask.causal, window=sched.mask.window)
    return [WorkItem(row, n, doc_start, doc_len, pos, 0, **mask)
            for row, n, _, pos, doc_start, doc_len in _pieces(sched, member)]


def whole_items(sched: Schedule) -> list[WorkItem]:
    """The whole sequence's rows against all keys of their document (in the gathered sequence): one item per
    document, the items one device makes for it (invariant.single_device_items)."""
    mask = dict(causal=sched.mask.causal, window=sched.mask.window)
    plan = sched.plan
    if not plan.packed:
        return [WorkItem(0, plan.total_len, 0, plan.total_len, 0, 0, **mask)]
    bounds = list(plan.cu_seqlens)
    return [WorkItem(a, b - a, a, b - a, 0, 0, **mask) for a, b in zip(bounds, bounds[1:])]


def key_calls(sched: Schedule, member: int) -> list[invariant.KeyCall]:
    """The backward's calls for the member's keys: all queries of a document (in the gathered sequence) against
    the canonical key tiles (in the gathered sequence) the member's pieces start or hold the tail of; dk/dv kept
    at the member's local rows."""
    mask = dict(causal=sched.mask.causal, window=sched.mask.window)
    calls = []
    for row, n, _, pos, doc_start, doc_len in _pieces(sched, member):
        calls += invariant.key_calls(doc_start, doc_len, doc_start, doc_len, pos, n, row, **mask)
    return calls


def member_rows(sched: Schedule, member: int, full: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """A member's rows of a whole-sequence tensor, in its local layout (the inverse of :func:`gather_members`)."""
    layout = sched.members[member]
    return torch.cat([full.narrow(seq_dim, b.start, b.length) for b in layout.blocks], dim=seq_dim) \
        if layout.blocks else full.narrow(seq_dim, 0, 0)


def sum_members(sched: Schedule, ring: RingPeers, full: torch.Tensor, seq_dim: int, what: str) -> torch.Tensor:
    """This member's rows of the sum over members of a whole-sequence integer tensor (exact in any order)."""
    me = ring.index
    total = member_rows(sched, me, full, seq_dim).clone()
    if sched.ring_size == 1:
        return total
    peers = [m for m in range(sched.ring_size) if m != me]
    recvs = {m: torch.empty_like(total) for m in peers}
    ring.transport.post_tagged([(member_rows(sched, m, full, seq_dim), ring.ranks[m], 31) for m in peers],
                               [(recvs[m], ring.ranks[m], 31) for m in peers], what).wait()
    for m in peers:
        total += recvs[m]
    return total


def _expand(k: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    return k.index_select(-2, head_map.to(k.device))


def _forward_kv(k: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    """K or V for the forward: as they are where query head i reads head i // group (GQA: a row's out does not
    depend on how many query heads share its K/V), else expanded by ``head_map`` (a Ulysses split of the heads)."""
    heads_q, heads_kv = head_map.numel(), k.shape[-2]
    if heads_q % heads_kv == 0 and torch.equal(head_map.cpu(), torch.arange(heads_q) // (heads_q // heads_kv)):
        return k
    return _expand(k, head_map)


def _lse_seq_dim(packed: bool) -> int:
    return 1 if packed else 2


def gather_forward(sched: Schedule, ring: RingPeers, q, k, v, opts, head_map: torch.Tensor):
    """The fp32 (out, lse) of the member's rows, like ``ring_forward``; ``head_map[i]`` is the local key/value
    head local query head i reads."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    m = ring.index
    full_k = _forward_kv(gather_members(sched, ring, k, sd, "the invariant forward's K"), head_map)
    full_v = _forward_kv(gather_members(sched, ring, v, sd, "the invariant forward's V"), head_map)
    out, lse = invariant.forward(q, full_k, full_v, row_items(sched, m), softmax_scale=opts.softmax_scale,
                                 softcap=opts.softcap, backend=opts.backend)
    return Accumulators(out, lse)


def gather_backward(sched: Schedule, ring: RingPeers, dout, q, k, v, out, lse, opts, head_map: torch.Tensor,
                    sinks=None):
    """fp32 (dq, dk, dv) of the member's tokens, dk/dv per local *query* head (sum them over each key/value
    head's query heads in ascending order with :func:`fa4dist.kernels.invariant.sum_group`), and the gradient of
    ``sinks`` (the local query heads' sinks, or None): the whole sequence's, from the gathered rows
    (:func:`fa4dist.kernels.invariant.sink_grad`), on the ring's first member, None on the others (so that the
    sum over members is that gradient, exactly)."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    lse_sd = _lse_seq_dim(packed)
    m = ring.index
    full_k = gather_members(sched, ring, k, sd, "the invariant backward's K")
    full_v = gather_members(sched, ring, v, sd, "the invariant backward's V")
    # each query head's bounds are its key/value head's (taken before the expansion: fewer bytes, same values), over
    # the keys each row sees of its document, as one device takes them (invariant.single_device_backward)
    (k_max, v_max), sees = fixed_point.visible_key_bounds((full_k, full_v), whole_items(sched), sched.plan.total_len)
    k_max, v_max = (t.index_select(-1, head_map.to(t.device)) for t in (k_max, v_max))
    full_k, full_v = _expand(full_k, head_map), _expand(full_v, head_map)
    full_q, full_do, full_out = (gather_members(sched, ring, t, sd, f"the invariant backward's {name}")
                                 for t, name in ((q, "Q"), (dout, "dO"), (out, "out")))
    full_lse = gather_members(sched, ring, lse, lse_sd, "the invariant backward's lse")
    scale = fixed_point.dq_scale(full_do, full_out, k_max, v_max, check_softmax_scale(opts.softmax_scale, q.shape[-1]),
                                 sees)
    acc = invariant.accum_dtype(q.dtype)
    dq_fixed = torch.zeros(full_q.shape, dtype=torch.int64, device=q.device)
    dk = torch.zeros(*k.shape[:-2], full_k.shape[-2], k.shape[-1], dtype=acc, device=k.device)
    dv = torch.zeros(*v.shape[:-2], full_v.shape[-2], v.shape[-1], dtype=acc, device=v.device)
    invariant.backward(full_do, full_q, full_k, full_v, full_out, full_lse, key_calls(sched, m), dq_fixed, scale, dk,
                       dv, softmax_scale=opts.softmax_scale, softcap=opts.softcap, backend=opts.backend)
    dsinks = invariant.sink_grad(full_do, full_out, full_lse, sinks) if sinks is not None and m == 0 else None
    del full_k, full_v, full_q, full_do, full_out, full_lse
    mine = sum_members(sched, ring, dq_fixed, sd, "the invariant backward's fixed-point dq")
    dq = fixed_point.from_fixed(mine, member_rows(sched, m, scale, lse_sd), acc)
    return dq, dk, dv, dsinks
