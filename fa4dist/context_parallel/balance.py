"""Balancers: which ring group holds each chunk of a sharding plan.

Every balancer takes the chunks' costs (visible (query, key) pairs, from the plan's mask), the number of groups and
which chunks are *real* (hold tokens; the empty ones past the end of the stream come last), and returns the group of
every chunk.  Every group holds ``len(costs) // groups`` chunks, and every balancer but zigzag gives each group as
many real chunks as the others, within one (otherwise the empty chunks are free slots and the real ones, with their
tokens, pile up on a few groups).

- ``contiguous``: group g holds one contiguous run of the real chunks.
- ``zigzag``: with 2G chunks per round, group g holds chunks g and 2G-1-g of each round.
- ``lpt``: two starts, each then improved by pairwise swaps (:func:`_improve`); the better result wins (the greedy
  one on a tie):

  - longest processing time first: chunks go costliest-first to the least-loaded group that has room;
  - balanced differencing (Karmarkar-Karp with equal counts): the chunks, costliest first, form rows of G; the two
    rows whose loads spread the most merge, the heaviest group of one with the lightest of the other, until one row
    is left.  It beats the greedy where one long document's chunks dominate the mix.

  With 2G equal chunks of one causal sequence both give zigzag's balance (every group the same work).

The search is deterministic (plans must agree on every rank), and a round of swaps looks at a bounded number of group
pairs whatever the cp size.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from typing import Sequence

BALANCERS = ("contiguous", "zigzag", "lpt")


def _fill_empty(owner: list[int], count: list[int], real: Sequence[bool], capacity: int) -> list[int]:
    """The empty chunks fill the groups' remaining slots, in group order."""
    g = 0
    for i in range(len(owner)):
        if not real[i]:
            while count[g] == capacity:
                g += 1
            owner[i] = g
            count[g] += 1
    return owner


