"""The ring schedule of a plan: which key rows each ring member sends to which, and which kernel-contract calls it
makes with them.  Pure bookkeeping (no communication, no tensors), shared by the ring engine, the plan's balance
report and ``bench/cp_sim.py``.

A ring *member* is one rank (plain ring) or one Ulysses group (2-D): it holds the chunks of its cp ranks, laid out
in global order, and consecutive chunks merge into *blocks* (contiguous global token ranges).  At step ``t`` of
``R`` member ``m`` computes against the keys of member ``(m - t) mod R`` (step 0: its own).

Only what the mask lets through is sent or computed:

- a (query block, key block) pair is trimmed to the rectangle of its visible pairs (rows that see a key, keys that
  some row sees: :func:`fa4dist.kernels.mask.visible_rect`) and dropped when there is none;
- at step ``t`` member ``m`` receives from its source, *point to point*, only the key rows its calls read (merged
  into ranges, sent as one compact buffer), and nothing at all where no query of ``m`` sees a key of the source.
  With a sliding window most steps are empty: a member needs keys only from the members whose chunks lie within
  the window of its own.  Steps no member needs are not run (:meth:`Schedule.steps`).

Calls are dense ``(batch, len, heads, d)`` with the pieces' global offsets for one sequence.  For packed documents
a pair of different blocks shares at most one document (two disjoint token ranges cannot share two), so it is a
dense batch-1 call on that document's two pieces with their positions in the document as offsets; a block against
itself is a packed call whose segments are the block's document pieces (aligned: q and k share cu_seqlens).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional, Union

import torch

from ..kernels.mask import (
    NO_MASK, Mask, MaskLike, Visibility, as_mask, block_visibility, is_int, visible_pairs, visible_rect,
)
from ..kernels.problem import check_int
from ..kernels.worklist import WorkItem, coalesce
from .plan import ShardPlan


@dataclass(frozen=True)
class Block:
    start: int  # first global token
    length: int
    offset: int  # first token in the member's local (global-ordered) sequence


@dataclass(frozen=True)
class PairCall:
    """One contract call: rows [q_start, q_start + q_len) of query block ``q_block`` against the key rows [k_row,
    k_row + k_len) of the key buffer the member holds at that step (its own member layout at step 0, the compact
    buffer it received otherwise; a run of fully visible keys back to back in that buffer is one call).
    ``cu_seqlens`` is set for a packed call (shared by q and k); ``mask`` is ``NO_MASK`` where every pair is visible
    (the same result, cheaper)."""

    q_block: int
    q_start: int
    q_len: int
    k_row: int
    k_len: int
    q_offset: Union[int, tuple[int, ...]]
    k_offset: Union[int, tuple[int, ...]]
    cu_seqlens: Optional[tuple[int, ...]]
    pairs: int  # visible (query, key) pairs per (batch, head)
    mask: Mask


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
        self._plan = plan

    @cached_property
    def _order(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(scatter, gather): the position in the member layout of every token of the members' concatenated local
        tensors (rank order), and its inverse; (None, None) where the two orders agree.  Built on first use (a
        schedule holds every member's layout, a rank reorders only its own)."""
        # each local range of a member rank lies inside one block
        starts = [b.start for b in self.blocks]
        pieces, identity, expect = [], True, 0
        for r in self.ranks:
            for a, e in self._plan.local_ranges(r):
                b = self.blocks[bisect.bisect_right(starts, a) - 1]
                start = b.offset + (a - b.start)
                identity &= start == expect
                expect += e - a
                pieces.append(torch.arange(start, start + (e - a)))
        if identity:
            return None, None
        scatter = torch.cat(pieces)
        return scatter, torch.argsort(scatter)

    @property
    def _scatter(self) -> Optional[torch.Tensor]:
        return self._order[0]

    @property
    def _gather(self) -> Optional[torch.Tensor]:
        return self._order[1]

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


# own_halves cuts an item at a multiple of this many member rows (a multiple of every kernel's query tile: cute's
# backward takes 64-row tiles at hdim 128 and 128-row tiles at hdim 64; a half that starts off a tile cannot use the
# member's shared query side)
OWN_CUT_ALIGN = 128


