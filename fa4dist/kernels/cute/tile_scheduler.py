"""Which work tile a CTA computes: the decode of blockIdx.x into (block, head, batch) for both kernels.

Both kernels launch one CTA per work tile, or a persistent grid of one CTA per SM, each walking tiles of the same
launch order, so that the next tile's loads overlap the current one's epilogue: tiles claimed from a counter
(``TileClaims``), or in the forward the static walk (``persistent_turn``, a measurement knob). The forward's tile
is a query tile of one (head, sequence); the backward's is a key tile of one (kv head, sequence). The launch order
is part of the design: causal forward tiles go longest first (long and short alternating for short dense
sequences), with heads grouped so that their K/V stay in L2;
deterministic backward tiles go in the order that keeps the dQ semaphore chains short and deadlock-free. A
work-list launch (several (query range, key range, offsets, mask) items, fa4dist.kernels.worklist) keeps these
decoders: its items take the place of a packed call's sequences (``batch`` is the item; block_info.SeqlenInfo reads
its rows from the item table), so each item's tiles keep the order above, and the items go in table order (largest
first).

This module imports cutlass at import time: import it lazily.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class WorkTile:
    """The tile one CTA computes: ``block`` (query tile for the forward, key tile for the backward), heads and
    sequence; ``valid`` is False for padding CTAs of a rounded-up grid. (Frozen: read-only in dynamic control
    flow.)"""

    block: Any
    head: Any  # forward: the query head; backward: None (the CTA loops over the heads of its group)
    head_kv: Any
    batch: Any
    num_heads: Any
    group: Any  # query heads per kv head
    valid: Any = True


def persistent_turn(turn: Int32, num_ctas: Int32) -> Int32:
    """The tile index a CTA of a persistent grid (``num_ctas`` CTAs) takes at its ``turn``-th tile: waves of
    ``num_ctas`` consecutive tiles of the launch order, every second wave walked backwards (a snake), so that with
    tiles ordered longest first each CTA's sum of lengths evens out (a plain stride would give CTA 0 the longest
    tile of every wave). May be past the last tile in the last wave: the caller skips it."""
    bid, _, _ = cute.arch.block_idx()
    col = bid + (turn % 2) * (num_ctas - 1 - 2 * bid)  # odd turns: num_ctas - 1 - bid
    return turn * num_ctas + col


@dataclass(frozen=True)
class TileClaims:
    """The dynamic walk of a persistent grid: a CTA's first tile is its blockIdx.x; the producer warp claims each
    next one from a global (1,) int32 counter, zero at launch (grid size + the claims before it, so tiles go out in
    launch order, first come first served: the greedy balance of the hardware's block scheduler), and hands it to the
    CTA's other warps through a two-slot smem pipeline. A claim past the last tile tells every warp to stop.

    ``claim_first`` (walk): the first tile is claimed from the counter too (claims then count from 0). Every tile
    is then held by a CTA that runs, and tiles are claimed in launch order: a tile that waits on tiles launched
    before it (the deterministic backward's dQ tickets) waits on tiles whose CTAs are running, so the grid cannot
    hang even when some of its CTAs find no SM (another process's kernels under MPS). With blockIdx.x first, a
    tile could wait on the first tile of a CTA that is not yet resident."""

    pipe: Any  # PipelineAsync over the slots: one producer thread, one arrival per reading warp
    slots: Any  # (2,) int32 smem
    counter: Any  # (1,) int32 global

    STAGES = 2

    @staticmethod
    def create(barrier_storage, slots, counter, reader_warps: int) -> "TileClaims":
        """``barrier_storage``: 2 * STAGES mbarriers; initialised without a CTA sync (the caller's
        pipeline_init_arrive / pipeline_init_wait fence them)."""
        pipe = pipeline.PipelineAsync.create(
            barrier_storage=barrier_storage, num_stages=TileClaims.STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, reader_warps), defer_sync=True)
        return TileClaims(pipe, slots, counter)

    @staticmethod
    def producer_state():
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TileClaims.STAGES)

    @staticmethod
    def reader_state():
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TileClaims.STAGES)

    @cute.jit
    def claim(self, claimed_before: Int32) -> Int32:
        """Producer warp: the next tile index (``claimed_before``: tiles handed out before the counter's first
        claim), the same in every lane."""
        t = Int32(0)
        if cute.arch.lane_idx() == 0:
            t = cute.arch.atomic_add(self.counter.iterator, Int32(1)) + claimed_before
        return cute.arch.shuffle_sync(t, 0)

    @cute.jit
    def reset_after_last(self, t: Int32, last_index: Int32):
        """Producer warp, right after a claim that returned ``t``: the launch's last claim (every CTA's final claim
        past the last tile included) returns ``last_index`` = num_tiles + num_ctas - 1 either way (one claim follows
        every tile a CTA runs, plus with claim_first one first claim per CTA, against blockIdx.x's num_ctas tiles
        without), and no claim follows it: its thread (lane 0, which made the atomic) writes the counter back to 0,
        a plain store after its own atomic on that word, so after every claim in the word's order. The next launch
        in the stream's order may then take the same counter without a fill (host.tile_counter's reusable one)."""
        if cute.arch.lane_idx() == 0:
            if t == last_index:
                self.counter[0] = Int32(0)

    @cute.jit
    def publish(self, state, t: Int32):
        """Producer warp: hands tile index ``t`` to the readers; returns the advanced state."""
        self.pipe.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            self.slots[state.index] = t
            self.pipe.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def walk(self, body, state, num_tiles: Int32, num_ctas: Int32, claimer: bool, claim_first: bool = False,
             resets: bool = False):
        """One role's walk over the CTA's tiles: ``state = body(t, state)`` for each tile index t, from this CTA's
        blockIdx.x on (``claim_first``: from its first claim on), as claimed; returns the final state. ``claimer``
        (the producer warp) claims each next tile once ``body`` has issued the current one's loads and publishes it;
        every other role receives it. ``resets``: the launch's last claim sets the counter back to 0
        (reset_after_last)."""
        if const_expr(claimer):
            tile_state = TileClaims.producer_state()
            claimed_before = num_ctas  # the counter counts claims after the grid's blockIdx.x tiles
            if const_expr(claim_first):
                claimed_before = Int32(0)
                t = self.claim(claimed_before)
                if const_expr(resets):
                    self.reset_after_last(t, num_tiles + num_ctas - 1)
            else:
                t, _, _ = cute.arch.block_idx()
            tile_state = self.publish(tile_state, t)
            while t < num_tiles:
                state = body(t, state)
                t = self.claim(claimed_before)
                if const_expr(resets):
                    self.reset_after_last(t, num_tiles + num_ctas - 1)
                tile_state = self.publish(tile_state, t)
        else:
            tile_state = TileClaims.reader_state()
            t, tile_state = self.receive(tile_state)
            while t < num_tiles:
                state = body(t, state)
                t, tile_state = self.receive(tile_state)
        return state

    @cute.jit
    def receive(self, state):
        """A reading warp: (the next tile index, the advanced state); the slot is freed at once (the index is all
        it holds)."""
        self.pipe.consumer_wait(state)
        t = self.slots[state.index]
        cute.arch.sync_warp()  # every lane has read the slot before lane 0 frees it
        if cute.arch.lane_idx() == 0:
            self.pipe.consumer_release(state)
        state.advance()
        return t, state


def row_tile_grid(grid_m, num_heads, num_batch) -> tuple:
    """The grid of a kernel with one CTA per (query tile, head, sequence) (the backward's pre- and postprocess):
    tiles and sequences share x, as the main kernels' one-dimensional grids hold them, since a grid's y and z stop
    at 65535 (a batch of 70000 short sequences did not launch). Decoded by :func:`row_tile_of`."""
    return (grid_m * num_batch, num_heads, 1)


def row_tile_of(grid_m: Int32):
    """(query tile, head, sequence) of this CTA in a :func:`row_tile_grid` launch."""
    bid, head, _ = cute.arch.block_idx()
    return bid % grid_m, head, bid // grid_m


@cute.jit
def parts_first(tile_idx: Int32, split_edge: Int32, split_parts: Int32):
    """(tile, slot, split tile) of launch index ``tile_idx`` in a causal split launch (split_plans): the first
    ``split_edge`` tiles run as ``split_parts`` parts each, claimed before the other tiles. Index i * parts + p
    (i < split_edge) is part p of tile i (slot i * parts + p, split tile i); the other tiles follow whole (slot -1,
    split tile 0)."""
    tile = tile_idx - split_edge * (split_parts - 1)
    slot = Int32(-1)
    split_tile = Int32(0)
    if tile_idx < split_edge * split_parts:
        slot = tile_idx
        split_tile = tile_idx // split_parts
        tile = split_tile
    return tile, slot, split_tile


@cute.jit
def parts_last(tile_idx: Int32, split_edge: Int32, split_parts: Int32):
    """(tile, slot, split tile) of launch index ``tile_idx`` in a split launch of equal tiles (split_plans.split_plan):
    the tiles from ``split_edge`` on (the last partial wave) run as ``split_parts`` parts each, claimed after every
    whole tile. Index split_edge + i * parts + p is part p of tile split_edge + i (slot i * parts + p, split tile
    i); the tiles before split_edge are whole (slot -1, split tile 0)."""
    tile = tile_idx
    slot = Int32(-1)
    split_tile = Int32(0)
    if tile_idx >= split_edge:
        slot = tile_idx - split_edge
        split_tile = slot // split_parts
        tile = split_edge + split_tile
    return tile, slot, split_tile


def causal_m_block(position, num_m_blocks, interleave: bool):
    """The query tile at ``position`` of a causal (head, sequence)'s launch order: longest first (highest m), or
    with ``interleave`` longest, shortest, second longest, second shortest, ... (m = n-1, 0, n-2, 1, ...): the
    tiles in flight together mix long tiles with short ones, and neighbours pair to the same work (measured faster
    for short sequences only: forward.interleaved_launch, backward.default_interleave_lengths)."""
    if const_expr(not interleave):
        return num_m_blocks - 1 - position
    half = position // 2
    odd = position - 2 * half
    return num_m_blocks - 1 - half + odd * (2 * half + 1 - num_m_blocks)  # even: n - 1 - half; odd: half


def fwd_work_tile(mQ: cute.Tensor, mK: cute.Tensor, num_m_blocks: Int32, num_batch: Int32, *, causal: bool,
                  varlen: bool, l2_rows: int, interleave: bool = False, tile_idx=None,
                  longest_first_over_heads: bool = False) -> WorkTile:
    """Forward: query tile ``block`` of (head, batch) for the launch-order index ``tile_idx`` (default: this CTA's
    blockIdx.x). Causal grids run the longest tiles (highest m) first, or alternate long and short ones
    (``interleave``, causal_m_block); the dense causal grid also groups heads so that the K/V rows of a group
    (``l2_rows``) stay resident in L2, unless ``longest_first_over_heads`` (a split launch of few waves:
    split_plans.causal_split_plan), which takes every head's longest tile first, then every head's second
    longest, ..."""
    num_heads = cute.size(mQ.shape[2])
    num_heads_kv = cute.size(mK.shape[2])
    qhead_per_kv = num_heads // num_heads_kv
    bid = tile_idx
    if const_expr(tile_idx is None):
        bid, _, _ = cute.arch.block_idx()
    num_hb = num_heads * num_batch
    m_block = Int32(0)
    hb = Int32(0)
    if const_expr(causal and not varlen and longest_first_over_heads):
        m_block = num_m_blocks - 1 - bid // num_hb
        hb = bid % num_hb
    elif const_expr(causal and not varlen):
        seqlen_k_static = cute.size(mK.shape[0])
        group = cutlass.max(l2_rows // cutlass.max(seqlen_k_static, 1), 1) * qhead_per_kv
        group = cutlass.min(group, num_hb)
        per_group = group * num_m_blocks
        gidx = bid // per_group
        r = bid - gidx * per_group
        hb_start = gidx * group
        g_eff = cutlass.min(group, num_hb - hb_start)
        m_block = causal_m_block(r // g_eff, num_m_blocks, interleave)
        hb = hb_start + r % g_eff
    elif const_expr(causal):
        hb = bid // num_m_blocks
        m_block = causal_m_block(bid - hb * num_m_blocks, num_m_blocks, interleave)
    else:
        hb = bid // num_m_blocks
        m_block = bid - hb * num_m_blocks
    batch = hb // num_heads
    head = hb - batch * num_heads
    head_kv = head // qhead_per_kv
    return WorkTile(m_block, head, head_kv, batch, num_heads, qhead_per_kv)


def bwd_work_tile(mQ: cute.Tensor, mK: cute.Tensor, n_blocks_grid: Int32, num_batch: Int32, *,
                  shortest_first: bool, det_chunk: int, interleave: bool = False, tile_idx=None,
                  longest_first_over_heads: bool = False, heads_per_group: int = 0) -> WorkTile:
    """Backward: key tile ``block`` of (kv head, batch), key tiles fastest, for the launch-order index ``tile_idx``
    (default: this CTA's blockIdx.x). ``shortest_first`` (causal deterministic; a bool, or a Boolean decided at run
    time) launches the highest key tile first, so that a CTA only ever waits on CTAs launched (or tiles claimed)
    before it; ``det_chunk`` > 0 interleaves chunks of that many key tiles of all heads (padding tiles are not
    ``valid``). ``interleave`` (causal, neither of those): long and short key tiles alternate (causal_m_block's
    order, mirrored: key tile 0 sees the most query tiles). ``longest_first_over_heads`` (a causal split launch
    of few waves, split_plans.split_keys_plan, or a causal launch of at most a few waves, backward.lpt_over_heads):
    key tile 0 of every (batch, kv head) first, then key tile 1, ...; with ``shortest_first`` mirrored (every
    head's last key tile first); ``heads_per_group`` > 0: that order within groups of so many (batch, kv head)
    pairs, one group after another (so that a group's streams stay in L2)."""
    num_heads = cute.size(mQ.shape[2])
    num_heads_kv = cute.size(mK.shape[2])
    group = num_heads // num_heads_kv
    bid = tile_idx
    if const_expr(tile_idx is None):
        bid, _, _ = cute.arch.block_idx()
    j_valid = True
    if const_expr(longest_first_over_heads and heads_per_group > 0):
        num_hb = num_heads_kv * num_batch
        per_group = heads_per_group * n_blocks_grid
        gidx = bid // per_group
        r = bid - gidx * per_group
        hb_start = gidx * heads_per_group
        g_eff = cutlass.min(heads_per_group, num_hb - hb_start)  # (the last group may be smaller)
        j = r // g_eff
        hb = hb_start + r - j * g_eff
    elif const_expr(longest_first_over_heads):
        num_hb = num_heads_kv * num_batch
        j = bid // num_hb
        hb = bid - j * num_hb
    elif const_expr(det_chunk > 0):
        num_hb = num_heads_kv * num_batch
        rest = bid // det_chunk
        c = rest // num_hb
        hb = rest - c * num_hb
        j = c * det_chunk + (bid - rest * det_chunk)
        j_valid = j < n_blocks_grid  # padding CTAs of the last chunk do nothing
    else:
        hb = bid // n_blocks_grid
        j = bid - hb * n_blocks_grid
    n_block = j
    if const_expr(interleave):
        n_block = n_blocks_grid - 1 - causal_m_block(j, n_blocks_grid, True)
    elif const_expr(shortest_first is True):
        n_block = n_blocks_grid - 1 - j
    elif const_expr(shortest_first is not False):  # decided at run time (a Boolean): 0 or 1 as an integer
        n_block = j + Int32(shortest_first) * (n_blocks_grid - 1 - 2 * j)
    batch = hb // num_heads_kv
    head_kv = hb - batch * num_heads_kv
    return WorkTile(n_block, None, head_kv, batch, num_heads, group, j_valid)
