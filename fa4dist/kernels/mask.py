"""Mask semantics: the one definition of which key a query may see.

A block of ``q_len`` queries and ``k_len`` keys is placed in its sequence (or document) by global offsets: query
``i`` sits at position ``q_offset + i`` and key ``j`` at ``k_offset + j``.  Without ``causal`` every key is visible;
with ``causal`` key ``j`` is visible to query ``i`` iff ``k_offset + j <= q_offset + i``.  Packed documents are
separate segments (``cu_seqlens``); a query never sees a key of another segment.

Everything else on the host (the reference backend, the decomposition the fused torch ops need, block skipping in
ring attention, the LPT cost model) is derived from the functions here; the CuTe kernels apply the same rule on
the device (key j visible iff j <= i + q_offset - k_offset).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Visibility(enum.Enum):
    NONE = 0  # no query sees any key: skip the block
    FULL = 1  # every query sees every key: no mask needed
    PARTIAL = 2  # some pairs masked


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean (len(q_pos), len(k_pos)) matrix of visible pairs for global positions in one segment."""
    if not causal:
        return torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
    return k_pos.view(1, -1) <= q_pos.view(-1, 1)


def first_visible_row(q_len: int, q_offset: int, k_offset: int, causal: bool) -> int:
    """Index of the first query that sees at least one key (q_len if none does, for a non-empty key block)."""
    if not causal:
        return 0
    return min(q_len, max(0, k_offset - q_offset))


def block_visibility(q_len: int, k_len: int, q_offset: int, k_offset: int, causal: bool) -> Visibility:
    if q_len == 0 or k_len == 0:
        return Visibility.NONE
    if not causal:
        return Visibility.FULL
    last_key, first_query, last_query = k_offset + k_len - 1, q_offset, q_offset + q_len - 1
    if k_offset > last_query:
        return Visibility.NONE
    if last_key <= first_query:
        return Visibility.FULL
    return Visibility.PARTIAL


def visible_pairs(q_len: int, k_len: int, q_offset: int, k_offset: int, causal: bool) -> int:
    """Number of visible (query, key) pairs of a block, in closed form."""
    if q_len <= 0 or k_len <= 0:
        return 0
    if not causal:
        return q_len * k_len
    # Query i sees min(k_len, max(0, i + d + 1)) keys, with d = q_offset - k_offset.
    d = q_offset - k_offset
    first = max(0, -d)  # first row that sees a key
    if first >= q_len:
        return 0
    partial_end = min(max(k_len - d - 1, first), q_len)  # rows [first, partial_end) see a prefix of the keys
    n = partial_end - first
    partial = n * (d + 1) + (first + partial_end - 1) * n // 2
    return partial + (q_len - partial_end) * k_len


@dataclass(frozen=True)
class SubBlock:
    """A rectangle of a block that a kernel without offsets can compute.

    ``aligned_causal`` blocks are square with the diagonal on query i == key i (what every fused kernel's
    ``is_causal`` means for equal lengths); the other blocks are fully visible."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    aligned_causal: bool


def causal_decomposition(q_len: int, k_len: int, q_offset: int, k_offset: int, causal: bool) -> list[SubBlock]:
    """Splits a block of any alignment into at most three sub-blocks: fully visible rectangles and one aligned
    causal square.  Rows that appear in no sub-block see no key at all; rows in two sub-blocks merge them."""
    vis = block_visibility(q_len, k_len, q_offset, k_offset, causal)
    if vis is Visibility.NONE:
        return []
    if vis is Visibility.FULL:
        return [SubBlock(0, q_len, 0, k_len, False)]
    d = q_offset - k_offset
    first = max(0, -d)
    diag_end = min(q_len, k_len - d)  # the diagonal key i + d leaves the block at row k_len - d
    blocks = []
    if diag_end > first:
        if first + d > 0:  # keys left of the diagonal are visible to all the diagonal's rows
            blocks.append(SubBlock(first, diag_end - first, 0, first + d, False))
        blocks.append(SubBlock(first, diag_end - first, first + d, diag_end - first, True))
    full_start = max(first, diag_end)
    if full_start < q_len:  # rows below the block's last key see every key
        blocks.append(SubBlock(full_start, q_len - full_start, 0, k_len, False))
    return blocks
