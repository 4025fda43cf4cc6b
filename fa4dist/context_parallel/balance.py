"""Balancers: which ring group holds each chunk of a sharding plan.

Every balancer takes the chunks' costs (visible (query, key) pairs, from the plan's mask), the number of groups and
which chunks are *real* (hold tokens; the empty ones past the end of the stream come last), and returns the group of
every chunk.  Every group holds ``len(costs) // groups`` chunks, and every balancer but zigzag gives each group as
many real chunks as the others, within one (otherwise the empty chunks are free slots and the real ones, with their
tokens, pile up on a few groups).

- ``contiguous``: group g holds one contiguous run of the real chunks.
- ``zigzag``: with 2G chunks per round, group g holds chunks g and 2G-1-g of each round.
- ``lpt``: longest processing time first (chunks go costliest-first to the least-loaded group that has room), then
  swaps (:func:`_improve`): first the previous balancer's own (the busiest group's one-for-one swap that lowers it
  most), so that it never ends more than the search's stopping tolerance (0.1% of the mean) above where that one
  did, then, where none is left, swaps that bring two groups
  closer (one-for-one, then two-for-two), which open new ones for the busiest group.  With 2G equal chunks of one
  causal sequence it is zigzag's balance (every group the same work).

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
    return [sorted(m) + [None] * (slots - len(m)) for m in members]  # (in chunk order, as the swaps' tie-break)


def _improve(costs: Sequence[int], members: list[list], max_rounds: int) -> list[int]:
    """Swaps that lower the busiest group's load, and where none does, swaps that bring two groups' loads closer;
    the maximum never rises.  Returns the loads.  Each round makes one swap:

    1. the one-for-one swap of the busiest group with any other (past ``_PARTNERS`` groups, with the ``_PARTNERS``
       least loaded: a round's cost does not grow with cp) that leaves the pair's larger load smallest, below the
       busiest load, the first in slot and group order on a tie: the previous balancer's own rule, so that from the
       same start this one stops no higher (up to the tolerance below);
    2. else the one that lowers the sum of squared loads most, between the busiest group and the
       ``_CLOSER_PARTNERS`` least loaded or the ``_CLOSER_PARTNERS`` most loaded and the least loaded group; then
       two-for-two among the same pairs where groups hold at most ``_PAIR_SWAP_SLOTS`` chunks (a chain of single
       swaps cannot always reach what one double swap does: the big chunks of one long document spread over the
       groups).

    The search stops within ``_GOOD_ENOUGH`` of the mean."""
    groups = len(members)
    cost = [[0 if i is None else costs[i] for i in m] for m in members]
    load = [sum(c) for c in cost]
    good_enough = sum(load) / groups * (1 + _GOOD_ENOUGH)
    pairs_too = len(members[0]) <= _PAIR_SWAP_SLOTS
    k = min(_PARTNERS, groups - 1)
    for _ in range(max_rounds):
        order = sorted(range(groups), key=lambda g: (load[g], g))
        top = max(range(groups), key=lambda g: (load[g], -g))  # (the lowest index among the busiest)
        if load[top] <= good_enough:
            break
        partners = sorted(order[:k]) if k < groups - 1 else [g for g in range(groups) if g != top]
        move = _lower_the_top(cost, members, load, top, partners)
        if move is None:
            low = order[0]
            kb = min(_CLOSER_PARTNERS, groups - 1)
            pairs = ([(top, g) for g in order[:kb] if g != top]
                     + [(g, low) for g in order[-1 - kb:] if g not in (top, low)])
            for moves in (_single_slots, _slot_pairs) if pairs_too else (_single_slots,):
                for hi, lo in pairs:
                    spread = load[hi] - load[lo]
                    if spread > 1:
                        hole_to_hi = None not in members[hi]  # (a group holds one hole at most)
                        found = _best_swap(moves(cost[hi], members[hi], False),
                                           moves(cost[lo], members[lo], hole_to_hi), spread)
                        if found is not None and (move is None or found[0] > move[0]):
                            move = (found[0], hi, found[1], lo, found[2])
                if move is not None:  # (two-for-two only where no single swap helps: it costs far more)
                    break
        if move is None:
            break
        _, hi, slots_hi, lo, slots_lo = move
        for sa, sb in zip(slots_hi, slots_lo):
            delta = cost[hi][sa] - cost[lo][sb]
            members[hi][sa], members[lo][sb] = members[lo][sb], members[hi][sa]
            cost[hi][sa], cost[lo][sb] = cost[lo][sb], cost[hi][sa]
            load[hi] -= delta
            load[lo] += delta
    return load


def _lower_the_top(cost: list, members: list, load: list, top: int, partners: list):
    """(_, top, (slot,), partner, (slot,)): the one-for-one swap of ``top`` with one of ``partners`` whose pair's
    larger load is smallest and below ``load[top]``, the first in (top's slot, partner, partner's slot) order on a
    tie; or None.  (In one pair the smallest larger load is :func:`_best_swap`'s move, closest to half the spread.)"""
    best = None  # (pair maximum, slots in top, partner, slots in partner)
    hole_ok = None not in members[top]  # (a group holds one hole at most)
    for g in sorted(partners, key=lambda g: (load[g], g)):  # the widest spreads first
        spread = load[top] - load[g]
        if spread <= 0 or (best is not None and load[top] - spread // 2 > best[0]):
            break  # (no swap with this group or a busier one gets below load[top] - spread / 2)
        found = _best_swap(_single_slots(cost[top], members[top], False),
                           _single_slots(cost[g], members[g], hole_ok), spread)
        if found is not None:
            _, sa, sb = found
            delta = cost[top][sa[0]] - cost[g][sb[0]]
            key = (max(load[top] - delta, load[g] + delta), sa, g, sb)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    _, sa, g, sb = best
    return None, top, sa, g, sb


_PAIR_SWAP_SLOTS = 16  # two-for-two swaps look at (slots choose 2)^2 pairs of a group pair, by bisection
_PARTNERS = 64  # groups the busiest one's swaps look at (rule 1): a round's cost does not grow with cp
_CLOSER_PARTNERS = 8  # groups the busiest and the least loaded pair with for rule 2
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
    loads falls by, over two), the first in (give's slots, take's slots) order on a tie; or None."""
    cand = sorted(take)  # (cost, slots): each cost's first slots first
    keys = [c for c, _ in cand]
    best = None  # (-gain, give's slots, take's slots)
    for c_give, s_give in give:
        j = bisect_left(keys, c_give - spread // 2)  # take's slots costing about c_give - spread / 2
        for near in (j - 1, j):
            if 0 <= near < len(cand) and 0 < c_give - keys[near] < spread:
                delta = c_give - keys[near]
                key = (-delta * (spread - delta), s_give, cand[bisect_left(keys, keys[near])][1])
                if best is None or key < best:
                    best = key
    return None if best is None else (-best[0], best[1], best[2])


def lpt(costs: Sequence[int], groups: int, real: Sequence[bool]) -> list[int]:
    """Longest first to the least-loaded group with room (:func:`_greedy`), then swaps (:func:`_improve`)."""
    n = len(costs)
    items = [i for i in range(n) if real[i]]
    members = _greedy(costs, groups, items, -(-len(items) // groups))
    _improve(costs, members, max_rounds=4 * n + 16)
    owner, count = [0] * n, [0] * groups
    for g, m in enumerate(members):
        for i in m:
            if i is not None:
                owner[i] = g
                count[g] += 1
    return _fill_empty(owner, count, real, n // groups)


BALANCER_FNS = {"contiguous": contiguous, "zigzag": zigzag, "lpt": lpt}
