"""The ring schedule of a plan: which kernel-contract calls each ring member makes at each step.  Pure bookkeeping
(no communication, no tensors), shared by the ring engine and by ``bench/cp_sim.py``.

A ring *member* is one rank (plain ring) or one Ulysses group (2-D): it holds the chunks of its cp ranks, laid out
in global order, and consecutive chunks merge into *blocks* (contiguous global token ranges).  At step t member m
holds the keys of member (m - t) mod R and makes one contract call per (query block, key block) pair that any
query can see; pairs the mask hides entirely are dropped here, without a launch.

Calls are dense ``(batch, len, heads, d)`` with the blocks' global offsets for one sequence.  For packed documents
a pair of different blocks shares at most one document (two disjoint token ranges cannot share two), so it is a
dense batch-1 call on that document's two pieces with their positions in the document as offsets; a block against
itself is a packed call whose segments are the block's document pieces (aligned: q and k share cu_seqlens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from ..kernels.mask import Visibility, block_visibility, visible_pairs
from .plan import ShardPlan


@dataclass(frozen=True)
class Block:
    start: int  # first global token
    length: int
    offset: int  # first token in the member's local (global-ordered) sequence


@dataclass(frozen=True)
class PairCall:
    """One contract call: rows [q_start, q_start + q_len) of query block `q_block` against keys [k_start, k_start +
    k_len) counted from key block `k_block` (a run of consecutive fully visible key blocks is one call: the blocks
    lie back to back in the key buffer).  ``cu_seqlens`` is set for a packed call (shared by q and k); ``causal``
    is False where every pair is visible (the same mask, cheaper)."""

    q_block: int
    k_block: int
    q_start: int
    q_len: int
    k_start: int
    k_len: int
    q_offset: Union[int, tuple[int, ...]]
    k_offset: Union[int, tuple[int, ...]]
    cu_seqlens: Optional[tuple[int, ...]]
    pairs: int  # visible (query, key) pairs per (batch, head)
    causal: bool


class MemberLayout:
    """The tokens of one ring member (the chunks of cp ranks `ranks`) in global order, as blocks."""

    def __init__(self, plan: ShardPlan, ranks: tuple[int, ...]):
        self.ranks = ranks
        chunks = sorted(c for r in ranks for c in plan.rank_chunks(r) if plan.chunk_len(c) > 0)
        blocks: list[list[int]] = []  # [start, length, offset]
        offset = 0
        for c in chunks:
            start, end = plan.chunk_bounds(c)
            if blocks and blocks[-1][0] + blocks[-1][1] == start:
                blocks[-1][1] += end - start
            else:
                blocks.append([start, end - start, offset])
            offset += end - start
        self.chunks = tuple(chunks)
        self.blocks = tuple(Block(*b) for b in blocks)
        self.length = offset
        # Position in the member layout of every token of the members' concatenated local tensors (rank order):
        # each local range of a member rank lies inside one block.
        pieces, identity, expect = [], True, 0
        for r in ranks:
            for a, e in plan.local_ranges(r):
                b = next(b for b in self.blocks if b.start <= a < b.start + b.length)
                start = b.offset + (a - b.start)
                identity &= start == expect
                expect += e - a
                pieces.append(torch.arange(start, start + (e - a)))
        self._scatter = None if identity else torch.cat(pieces)
        self._gather = None if identity else torch.argsort(self._scatter)

    def to_member_order(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Reorders the concatenation (in rank order) of the members' local tensors into the member layout."""
        if self._gather is None:
            return x
        return x.index_select(dim, self._gather.to(x.device))

    def to_rank_order(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Inverse of :meth:`to_member_order`."""
        if self._scatter is None:
            return x
        return x.index_select(dim, self._scatter.to(x.device))


def _span(blocks, call: PairCall) -> int:
    """How many key blocks a (merged) dense call covers."""
    n, covered = 0, 0
    while covered < call.k_len:
        covered += blocks[call.k_block + n].length
        n += 1
    return n


class Schedule:
    """Ring schedule of `plan` run with Ulysses groups of `ulysses_degree` ranks (1 for a plain ring)."""

    def __init__(self, plan: ShardPlan, ulysses_degree: int, causal: bool):
        if plan.cp_size % ulysses_degree:
            raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide the plan's cp_size ({plan.cp_size})")
        self.plan = plan
        self.causal = causal
        self.ulysses_degree = ulysses_degree
        self.ring_size = plan.cp_size // ulysses_degree
        u = ulysses_degree
        self.members = tuple(
            MemberLayout(plan, tuple(range(m * u, (m + 1) * u))) for m in range(self.ring_size)
        )
        # every member's key buffer has room for the longest member's tokens
        self.buffer_len = max(m.length for m in self.members)
        self._calls: dict = {}

    def source(self, member: int, step: int) -> int:
        """The member whose keys `member` holds at ring step `step`."""
        return (member - step) % self.ring_size

    def calls(self, member: int, source: int) -> tuple[PairCall, ...]:
        """The contract calls of `member`'s queries against `source`'s keys, ordered by (query block, key block)."""
        cached = self._calls.get((member, source))
        if cached is not None:
            return cached
        out = []
        k_blocks = self.members[source].blocks
        for qi, qb in enumerate(self.members[member].blocks):
            for ki, kb in enumerate(k_blocks):
                call = self._pair(qi, qb, ki, kb, same=(member == source and qi == ki))
                if call is None:
                    continue
                last = out[-1] if out else None
                if (not self.plan.packed and not call.causal and last is not None and not last.causal
                        and last.q_block == qi and last.k_block + _span(k_blocks, last) == ki):
                    # fully visible key blocks back to back in the buffer: one call (and one merge) for the run
                    out[-1] = replace(last, k_len=last.k_len + call.k_len, pairs=last.pairs + call.pairs)
                else:
                    out.append(call)
        self._calls[(member, source)] = tuple(out)
        return self._calls[(member, source)]

    def _pair(self, qi: int, qb: Block, ki: int, kb: Block, same: bool) -> Optional[PairCall]:
        plan, causal = self.plan, self.causal
        if not plan.packed:
            vis = block_visibility(qb.length, kb.length, qb.start, kb.start, causal)
            if vis is Visibility.NONE:
                return None
            pairs = visible_pairs(qb.length, kb.length, qb.start, kb.start, causal)
            return PairCall(qi, ki, 0, qb.length, 0, kb.length, qb.start, kb.start, None, pairs,
                            causal and vis is not Visibility.FULL)
        q_pieces = plan.pieces(qb.start, qb.start + qb.length)
        if same:
            pairs = sum(visible_pairs(p.length, p.length, p.position, p.position, causal) for p in q_pieces)
            if len(q_pieces) == 1:
                p = q_pieces[0]
                return PairCall(qi, ki, 0, qb.length, 0, kb.length, p.position, p.position, None, pairs, causal)
            cu = [0]
            for p in q_pieces:
                cu.append(cu[-1] + p.length)
            offsets = tuple(p.position for p in q_pieces)
            return PairCall(qi, ki, 0, qb.length, 0, kb.length, offsets, offsets, tuple(cu), pairs, causal)
        k_by_doc = {p.doc: p for p in plan.pieces(kb.start, kb.start + kb.length)}
        shared = [(p, k_by_doc[p.doc]) for p in q_pieces if p.doc in k_by_doc]
        if not shared:
            return None
        if len(shared) > 1:  # cannot happen for disjoint ranges; a bug if it does
            raise AssertionError(f"blocks {qb} and {kb} share {len(shared)} documents")
        qp, kp = shared[0]
        vis = block_visibility(qp.length, kp.length, qp.position, kp.position, causal)
        if vis is Visibility.NONE:
            return None
        pairs = visible_pairs(qp.length, kp.length, qp.position, kp.position, causal)
        return PairCall(qi, ki, qp.start, qp.length, kp.start, kp.length, qp.position, kp.position, None, pairs,
                        causal and vis is not Visibility.FULL)

    def member_calls(self, member: int) -> int:
        """Contract calls `member` makes over all steps (one forward call and one backward call each)."""
        return sum(len(self.calls(member, s)) for s in range(self.ring_size))

    def member_work(self, member: int) -> int:
        """Visible pairs (per batch and head) over all steps of `member`: its share of the attention."""
        return sum(c.pairs for s in range(self.ring_size) for c in self.calls(member, s))
