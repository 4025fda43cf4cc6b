"""Split plans: which tiles of a few-wave launch run as parts over their inner loop (FwdConfig.split_tail, and the
backward's BwdConfig.split_keys), from the shapes and the SM count alone, so that a call's bits repeat run to run.

A launch of few waves ends with its longest work: the non-causal forward with its last partial wave of equal
tiles (split_plan: those tiles' parts claimed last), a causal launch with its longest tiles (longest_first_split:
their parts claimed first). A part's partial result goes to an fp32 scratch, and the part that finishes last merges
(forward) or sums (backward) them in part order. The costs are in one step of the kernel's loop (a key block of a
forward tile, a query tile of a backward key tile), measured on the H200 (bench/RESULTS.md).
"""

from __future__ import annotations

import functools
import heapq

def split_tile_count(causal: bool, num_tiles, split_edge):
    """How many of a launch's ``num_tiles`` tiles its plan's ``split_edge`` splits: causal the first
    ``split_edge`` (the longest, their parts claimed first: tile_scheduler.parts_first), non-causal those from
    ``split_edge`` on (the last partial wave, claimed last: parts_last). Plain arithmetic, so that the host's
    scratch and counters and the kernels' launch-order counts take it alike."""
    return split_edge if causal else num_tiles - split_edge


def launch_items(causal: bool, num_tiles, split_edge, split_parts):
    """The launch-order indices of a split launch: every tile once, a split one once per part."""
    return num_tiles + split_tile_count(causal, num_tiles, split_edge) * (split_parts - 1)


# split_plan's cost model, in key blocks of one CTA's time: a part's fixed cost (its Q load and pipeline fill, its
# partial (out, lse) write) and the last part's merge read per part; parts of fewer than SPLIT_MIN_PART_BLOCKS
# blocks are not made, nor more than SPLIT_MAX_PARTS parts, and a split must bring the tail's modelled time below
# SPLIT_MAX_TAIL of an unsplit tile's. Only after fewer than SPLIT_MAX_WHOLE_WAVES whole waves: measured on the H200
# (thirty-second session, bench/split_tail.py, device time, hdim 128 4k-16k non-causal, against the same kernel
# unsplit) +29 / +20% after 1 whole wave, +6.5% after 3, +4% after 6, +1.4% after 9, -1.2 / -0.4% after 15 (the
# dynamic claims spread the CTAs' finish times over many waves, so a late tail is partly covered already)
SPLIT_PART_OVERHEAD_BLOCKS = 2.0
SPLIT_MERGE_BLOCKS_PER_PART = 0.25
SPLIT_MIN_PART_BLOCKS = 4
SPLIT_MAX_PARTS = 8
SPLIT_MAX_TAIL = 0.9
SPLIT_MAX_WHOLE_WAVES = 10


