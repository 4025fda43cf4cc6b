"""Mask helpers against brute force over every small alignment, with and without sliding windows."""

import itertools

import pytest
import torch

from fa4dist.kernels.mask import (
    Mask, Visibility, band_decomposition, block_visibility, causal_decomposition, visible, visible_pairs, visible_rect,
)
from oracle import flash_op_keep


def _brute(q_len, k_len, q_off, k_off, causal):
    return visible(torch.arange(q_off, q_off + q_len), torch.arange(k_off, k_off + k_len), causal)


CASES = list(itertools.product(range(0, 6), range(0, 6), range(-3, 9), range(0, 5), [False, True]))


@pytest.mark.parametrize("causal", [False, True])
def test_pairs_visibility_and_decomposition_match_brute_force(causal):
    for q_len, k_len, q_off, k_off, c in CASES:
        if c != causal:
            continue
        m = _brute(q_len, k_len, q_off, k_off, causal)
        assert visible_pairs(q_len, k_len, q_off, k_off, causal) == int(m.sum())
        vis = block_visibility(q_len, k_len, q_off, k_off, causal)
        expected = (
            Visibility.NONE if not m.any() else Visibility.FULL if m.all() else Visibility.PARTIAL
        )
        assert vis is expected, (q_len, k_len, q_off, k_off)
        covered = torch.zeros(q_len, k_len, dtype=torch.int64)
        for blk in causal_decomposition(q_len, k_len, q_off, k_off, causal):
            rows = slice(blk.q_start, blk.q_start + blk.q_len)
            keys = slice(blk.k_start, blk.k_start + blk.k_len)
            if blk.aligned_causal:
                assert blk.q_len == blk.k_len
                covered[rows, keys] += torch.tril(torch.ones(blk.q_len, blk.k_len, dtype=torch.int64))
            else:
                covered[rows, keys] += 1
        assert torch.equal(covered, m.long()), (q_len, k_len, q_off, k_off)  # each visible pair exactly once
        assert len(causal_decomposition(q_len, k_len, q_off, k_off, causal)) <= 3


# ---- sliding windows ----------------------------------------------------------------------------------------------

WINDOWS = [(-1, -1), (0, -1), (2, -1), (-1, 0), (-1, 3), (1, 2), (3, 0), (0, 0), (4, 1)]
WINDOW_CASES = list(itertools.product(range(0, 6), range(0, 6), range(-2, 5), range(0, 3)))


def _explicit(q_len, k_len, q_off, k_off, causal, window):
    """The window rule written out: key s visible to query p iff (not causal or s <= p) and p - left <= s <= p + right
    (-1: unbounded)."""
    p = torch.arange(q_off, q_off + q_len).view(-1, 1)
    s = torch.arange(k_off, k_off + k_len).view(1, -1)
    m = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        m &= s <= p
    if window[0] != -1:
        m &= s >= p - window[0]
    if window[1] != -1:
        m &= s <= p + window[1]
    return m


def _flash_rule(blk, window):
    """What flash-attn's kernel computes for a call of blk's shape with window_size=window: bottom-right aligned,
    and a window of at least seqlen_k read as unbounded."""
    return flash_op_keep(blk.q_len, blk.k_len, window)


def test_canonical_masks():
    assert Mask.canonical(False, (-1, 0)) == Mask(True)
    assert Mask.canonical(True, (3, 5)) == Mask(True, (3, -1))
    assert Mask.canonical(False, (3, 0)) == Mask(True, (3, -1))
    assert Mask.canonical(False, (3, 2)) == Mask(False, (3, 2))
    assert not Mask.canonical(True).windowed and Mask.canonical(False, (-1, 2)).windowed
    assert (Mask(True, (4, -1)).lo, Mask(True, (4, -1)).hi) == (-4, 0) and Mask().full


