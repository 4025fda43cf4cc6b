"""The rotated deterministic dQ order of the CuTe backward (bwd_sm90.rotation_step / rank_rotated, det_resident), as
integer arithmetic on the CPU: the kernel's formulas, restated here, must give every query tile's key tiles the
ranks 0..N-1 in the order the key tiles reach that tile, so that no key tile waits on a ticket systematically.
(The kernel itself is checked against these bytes on the GPU: test_cute_bwd_gpu.test_rotated_deterministic_order.)
"""

import pytest


def rotation_step(n_q: int, n_k: int, max_key_tiles: int) -> int:
    """bwd_sm90.rotation_step: key tile n starts at query tile c * n; 0 keeps the ascending order."""
    c = n_q // max(n_k, 1)
    return c if n_k <= n_q and n_k <= max_key_tiles else 0


def rank_rotated(n: int, m: int, n_k: int, c: int) -> int:
    """bwd_sm90.rank_rotated."""
    if c == 0:
        return n
    q = m // c
    return (min(q, n_k - 1) - n) if n <= q else (q + n_k - n)


def visit_order(n: int, n_q: int, c: int) -> list[int]:
    """bwd_sm90.FlashBwdSm90.phase_m over one phase [0, n_q): the query tiles key tile n visits, in order."""
    rot = c * n
    return [i + rot - n_q if i + rot >= n_q else i + rot for i in range(n_q)]


@pytest.mark.parametrize("n_q", range(1, 41))
def test_ranks_are_the_arrival_order(n_q):
    for n_k in range(1, 45):
        c = rotation_step(n_q, n_k, max_key_tiles=66)
        orders = [visit_order(n, n_q, c) for n in range(n_k)]
        for order in orders:
            assert sorted(order) == list(range(n_q))  # every query tile once
        for m in range(n_q):
            ranks = [rank_rotated(n, m, n_k, c) for n in range(n_k)]
            assert sorted(ranks) == list(range(n_k)), (n_q, n_k, m, ranks)
            # key tile n reaches query tile m at step orders[n].index(m): the ranks follow those steps
            arrival = sorted(range(n_k), key=lambda n: (orders[n].index(m), n))
            assert [ranks[n] for n in arrival] == list(range(n_k)), (n_q, n_k, m)
            if c:  # rotated: the arrivals are distinct steps, at least c apart
                steps = sorted(orders[n].index(m) for n in range(n_k))
                assert all(b - a >= c for a, b in zip(steps, steps[1:]))


def test_long_sequences_keep_the_ascending_order():
    """A sequence with more key tiles than fit on the GPU at once (max_key_tiles), or than query tiles, is not
    rotated: its key tiles wait only on tiles launched before them."""
    assert rotation_step(200, 100, max_key_tiles=66) == 0
    assert rotation_step(10, 20, max_key_tiles=66) == 0
    assert rotation_step(64, 32, max_key_tiles=66) == 2
    assert [rank_rotated(n, 5, 7, 0) for n in range(7)] == list(range(7))
