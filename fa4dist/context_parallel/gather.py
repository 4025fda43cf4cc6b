"""The cp_invariant engine: every ring member computes exactly what one device computes for its own rows and keys.

Drop-in for the ring engine (:mod:`fa4dist.context_parallel.ring`) when ``cp_invariant=True``; the numerics rule is
in :mod:`fa4dist.kernels.invariant`.  Forward: the members' K/V are all-gathered into the whole sequence, and each
member makes, for each of its blocks (each document piece of it), the one call a single device makes for those
rows: against all keys of the document.  Backward, in two passes: (1) K/V gathered again, the same calls give the
member's dq; (2) Q, dO, out and lse gathered, calls of all of a document's queries against the member's own keys
give its dk/dv. Each pass asks only for its gradients: the CuTe kernels then run 3 (dq) and 4 (dk/dv) of the
backward's 5 GEMMs per tile, and the second pass has no dQ tickets.  No merge and no cross-rank sum ever rounds
anything, so the bits do not depend on the layout.

It trades the ring's memory (only two K/V blocks in flight) and one-pass backward for that: the whole sequence's
K/V (and, in the backward, Q, dO, out) sit on every member, and the backward computes about 1.4 times the ring's
work (twice before each pass skipped the other's GEMMs).
"""

from __future__ import annotations

import torch

from ..kernels import invariant
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


def key_items(sched: Schedule, member: int) -> list[WorkItem]:
    """All queries of a document (in the gathered sequence) against the member's keys (local)."""
    mask = dict(causal=sched.mask.causal, window=sched.mask.window)
    return [WorkItem(doc_start, doc_len, row, n, 0, pos, **mask)
            for row, n, _, pos, doc_start, doc_len in _pieces(sched, member)]


def _expand(k: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    return k.index_select(-2, head_map.to(k.device))


def _lse_seq_dim(packed: bool) -> int:
    return 1 if packed else 2


def gather_forward(sched: Schedule, ring: RingPeers, q, k, v, opts, head_map: torch.Tensor):
    """The fp32 (out, lse) of the member's rows, like ``ring_forward``; ``head_map[i]`` is the local key/value
    head local query head i reads."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    m = ring.index
    full_k = _expand(gather_members(sched, ring, k, sd, "the invariant forward's K"), head_map)
    full_v = _expand(gather_members(sched, ring, v, sd, "the invariant forward's V"), head_map)
    out, lse = invariant.forward(q, full_k, full_v, row_items(sched, m), softmax_scale=opts.softmax_scale,
                                 softcap=opts.softcap, backend=opts.backend)
    return Accumulators(out, lse)


def gather_backward(sched: Schedule, ring: RingPeers, dout, q, k, v, out, lse, opts, head_map: torch.Tensor):
    """fp32 (dq, dk, dv) of the member's tokens, dk/dv per local *query* head (sum them over each key/value
    head's query heads in ascending order with :func:`fa4dist.kernels.invariant.sum_group`)."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    m = ring.index
    full_k = _expand(gather_members(sched, ring, k, sd, "the invariant backward's K"), head_map)
    full_v = _expand(gather_members(sched, ring, v, sd, "the invariant backward's V"), head_map)
    dq, _, _ = invariant.backward(dout, q, full_k, full_v, out, lse, row_items(sched, m),
                                  softmax_scale=opts.softmax_scale, softcap=opts.softcap, backend=opts.backend,
                                  grads="dq")
    del full_k, full_v
    full = [gather_members(sched, ring, t, sd, f"the invariant backward's {name}")
            for t, name in ((q, "Q"), (dout, "dO"), (out, "out"))]
    full_lse = gather_members(sched, ring, lse, _lse_seq_dim(packed), "the invariant backward's lse")
    local_k, local_v = _expand(k, head_map), _expand(v, head_map)
    _, dk, dv = invariant.backward(full[1], full[0], local_k, local_v, full[2], full_lse,
                                   key_items(sched, m), softmax_scale=opts.softmax_scale, softcap=opts.softcap,
                                   backend=opts.backend, grads="dkv")
    return dq, dk, dv