def test_a_mask_built_directly_checks_its_band():
    """Mask(...) checks causal and window as the contract does (window (-5, 3) was read as unbounded on the left by
    every helper here, silently); a list window becomes the tuple the helpers compare."""
    with pytest.raises(ValueError, match="window left must be an int >= -1"):
        Mask(False, (-5, 3))
    with pytest.raises(TypeError, match="window right must be an int"):
        Mask(False, (3, 2.0))
    with pytest.raises(TypeError, match="window must be a"):
        Mask(False, 3)
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        Mask(1, (-1, -1))
    assert Mask(False, [4, 0]) == Mask(False, (4, 0))
    assert Mask(False, [4, 0]).window == (4, 0)


def test_canonical_checks_its_arguments_as_a_mask_built_directly():
    """Mask.canonical read a right side of -7 as unbounded, and any truthy causal ("no", 1) as causal, silently;
    a window that is not a pair failed unpacking it, naming nothing."""
    with pytest.raises(ValueError, match="window right must be an int >= -1"):
        Mask.canonical(False, (2, -7))
    with pytest.raises(ValueError, match="window right must be an int >= -1"):
        Mask.canonical(True, (2, -7))
    with pytest.raises(TypeError, match="causal must be a bool, got str"):
        Mask.canonical("no")
    with pytest.raises(TypeError, match="window must be a"):
        Mask.canonical(False, 5)
    with pytest.raises(TypeError, match="window must be a"):
        Mask.canonical(False, (1, 2, 3))
    assert Mask.canonical(True, [3, 5]) == Mask(True, (3, -1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_window_helpers_match_brute_force(causal, window):
    from fa4dist.kernels.sdpa import flash_window

    mask = Mask.canonical(causal, window)
    for q_len, k_len, q_off, k_off in WINDOW_CASES:
        case = (q_len, k_len, q_off, k_off)
        m = _explicit(q_len, k_len, q_off, k_off, causal, window)
        assert torch.equal(_brute(q_len, k_len, q_off, k_off, mask), m), case
        assert visible_pairs(q_len, k_len, q_off, k_off, mask) == int(m.sum()), case
        vis = block_visibility(q_len, k_len, q_off, k_off, mask)
        assert vis is (Visibility.NONE if not m.any() else Visibility.FULL if m.all() else Visibility.PARTIAL), case
        rect = visible_rect(q_len, k_len, q_off, k_off, mask)
        if not m.any():
            assert rect is None and band_decomposition(q_len, k_len, q_off, k_off, mask) == []
            continue
        rows, keys = m.any(1).nonzero().flatten(), m.any(0).nonzero().flatten()
        assert (rect.q_start, rect.q_len) == (int(rows[0]), int(rows[-1] - rows[0] + 1)), case
        assert (rect.k_start, rect.k_len) == (int(keys[0]), int(keys[-1] - keys[0] + 1)), case
        covered = torch.zeros(q_len, k_len, dtype=torch.int64)
        blocks = band_decomposition(q_len, k_len, q_off, k_off, mask)
        assert len(blocks) <= 2
        for blk in blocks:
            sub = m[blk.q_start:blk.q_start + blk.q_len, blk.k_start:blk.k_start + blk.k_len]
            assert sub.any(1).all(), (case, blk)  # every launched row sees a key
            assert torch.equal(_flash_rule(blk, flash_window(blk)), sub), (case, blk)
            covered[blk.q_start:blk.q_start + blk.q_len, blk.k_start:blk.k_start + blk.k_len] += sub.long()
        assert torch.equal(covered, m.long()), case  # each visible pair exactly once
        if not mask.windowed:
            covered.zero_()
            for blk in causal_decomposition(q_len, k_len, q_off, k_off, mask):
                sub = torch.ones(blk.q_len, blk.k_len, dtype=torch.int64)
                covered[blk.q_start:blk.q_start + blk.q_len, blk.k_start:blk.k_start + blk.k_len] += (
                    sub.tril() if blk.aligned_causal else sub)
            assert torch.equal(covered, m.long()), case
