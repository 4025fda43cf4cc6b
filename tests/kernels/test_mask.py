"""Mask helpers against brute force over every small alignment."""

import itertools

import pytest
import torch

from fa4dist.kernels.mask import Visibility, block_visibility, causal_decomposition, visible, visible_pairs


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