def split_plan(num_tiles: int, num_ctas: int, n_blocks: int, unit_steps: int = 1) -> tuple[int, int]:
    """(split_start, parts): tiles [split_start, num_tiles), the last partial wave of ``num_tiles`` equal tiles of
    ``n_blocks`` units (what the kernel divides among a tile's parts: the forward's key blocks, the backward's
    query tiles) of ``unit_steps`` steps each (the backward: its GQA group's query heads walk each query tile) on a
    grid of ``num_ctas`` CTAs, each run as ``parts`` parts over consecutive units, claimed after every whole tile.
    The tail then takes ceil(tail * parts / num_ctas) rounds of parts instead of one round of whole tiles; parts =
    1 (no split) unless that is cheaper by the cost model above and fewer than SPLIT_MAX_WHOLE_WAVES whole waves
    come before it.
    Integer inputs only, so that a call's plan follows its shapes and the SM count alone: the same bits run to run."""
    tail = num_tiles % num_ctas
    best_parts, best_cost = 1, SPLIT_MAX_TAIL * n_blocks * unit_steps
    if tail == 0 or num_tiles // num_ctas >= SPLIT_MAX_WHOLE_WAVES:
        return num_tiles, 1
    for parts in range(2, SPLIT_MAX_PARTS + 1):
        if n_blocks // parts * unit_steps < SPLIT_MIN_PART_BLOCKS:  # the smallest part (a kernel's n * p // parts)
            break
        rounds = -(-tail * parts // num_ctas)
        cost = (rounds * (-(-n_blocks // parts) * unit_steps + SPLIT_PART_OVERHEAD_BLOCKS)
                + SPLIT_MERGE_BLOCKS_PER_PART * parts)
        if cost < best_cost:
            best_parts, best_cost = parts, cost
    return (num_tiles - tail, best_parts) if best_parts > 1 else (num_tiles, 1)


# causal_split_plan: only launches of fewer than this many waves of tiles (longest first, the dynamic claims
# balance a causal launch of two waves or more already: its longest tile is at most one CTA's share). Its costs, in
# key blocks: every tile or part SPLIT_CAUSAL_ITEM_BLOCKS blocks of 128 rows more (its launch share, Q load and
# pipeline fill: a time, so fewer of a taller tile's blocks), a part SPLIT_PART_OVERHEAD_BLOCKS more again, the
# last part SPLIT_CAUSAL_MERGE_BLOCKS_PER_PART per part: fitted to the first measurement (H200, thirty-third
# session, bench/split_tail.py --causal, device time, hdim 128, halves of the longest rows: +18 / +1 / +62 / +44 /
# +43 / +7% at 4 x 4k / 8 x 2k / 1 x 16k / 2 x 8k / 3 x 4k / 5 x 4k heads x tokens; the fit gives +19 / +5 / +66 /
# +41 / +48 / +6%, the first model without the fixed cost +52 / +45 / +88 / +73 / +73 / +23%). The refitted plans
# then measured +29 / +14 / +62 / +39 / +42 / +12% (predicted +32 / +17 / +66 / +41 / +48 / +12%), 1 x 4k in
# quarters +78% (+85%), 2 x 4k in thirds +67% (+76%); hdim 64's 192-row tiles +37 / +58% at 4 x 4k / 2 x 8k in
# halves, +70% at 2 x 8k in thirds (call 1), which the fixed cost in 128-row blocks picks
SPLIT_CAUSAL_MAX_WAVES = 2
SPLIT_CAUSAL_ITEM_BLOCKS = 5.0
SPLIT_CAUSAL_MERGE_BLOCKS_PER_PART = 1.0


@functools.lru_cache(maxsize=256)
def causal_split_plan(num_heads_batch: int, seqlen_q: int, seqlen_k: int, diag: int, tile_m: int, tile_n: int,
                      num_ctas: int) -> tuple[int, int]:
    """(split_tiles, parts) of a dense causal launch: its first ``split_tiles`` tiles in the split launch's order
    (every head's longest tile, then every head's second longest, ...: tile_scheduler.fwd_work_tile's
    longest_first_over_heads) run as ``parts`` parts over consecutive key blocks, claimed before the other tiles,
    which follow whole; (0, 1): no split. A launch of one wave or less ends with its longest tile, twice the
    average at equal sequences, which the parts spread over the SMs.

    The choice simulates the dynamic claims (each CTA takes the next item in launch order when it finishes one) in
    split_plan's units, with the costs above (SPLIT_CAUSAL_*); whole rows of tiles (every head's m-th tile) are
    split, into parts of at least SPLIT_MIN_PART_BLOCKS blocks, and a split must bring the modelled time below
    SPLIT_MAX_TAIL of the unsplit launch's. A function of the shapes and the SM count alone, so that a call's bits
    repeat run to run (cached: a launch pays for the simulation once per shape)."""
    num_m = -(-seqlen_q // tile_m)
    if num_m * num_heads_batch >= SPLIT_CAUSAL_MAX_WAVES * num_ctas:
        return 0, 1
    n_k = -(-seqlen_k // tile_n)
    # key blocks of query tile m (block_info.n_block_max: the keys its last row sees)
    blocks = [min(n_k, -(-max(min(seqlen_q, (m + 1) * tile_m) + diag, 0) // tile_n)) for m in range(num_m)]
    return longest_first_split(tuple(blocks[::-1]), num_heads_batch, num_ctas,
                               SPLIT_CAUSAL_ITEM_BLOCKS * 128 / tile_m)


def longest_first_split(lengths: tuple, num_heads_batch: int, num_ctas: int, fixed: float,
                        unit_steps: int = 1) -> tuple[int, int]:
    """(split tiles, parts) of a launch of ``num_heads_batch`` equal heads (or (batch, head) pairs) whose tiles,
    in the units the kernel divides among a tile's parts (the forward's key blocks, the backward's query tiles) of
    ``unit_steps`` steps each, are ``lengths`` longest first (the same in every head), claimed in the order every
    head's longest, every head's second longest, ...: the longest rows of tiles that the simulated dynamic claims
    (each CTA takes the next item when it finishes one) say to run as parts, claimed first; (0, 1): no split.
    Costs: every tile or part ``fixed`` steps more, a part SPLIT_PART_OVERHEAD_BLOCKS more again, the last part
    SPLIT_CAUSAL_MERGE_BLOCKS_PER_PART per part; parts of at least SPLIT_MIN_PART_BLOCKS steps, at most
    SPLIT_MAX_PARTS, and the split must bring the modelled time below SPLIT_MAX_TAIL of the unsplit launch's."""
    def makespan(costs) -> float:
        free = [0.0] * num_ctas  # a heap of the CTAs' finish times
        for c in costs:
            heapq.heapreplace(free, free[0] + c)
        return max(free)

    part_fixed = fixed + SPLIT_PART_OVERHEAD_BLOCKS
    whole = [n * unit_steps + fixed for n in lengths for _ in range(num_heads_batch)]
    best_cost = SPLIT_MAX_TAIL * makespan(whole)
    best = (0, 1)
    for parts in range(2, SPLIT_MAX_PARTS + 1):
        for rows in range(1, len(lengths) + 1):  # the longest ``rows`` tiles of every head split
            if lengths[rows - 1] // parts * unit_steps < SPLIT_MIN_PART_BLOCKS:  # its smallest part
                break
            part_costs = []
            for n in lengths[:rows]:
                one = [((p + 1) * n // parts - p * n // parts) * unit_steps + part_fixed for p in range(parts)]
                one[-1] += SPLIT_CAUSAL_MERGE_BLOCKS_PER_PART * parts
                part_costs += one * num_heads_batch
            cost = makespan(part_costs + whole[rows * num_heads_batch:])
            if cost < best_cost:
                best_cost, best = cost, (rows * num_heads_batch, parts)
    return best


# split_keys_plan: every key tile or part SPLIT_KEYS_ITEM_STEPS 64-row query steps more (a time: fewer of a taller
# step), the part and merge costs the forward's. 4 steps is the forward's fixed cost converted (a backward step of
# 64 rows is ~1.25 of the forward's 128 x 128 blocks). Measured on the H200 (thirty-third session,
# bench/split_tail.py --direction bwd --causal, device time): +28 / +72 / +53 / +49 / +14% at hdim 128 4 x 4k / 1 x
# 16k / 2 x 8k / 3 x 4k / 8 x 2k heads x tokens, +29 / +43% at hdim 64 4 x 4k / 2 x 8k, against +45 / +86 / +69 /
# +70 / +29% and +42 / +54% modelled. A refit to those gains (10 steps) modelled them within 3-12 points but chose
# fewer split rows, which measured worse everywhere: +24 / +11% at hdim 128 4 x 4k / 8 x 2k, +26 / +34% at hdim 64
# (bench/RESULTS.md); so 4 stays
SPLIT_KEYS_ITEM_STEPS = 4.0
@functools.lru_cache(maxsize=256)
def split_keys_plan(num_kv_heads_batch: int, group: int, seqlen_q: int, seqlen_k: int, diag: int, tile_m: int,
                    tile_n: int, num_ctas: int) -> tuple[int, int]:
    """(split key tiles, parts) of a dense causal backward launch (BwdConfig.split_keys): its first key tiles in
    the split launch's order (key tile 0 of every (batch, kv head), then key tile 1, ...:
    tile_scheduler.bwd_work_tile's longest_first_over_heads) run as ``parts`` parts over their query tiles,
    claimed first; (0, 1): no split. A key tile walks ``group`` query heads' query tiles (GQA); its parts divide
    the query tiles (bwd_sm90.work_at), each walked by every head of the group. The same simulation and rules as
    causal_split_plan (longest_first_split)."""
    n_k = -(-seqlen_k // tile_n)
    if n_k * num_kv_heads_batch >= SPLIT_CAUSAL_MAX_WAVES * num_ctas:
        return 0, 1
    num_m = -(-seqlen_q // tile_m)

    def query_tiles(n: int) -> int:  # query tiles key tile n visits (block_info.query_tiles), per query head
        q0 = max(n * tile_n - diag, 0)  # the first query that sees a key of the tile
        return num_m - q0 // tile_m if q0 < seqlen_q else 0

    return longest_first_split(tuple(query_tiles(n) for n in range(n_k)), num_kv_heads_batch, num_ctas,
                               SPLIT_KEYS_ITEM_STEPS * 64 / tile_m, unit_steps=group)