def _rows_for_pairs(item: WorkItem, pairs: float) -> int:
    """The fewest leading query rows of `item` that hold at least `pairs` visible pairs (bisection)."""
    mask = Mask(item.causal, item.window)
    lo, hi = 0, item.q_len
    while lo < hi:
        mid = (lo + hi) // 2
        if visible_pairs(mid, item.k_len, item.q_offset, item.k_offset, mask) >= pairs:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _merge_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, merged (start, length) ranges covering the given ones."""
    out: list[list[int]] = []
    for start, length in sorted(ranges):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return tuple((a, n) for a, n in out)


class Schedule:
    """Ring schedule of `plan` run with Ulysses groups of `ulysses_degree` ranks (1 for a plain ring) under `mask`
    (a :class:`~fa4dist.kernels.mask.Mask`, or a bool for causal or not)."""

    def __init__(self, plan: ShardPlan, ulysses_degree: int, mask: MaskLike):
        if not isinstance(plan, ShardPlan):
            raise TypeError(f"plan must be a ShardPlan (make_plan), got {type(plan).__name__}")
        ulysses_degree = check_int("ulysses_degree", ulysses_degree, 1)
        if plan.cp_size % ulysses_degree:
            raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide the plan's cp_size ({plan.cp_size})")
        self.plan = plan
        self.mask = as_mask(mask)
        self.ulysses_degree = ulysses_degree
        self.ring_size = plan.cp_size // ulysses_degree
        u = ulysses_degree
        self.members = tuple(
            MemberLayout(plan, tuple(range(m * u, (m + 1) * u))) for m in range(self.ring_size)
        )
        self._raw: dict = {}
        self._calls: dict = {}
        self._items: dict = {}
        self._group_items: dict = {}
        self._needed: dict = {}
        self._steps: Optional[tuple[int, ...]] = None
        # the visibility index (built per member on first use): which members' keys a member's queries see
        self._member_of_chunk = tuple(r // u for r in plan.chunk_owner)
        self._pieces: dict = {}
        self._spans: dict = {}
        self._sources: dict = {}
        self._starts: dict = {}

    def _index(self, name: str, value, what: str = "a ring member") -> int:
        """`value` checked as an index in [0, ring_size): a member, or a step (a negative member would read another
        member's blocks silently, Python indexing from the end)."""
        if not is_int(value) or not 0 <= value < self.ring_size:
            raise ValueError(f"{name} must be {what} index in [0, {self.ring_size}), got {value!r}")
        return int(value)

    def source(self, member: int, step: int) -> int:
        """The member whose keys `member` computes against at step `step`."""
        return (self._index("member", member) - self._index("step", step, "a ring step")) % self.ring_size

    def dest(self, member: int, step: int) -> int:
        """The member that computes against `member`'s keys at step `step` (what `member` sends to)."""
        return (self._index("member", member) + self._index("step", step, "a ring step")) % self.ring_size

    # ---- visibility index ----------------------------------------------------------------------------------------
    #
    # Under a band mask (lo <= s - p <= hi, lo <= 0 <= hi: a query sees its own position) the keys that a run of
    # consecutive queries p0..p1 of one document sees are one range, [p0 + lo, p1 + hi] within the document, and
    # a key block holds a visible pair with them exactly when it overlaps that range (block_visibility's test).  So
    # a member's blocks give a few key ranges (one per document piece), and the members whose keys it needs are the
    # owners of the chunks those ranges overlap: no pair of blocks is tried for the steps, and only the key blocks
    # a range overlaps are for the calls and transfers.

    def _block_pieces(self, block: Block) -> list:
        cached = self._pieces.get(block.start)
        if cached is None:
            cached = self._pieces[block.start] = self.plan.pieces(block.start, block.start + block.length)
        return cached

    def _key_spans(self, member: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per block of `member`: the inclusive ranges (first, last) of global key positions its queries see, one
        per document piece (one per block for one sequence); every key of a range is seen by some query."""
        cached = self._spans.get(member)
        if cached is None:
            plan, lo, hi = self.plan, self.mask.lo, self.mask.hi
            out = []
            for b in self.members[member].blocks:
                if not plan.packed:
                    first = 0 if lo is None else max(0, b.start + lo)
                    last = plan.total_len - 1 if hi is None else min(plan.total_len - 1, b.start + b.length - 1 + hi)
                    out.append(((first, last),))
                    continue
                spans = []
                for p in self._block_pieces(b):
                    ds, de = plan.cu_seqlens[p.doc], plan.cu_seqlens[p.doc + 1]
                    first = ds if lo is None else max(ds, ds + p.position + lo)
                    last = de - 1 if hi is None else min(de - 1, ds + p.position + p.length - 1 + hi)
                    spans.append((first, last))
                out.append(tuple(spans))
            cached = self._spans[member] = tuple(out)
        return cached

    def _sources_of(self, member: int) -> frozenset:
        """The members (`member` itself included) whose keys some query of `member` sees."""
        cached = self._sources.get(member)
        if cached is None:
            self._index("member", member)
            size, owners = self.plan.chunk_size, self._member_of_chunk
            found: set = set()
            reach = -1  # the chunks up to here are in `found` already
            for a, b in sorted((f // size, e // size) for spans in self._key_spans(member) for f, e in spans):
                a = max(a, reach + 1)
                if a <= b:
                    found.update(owners[a:b + 1])
                    reach = b
            cached = self._sources[member] = frozenset(found)
        return cached

    def _overlapping(self, source: int, first: int, last: int):
        """(index, block) of `source`'s blocks that overlap the global token range [first, last]."""
        starts = self._starts.get(source)
        if starts is None:
            starts = self._starts[source] = [b.start for b in self.members[source].blocks]
        blocks = self.members[source].blocks
        i = max(0, bisect.bisect_right(starts, first) - 1)
        while i < len(blocks) and blocks[i].start <= last:
            if blocks[i].start + blocks[i].length > first:
                yield i, blocks[i]
            i += 1

    # ---- calls ---------------------------------------------------------------------------------------------------

    def _raw_calls(self, member: int, source: int) -> tuple[PairCall, ...]:
        """The calls of `member`'s queries against `source`'s keys, key rows in `source`'s member layout: every pair
        of a query block and a key block with a visible pair, in (query block, key block) order."""
        cached = self._raw.get((member, source))
        if cached is None:
            self._index("member", member)
            self._index("source", source)
            out = []
            if source in self._sources_of(member):
                spans, kblocks = self._key_spans(member), self.members[source].blocks
                for qi, qb in enumerate(self.members[member].blocks):
                    keys = sorted({ki for f, e in spans[qi] for ki, _ in self._overlapping(source, f, e)})
                    for ki in keys:  # (the other key blocks hold no key these queries see)
                        call = self._pair(qi, qb, kblocks[ki], same=(member == source and qi == ki))
                        if call is not None:
                            out.append(call)
            cached = self._raw[(member, source)] = tuple(out)
        return cached

    def needed(self, member: int, source: int) -> tuple[tuple[int, int], ...]:
        """(start, length) ranges of `source`'s member layout that `member`'s calls read, merged and sorted: what
        `source` sends `member` (empty: no transfer and no compute)."""
        cached = self._needed.get((member, source))
        if cached is None:
            self._index("member", member)
            self._index("source", source)
            if member == source:  # the own blocks: whole blocks against themselves (one call each)
                rows = [(c.k_row, c.k_len) for c in self._raw_calls(member, source)]
            elif source not in self._sources_of(member):
                rows = []
            else:  # a call's keys: a key block's part in the range its query piece sees (visible_rect's keys)
                rows = [(b.offset + max(f, b.start) - b.start, min(e + 1, b.start + b.length) - max(f, b.start))
                        for spans in self._key_spans(member) for f, e in spans
                        for _, b in self._overlapping(source, f, e)]
            cached = self._needed[(member, source)] = _merge_ranges(rows)
        return cached

    def calls(self, member: int, source: int) -> tuple[PairCall, ...]:
        """The contract calls of `member`'s queries against `source`'s keys, ordered by (query block, key), with key
        rows in the buffer `member` holds: its own layout if member == source, else the compact buffer of
        :meth:`needed`'s ranges back to back."""
        cached = self._calls.get((member, source))
        if cached is not None:
            return cached
        raw = self._raw_calls(member, source)
        if member != source:  # key rows of the source layout -> rows of the compact received buffer
            ranges, at, compact = self.needed(member, source), 0, []
            for start, length in ranges:
                compact.append((start, length, at))
                at += length
            raw = tuple(replace(c, k_row=next(c.k_row - s + a for s, n, a in compact if s <= c.k_row < s + n))
                        for c in raw)
        self._calls[(member, source)] = tuple(raw)
        return self._calls[(member, source)]

    def items(self, member: int, source: int) -> tuple[WorkItem, ...]:
        """:meth:`calls` as one work list (fa4dist.kernels.worklist): query rows in `member`'s layout, key rows in
        the buffer it holds; a packed call becomes one item per document piece, and blocks that see all their keys
        and share one side are joined (``worklist.coalesce``: a member's two chunks against one held chunk, or one
        chunk against the two it holds).  One launch per step where the backend runs work lists in one; the same
        items, in the same order, where it loops."""
        cached = self._items.get((member, source))
        if cached is not None:
            return cached
        blocks = self.members[member].blocks
        out = []
        for c in self.calls(member, source):
            q_row = blocks[c.q_block].offset + c.q_start
            mask = dict(causal=c.mask.causal, window=c.mask.window)
            if c.cu_seqlens is None:
                out.append(WorkItem(q_row, c.q_len, c.k_row, c.k_len, c.q_offset, c.k_offset, **mask))
                continue
            for i, (a, b) in enumerate(zip(c.cu_seqlens, c.cu_seqlens[1:])):
                out.append(WorkItem(q_row + a, b - a, c.k_row + a, b - a, c.q_offset[i], c.k_offset[i], **mask))
        self._items[(member, source)] = coalesce(out)
        return self._items[(member, source)]

    def own_halves(self, member: int) -> tuple[tuple[WorkItem, ...], tuple[WorkItem, ...]]:
        """The member's own-keys work list cut in two of about equal work (an item split by its query rows where
        needed, at a multiple of OWN_CUT_ALIGN member rows where the item allows, so that a shared query side's
        tiles hold each half's rows whole): the backward runs the first half before its first remote step, while
        that step's keys travel, and the second after its last, while that step's dK/dV travel back."""
        items = self.items(member, member)
        cost = [visible_pairs(i.q_len, i.k_len, i.q_offset, i.k_offset, Mask(i.causal, i.window)) for i in items]
        half, done = sum(cost) / 2, 0
        for n, (item, c) in enumerate(zip(items, cost)):
            if done + c < half:
                done += c
                continue
            # split this item's rows so that the first part holds about half - done pairs
            rows = _rows_for_pairs(item, half - done)
            cut = round((item.q_start + rows) / OWN_CUT_ALIGN) * OWN_CUT_ALIGN  # the nearest aligned member row
            rows = min(max(cut - item.q_start, 0), item.q_len)
            first = replace(item, q_len=rows)
            second = replace(item, q_start=item.q_start + rows, q_len=item.q_len - rows, q_offset=item.q_offset + rows)
            head = items[:n] + ((first,) if rows else ())
            tail = ((second,) if item.q_len - rows else ()) + items[n + 1:]
            return head, tail
        return items, ()

    def _trimmed(self, qi: int, q_len: int, k_row: int, k_len: int, q_pos: int, k_pos: int,
                 q_at: int = 0) -> Optional[PairCall]:
        """The call of one dense piece pair (queries at positions q_pos.., rows q_at.. of block qi; keys at
        positions k_pos.., member-layout rows k_row..) trimmed to its visible rectangle."""
        rect = visible_rect(q_len, k_len, q_pos, k_pos, self.mask)
        if rect is None:
            return None
        qp, kp = q_pos + rect.q_start, k_pos + rect.k_start
        vis = block_visibility(rect.q_len, rect.k_len, qp, kp, self.mask)
        pairs = visible_pairs(rect.q_len, rect.k_len, qp, kp, self.mask)
        return PairCall(qi, q_at + rect.q_start, rect.q_len, k_row + rect.k_start, rect.k_len, qp, kp, None, pairs,
                        NO_MASK if vis is Visibility.FULL else self.mask)

    def _pair(self, qi: int, qb: Block, kb: Block, same: bool) -> Optional[PairCall]:
        plan, mask = self.plan, self.mask
        if not plan.packed:
            return self._trimmed(qi, qb.length, kb.offset, kb.length, qb.start, kb.start)
        q_pieces = self._block_pieces(qb)
        if same:
            pairs = sum(visible_pairs(p.length, p.length, p.position, p.position, mask) for p in q_pieces)
            if len(q_pieces) == 1:
                p = q_pieces[0]
                return PairCall(qi, 0, qb.length, kb.offset, kb.length, p.position, p.position, None, pairs, mask)
            cu = [0]
            for p in q_pieces:
                cu.append(cu[-1] + p.length)
            offsets = tuple(p.position for p in q_pieces)
            return PairCall(qi, 0, qb.length, kb.offset, kb.length, offsets, offsets, tuple(cu), pairs, mask)
        k_by_doc = {p.doc: p for p in self._block_pieces(kb)}
        shared = [(p, k_by_doc[p.doc]) for p in q_pieces if p.doc in k_by_doc]
        if not shared:
            return None
        if len(shared) > 1:  # cannot happen for disjoint ranges; a bug if it does
            raise AssertionError(f"blocks {qb} and {kb} share {len(shared)} documents")
        qp, kp = shared[0]
        return self._trimmed(qi, qp.length, kb.offset + kp.start, kp.length, qp.position, kp.position, q_at=qp.start)

    # ---- steps and transfers -------------------------------------------------------------------------------------

    def recv_len(self, member: int, step: int) -> int:
        """Key rows `member` receives at `step` (0: nothing)."""
        return sum(n for _, n in self.needed(member, self.source(member, step)))

    def send_ranges(self, member: int, step: int) -> tuple[tuple[int, int], ...]:
        """Ranges of its own layout `member` sends at `step` (to :meth:`dest`)."""
        return self.needed(self.dest(member, step), member)

    def steps(self) -> tuple[int, ...]:
        """The remote steps (1..R-1) at which some member receives keys, in order: the same for every member (the
        transfers of a step between two members are posted by both in one global order)."""
        if self._steps is None:
            r, found = self.ring_size, set()
            for m in range(r):  # (the members' sources, until every step is found)
                found.update((m - s) % r for s in self._sources_of(m))
                if len(found) == r or (len(found) == r - 1 and 0 not in found):
                    break
            self._steps = tuple(t for t in range(1, r) if t in found)
        return self._steps

    def launch_groups(self, steps_per_launch: int) -> tuple[tuple[int, ...], ...]:
        """:meth:`steps` in consecutive groups of at most `steps_per_launch` steps (0: all in one group), the same
        for every member: a member receives a group's key rows into one buffer and computes them in one work list
        (:meth:`group_items`), so a row's blocks from several steps that see all their keys join into one item and
        merge once."""
        if isinstance(steps_per_launch, bool) or not isinstance(steps_per_launch, int) or steps_per_launch < 0:
            raise ValueError(f"steps_per_launch must be an int >= 0 (0: every remote step in one launch), got "
                             f"{steps_per_launch!r}")
        steps = self.steps()
        size = steps_per_launch or max(len(steps), 1)
        return tuple(steps[i:i + size] for i in range(0, len(steps), size))

    def group_items(self, member: int, group: tuple[int, ...]) -> tuple[tuple[tuple[int, int, int], ...],
                                                                        tuple[WorkItem, ...]]:
        """Where `member` holds each step of `group` in the group's key buffer, ((step, first row, rows), ...) in
        step order, back to back, and the steps' work lists (:meth:`items`) on that buffer, in step order,
        coalesced: one list for one call."""
        key = (member, group)
        cached = self._group_items.get(key)
        if cached is not None:
            return cached
        for t in group:
            if t not in self.steps():
                raise ValueError(f"group must hold remote steps of this schedule ({self.steps()}), got {group!r}")
        places, items, at = [], [], 0
        for t in group:
            n = self.recv_len(member, t)
            places.append((t, at, n))
            if n:
                items += [replace(it, k_start=it.k_start + at) for it in self.items(member, self.source(member, t))]
            at += n
        self._group_items[key] = (tuple(places), coalesce(items))
        return self._group_items[key]

    def member_steps(self, member: int) -> tuple[int, ...]:
        """The remote steps at which `member` receives keys (and computes)."""
        r = self.ring_size  # (step t reads source member - t: the sources give the steps, no walk over all R)
        return tuple(sorted((member - s) % r for s in self._sources_of(member) if s != member))

    def member_calls(self, member: int) -> int:
        """Contract calls `member` makes over all steps (one forward call and one backward call each)."""
        return sum(len(self.calls(member, s)) for s in range(self.ring_size))

    def member_work(self, member: int) -> int:
        """Visible pairs (per batch and head) over all steps of `member`: its share of the attention."""
        return sum(c.pairs for s in range(self.ring_size) for c in self.calls(member, s))

    def member_received(self, member: int) -> int:
        """Key/value tokens `member` receives over a forward (the backward receives them again and returns as many
        dK/dV rows)."""
        # The sum over sources of needed()'s lengths is the keys `member`'s queries see (the union of its key spans)
        # less those it holds itself: counted on the merged spans against its own blocks, without the per-source
        # ranges (an R^2 walk of block overlaps at cp 1024).
        seen = _merge_ranges((f, e - f + 1) for spans in self._key_spans(self._index("member", member))
                             for f, e in spans)
        own = self.members[member].blocks  # (in global order, disjoint)
        held, i = 0, 0
        for start, length in seen:
            end = start + length
            while i < len(own) and own[i].start + own[i].length <= start:
                i += 1
            j = i
            while j < len(own) and own[j].start < end:
                held += min(end, own[j].start + own[j].length) - max(start, own[j].start)
                j += 1
        return sum(n for _, n in seen) - held