def contiguous(costs: Sequence[int], groups: int, real: Sequence[bool]) -> list[int]:
    """Group g holds one contiguous run of the real chunks (as many as the others, within one: the runs' tokens do
    not pile on the first groups when the chunks past the end are empty), then empty chunks up to its capacity."""
    capacity = len(costs) // groups
    if all(real):
        return [i // capacity for i in range(len(costs))]
    low, extra = divmod(sum(1 for r in real if r), groups)  # the first `extra` runs hold one more
    owner, count, g = [0] * len(costs), [0] * groups, 0
    for i in range(len(costs)):  # the real chunks come first (the stream's prefix)
        if real[i]:
            while count[g] == low + (g < extra):
                g += 1
            owner[i] = g
            count[g] += 1
    return _fill_empty(owner, count, real, capacity)


def zigzag(costs: Sequence[int], groups: int, real: Sequence[bool]) -> list[int]:
    if len(costs) % (2 * groups):
        raise ValueError(
            f"the zigzag balancer needs num_chunks to be a multiple of 2 x {groups} (two chunks per rank and round), "
            f"got {len(costs)}"
        )
    out = []
    for i in range(len(costs)):
        j = i % (2 * groups)
        out.append(j if j < groups else 2 * groups - 1 - j)
    return out


# ---- lpt ---------------------------------------------------------------------------------------------------------
# An assignment is a list of G slot lists of equal length m = ceil(real chunks / G): chunk indices, and at most one
# *hole* per group (None, cost 0) where a group holds one real chunk fewer than m.  Swapping two slots keeps every
# group at m slots; the one-hole rule keeps the real counts within one.


def _greedy(costs: Sequence[int], groups: int, items: list[int], slots: int) -> list[list]:
    """Costliest first, each to the least-loaded group (the lowest index on a tie) that has a free slot."""
    holes = groups * slots - len(items)  # groups that end with one real chunk fewer
    load, members = [0] * groups, [[] for _ in range(groups)]
    full = 0  # groups holding `slots` chunks; the others stop at slots - 1 once `groups - holes` are full
    heap = [(0, g) for g in range(groups)]  # (load, group) of the groups that may still have room
    for i in sorted(items, key=lambda i: (-costs[i], i)):
        while True:  # (a group's room only shrinks: one found without room is dropped for good)
            _, g = heapq.heappop(heap)
            n = len(members[g])
            if n < slots - 1 or (n == slots - 1 and full < groups - holes):
                break
        members[g].append(i)
        load[g] += costs[i]
        full += len(members[g]) == slots
        heapq.heappush(heap, (load[g], g))
    return [m + [None] * (slots - len(m)) for m in members]


def _differencing(costs: Sequence[int], groups: int, items: list[int], slots: int) -> list[list]:
    """Balanced differencing: rows of G chunks (costliest first; the holes, cost 0, last) merge two at a time, the
    pair whose loads spread the most first, pairing one row's heaviest groups with the other's lightest."""
    ordered = sorted(items, key=lambda i: (-costs[i], i)) + [None] * (groups * slots - len(items))
    heap = []
    for r in range(slots):
        row = [(0 if i is None else costs[i], i) for i in ordered[r * groups:(r + 1) * groups]]  # (load, tree)
        heapq.heappush(heap, (row[-1][0] - row[0][0], r, row))  # rows are sorted heaviest first
    seq = slots
    while len(heap) > 1:
        (_, _, a), (_, _, b) = heapq.heappop(heap), heapq.heappop(heap)
        row = sorted(((la + lb, (ta, tb)) for (la, ta), (lb, tb) in zip(a, reversed(b))),
                     key=lambda x: -x[0])  # (stable: ties keep their order, so the result is deterministic)
        heapq.heappush(heap, (row[-1][0] - row[0][0], seq, row))
        seq += 1
    members = []
    for _, tree in heap[0][2]:
        leaves, stack = [], [tree]
        while stack:  # a merge tree's leaves are chunk indices (or a hole)
            t = stack.pop()
            if isinstance(t, tuple):
                stack.extend(t)
            else:
                leaves.append(t)
        members.append(leaves)
    return members


def _improve(costs: Sequence[int], members: list[list], max_rounds: int) -> list[int]:
    """Swaps that bring two groups' loads closer (the sum of squared loads falls, so the maximum never rises): one
    chunk for one, or two for two where a group holds at most ``_PAIR_SWAP_SLOTS`` (a chain of single swaps cannot
    always reach what one double swap does: the big chunks of one long document are spread over the groups).  Each
    round looks at the most loaded group against the ``_PARTNERS`` least loaded and the least loaded against the
    most loaded ones (the widest spreads allow the largest gains), and makes the swap that lowers the sum of squares
    most, until the maximum is within ``_GOOD_ENOUGH`` of the mean or no swap helps.  Returns the loads."""
    groups = len(members)
    cost = [[0 if i is None else costs[i] for i in m] for m in members]
    load = [sum(c) for c in cost]
    good_enough = sum(load) / groups * (1 + _GOOD_ENOUGH)
    pairs_too = len(members[0]) <= _PAIR_SWAP_SLOTS
    for _ in range(max_rounds):
        order = sorted(range(groups), key=lambda g: (load[g], g))
        low, top = order[0], order[-1]
        if load[top] <= good_enough:
            break
        k = min(_PARTNERS, groups - 1)
        pairs = [(top, g) for g in order[:k]] + [(g, low) for g in order[-1 - k:-1] if g not in order[:k]]
        best = None  # (gain, hi, slots in hi, lo, slots in lo)
        for moves in (_single_slots, _slot_pairs) if pairs_too else (_single_slots,):
            for hi, lo in pairs:
                spread = load[hi] - load[lo]
                if spread > 1:
                    hole_to_hi = None not in members[hi]  # (a group holds one hole at most)
                    found = _best_swap(moves(cost[hi], members[hi], False), moves(cost[lo], members[lo], hole_to_hi),
                                       spread)
                    if found is not None and (best is None or found[0] > best[0]):
                        best = (found[0], hi, found[1], lo, found[2])
            if best is not None:  # (two-for-two only where no single swap helps: it costs far more)
                break
        if best is None:
            break
        _, hi, slots_hi, lo, slots_lo = best
        for sa, sb in zip(slots_hi, slots_lo):
            delta = cost[hi][sa] - cost[lo][sb]
            members[hi][sa], members[lo][sb] = members[lo][sb], members[hi][sa]
            cost[hi][sa], cost[lo][sb] = cost[lo][sb], cost[hi][sa]
            load[hi] -= delta
            load[lo] += delta
    return load


_PAIR_SWAP_SLOTS = 64  # two-for-two swaps look at (slots choose 2)^2 pairs of a group pair, by bisection
_PARTNERS = 8  # groups a round pairs with the most and with the least loaded: its cost does not grow with cp
_GOOD_ENOUGH = 1e-3  # the busiest group's work over the mean, minus one, where the search stops


def _single_slots(cost: list[int], member: list, holes: bool):
    """(cost, (slot,)) for every chunk of a group, and its hole if `holes`."""
    for s in range(len(cost)):
        if holes or member[s] is not None:
            yield cost[s], (s,)


def _slot_pairs(cost: list[int], member: list, holes: bool):
    """(cost, (slot, slot)) for every two real chunks of a group (a hole never moves in a pair)."""
    real = [s for s in range(len(cost)) if member[s] is not None]
    for x in range(len(real)):
        for y in range(x + 1, len(real)):
            yield cost[real[x]] + cost[real[y]], (real[x], real[y])


def _best_swap(give, take, spread: int):
    """(gain, give's slots, take's slots): the swap moving closest to spread / 2 of cost from the group giving to
    the one taking, strictly between 0 and spread (the gain delta * (spread - delta) is what the sum of squared
    loads falls by, over two), or None."""
    cand = sorted(take)
    keys = [c for c, _ in cand]
    best = None
    for c_give, s_give in give:
        j = bisect_left(keys, c_give - spread // 2)  # take's slots costing about c_give - spread / 2
        for near in (j - 1, j):
            if 0 <= near < len(cand):
                delta = c_give - keys[near]
                if 0 < delta < spread and (best is None or delta * (spread - delta) > best[0]):
                    best = (delta * (spread - delta), s_give, cand[near][1])
    return best


def lpt(costs: Sequence[int], groups: int, real: Sequence[bool]) -> list[int]:
    """The greedy and the differencing starts, each improved by swaps; the lower (maximum load, sum of squared
    loads) wins, the greedy one on a tie."""
    n = len(costs)
    items = [i for i in range(n) if real[i]]
    slots = -(-len(items) // groups)
    best = None
    for start in (_greedy, _differencing):
        members = start(costs, groups, items, slots)
        load = _improve(costs, members, max_rounds=2 * groups + 64)
        key = (max(load), sum(x * x for x in load))
        if best is None or key < best[0]:
            best = (key, members)
        if max(load) <= sum(load) / groups * (1 + _GOOD_ENOUGH):
            break  # (the greedy start is enough)
    owner, count = [0] * n, [0] * groups
    for g, m in enumerate(best[1]):
        for i in m:
            if i is not None:
                owner[i] = g
                count[g] += 1
    return _fill_empty(owner, count, real, n // groups)


BALANCER_FNS = {"contiguous": contiguous, "zigzag": zigzag, "lpt": lpt}
