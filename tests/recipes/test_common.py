"""What the recipes share (recipes/common.py), at unit level: the checks that run before any training."""

from __future__ import annotations

import argparse

import pytest

import common  # noqa: E402
from cp_harness import shared_pool

pytestmark = pytest.mark.timeout(120)


def _agree(rank, world, case):
    """common.check_ranks_agree on a 2-rank gloo world: rank 1 started with other options in ``case``."""
    options = dict(steps=10, seed=0, batch_size=2, lr=1e-3)
    if rank == 1 and case == "differ":
        options.update(seed=5, batch_size=4)
    try:
        common.check_ranks_agree(argparse.Namespace(**options))
    except SystemExit as err:
        return str(err)
    return None


def test_ranks_started_with_different_options_all_refuse_by_name():
    """Different --seed / --batch-size on one rank: every rank raises the same error naming them (the ranks used to
    train a silent mix, or wait in a collective until the timeout)."""
    pool = shared_pool(2)
    assert pool.run(_agree, case="same") == [None, None]
    first, second = pool.run(_agree, case="differ")
    assert first == second
    assert "the ranks were started with different options" in first
    assert "--seed 0 on ranks [0], 5 on ranks [1]" in first and "--batch-size 2 on ranks [0], 4 on ranks [1]" in first
    assert "--steps" not in first and "--lr" not in first
