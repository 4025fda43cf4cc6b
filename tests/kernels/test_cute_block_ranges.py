"""The kernels' block ranges (kernels/cute/block_info.py) on the CPU: the integer rules run as plain Python.

For random sequence lengths, diagonals and windows (none, narrower than a tile, wider than two): every visible
(query, key) pair lies in a key block the forward visits and in a query tile the backward visits, no block is
visited twice, and the blocks either walks without mask math (the forward's plain phase, the backward's
[m_mask_end, m_window_start)) hold no masked pair: neither the diagonal, nor the window's lower edge, nor the
sequence end cuts them. Checked per block from its row and key intervals, so a case costs microseconds."""

import random

import pytest

pytest.importorskip("cutlass")

from fa4dist.kernels.cute.block_info import BlockInfo, SeqlenInfo  # noqa: E402

# the range rules without the DSL's tracing (on Python ints they are plain integer arithmetic)
key_blocks = BlockInfo.key_blocks.__wrapped__
query_tiles = BlockInfo.query_tiles.__wrapped__

# (tile_m, tile_n): the forward at hdim 128 / 64 / 256, the backward's 64-row query tiles
TILES = [(128, 128), (192, 128), (128, 64), (64, 128)]


def masked_in(q0, q1, k0, k1, diag, wl, sk):
    """Whether the block of queries [q0, q1] and keys [k0, k1] holds a masked pair (the diagonal, the window's
    lower edge or the sequence end cuts it)."""
    return k1 > q0 + diag or k1 >= sk or (wl >= 0 and k0 < q1 + diag - wl)


def forward_blocks(info, s, m, ranges=key_blocks):
    """The key blocks query tile m visits, in order, each with its phase: first, band, plain or window."""
    _, n_min, n_max, n_causal, n_window_end = (int(x) for x in ranges(info, s, m))  # (the DSL's Int32s)
    if n_max <= n_min:
        return []
    n_masked, n_plain, n_window = (int(x) for x in info.phases(n_min, n_max, n_causal, n_window_end))
    blocks = [(n_max - 1, "first")] + [(n_max - 2 - i, "band") for i in range(n_masked)]
    blocks += [(n_min + n_window + n_plain - 1 - i, "plain") for i in range(n_plain)]
    return blocks + [(n_min + n_window - 1 - i, "window") for i in range(n_window)]


def visible_keys(q, diag, wl, sk):
    """Query q's visible keys as an interval [lo, hi] (empty when lo > hi)."""
    return max(0, q + diag - wl) if wl >= 0 else 0, min(sk - 1, q + diag)


def check(tm, tn, wl, sq, sk, diag, ranges=key_blocks):
    info, s = BlockInfo(tm, tn, True, wl), SeqlenInfo(0, 0, sq, sk, diag)
    for m in range(-(-sq // tm)):
        blocks = forward_blocks(info, s, m, ranges)
        visited = {n for n, _ in blocks}
        assert len(visited) == len(blocks), ("a key block visited twice", m)
        q0, q1 = m * tm, min(m * tm + tm, sq) - 1
        for n, phase in blocks:
            if phase == "plain":
                assert not masked_in(q0, q1, n * tn, n * tn + tn - 1, diag, wl, sk), ("masked plain block", m, n)
        for q in range(q0, q1 + 1):
            lo, hi = visible_keys(q, diag, wl, sk)
            assert all(n in visited for n in range(lo // tn, hi // tn + 1)) if lo <= hi else True, ("missed", q)
    for n in range(-(-sk // tn)):
        has_work, m_min, m_mask_end, m_window_start, m_max = (int(x) for x in query_tiles(info, s, n, True))
        k0, k1 = n * tn, n * tn + tn - 1
        for q in range(sq):
            lo, hi = visible_keys(q, diag, wl, sk)
            if max(lo, k0) <= min(hi, k1):  # q sees a key of tile n
                assert has_work and m_min <= q // tm < m_max, ("the backward misses", n, q)
        for m in range(m_mask_end, m_window_start) if has_work else ():
            q0, q1 = m * tm, min(m * tm + tm, sq) - 1
            assert not masked_in(q0, q1, k0, k1, diag, wl, sk), ("masked plain query tile", n, m)


@pytest.mark.parametrize("tm, tn", TILES)
def test_blocks_cover_every_visible_pair_and_plain_blocks_need_no_mask(tm, tn):
    rng = random.Random(tm * 1000 + tn)
    for wl in (None, 0, 37, tn - 1, tm + tn, 700):  # None: causal without a window
        for _ in range(4):
            check(tm, tn, -1 if wl is None else wl, rng.randint(1, 800), rng.randint(1, 900),
                  rng.randint(-400, 600))


def test_the_check_catches_a_missed_block():
    """The check is not vacuous: key ranges that drop a window's lowest block fail it."""

    def narrow(info, seqlen, m_block):
        valid, n_min, n_max, n_causal, n_window_end = key_blocks(info, seqlen, m_block)
        return valid, min(int(n_min) + 1, int(n_max)), n_max, n_causal, n_window_end

    with pytest.raises(AssertionError, match="missed"):
        check(128, 128, 300, 1024, 1024, 0, ranges=narrow)
