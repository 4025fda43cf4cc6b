"""Where flash-attn's calls find each sequence's rows: a packed buffer (sequence b from row ``first[b]``), a batched
tensor (sequence b in batch row ``rows[b]``: a KV cache with ``cache_batch_idx``) or a paged cache (position i of
sequence b in row ``i % page_size`` of page ``table[b, i // page_size]``).  Each gives the index of (sequence,
position) pairs into its tensors' leading dims, so one gather packs any sequences' rows for one packed
:func:`fa4dist.attention` call, and one indexed write appends to a cache or places a packed result back."""

from __future__ import annotations

from typing import Sequence

import torch


def per_sequence_integers(value, batch: int, dims: int = 1) -> bool:
    """Whether ``value`` is a ``dims``-D integer tensor with one row per sequence of the batch (cache_seqlens,
    seqused_*, a block or page table)."""
    return isinstance(value, torch.Tensor) and value.dim() == dims and value.shape[0] == batch \
        and not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)


def packed_order(starts: Sequence[int], lengths: Sequence[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of every packed row: sequence b's positions ``starts[b] .. starts[b] + lengths[b] - 1``,
    in sequence order."""
    count = torch.tensor(list(lengths), device=device, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(count), device=device), count)
    first = torch.cumsum(count, 0) - count  # each sequence's first packed row
    pos = torch.arange(seq.numel(), device=device) - first[seq] + torch.tensor(list(starts), device=device,
                                                                                dtype=torch.int64)[seq]
    return seq, pos


class Rows:
    """Tensors whose leading dims hold sequences' rows; subclasses say how (:meth:`at`)."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors
        self.device = tensors[0].device

    def at(self, seq: torch.Tensor, pos: torch.Tensor) -> tuple:
        """The index of (sequence ``seq``, position ``pos``) pairs into the tensors' leading dims."""
        raise NotImplementedError

    def gather(self, starts: Sequence[int], lengths: Sequence[int]) -> tuple:
        """Each tensor's rows of positions ``[starts[b], starts[b] + lengths[b])`` of every sequence b, packed in
        order (differentiable: a gradient goes back to the rows read)."""
        at = self.at(*packed_order(starts, lengths, self.device))
        return tuple(t[at] for t in self.tensors)


class Batched(Rows):
    """(batches, seqlen, ...) tensors: sequence b is batch row ``rows[b]`` (default: b)."""

    def __init__(self, *tensors: torch.Tensor, rows: torch.Tensor | None = None):
        super().__init__(*tensors)
        self.rows = rows if rows is not None else torch.arange(tensors[0].shape[0], device=self.device)
        self.capacity = tensors[0].shape[1]

    def at(self, seq, pos):
        return self.rows[seq], pos


class Packed(Rows):
    """(total, ...) tensors: sequence b's position i is row ``first[b] + i``."""

    def __init__(self, *tensors: torch.Tensor, first: Sequence[int]):
        super().__init__(*tensors)
        self.first = torch.tensor(list(first), device=self.device, dtype=torch.int64)

    def at(self, seq, pos):
        return (self.first[seq] + pos,)


class Paged(Rows):
    """Paged caches (num_pages, page_size, ...) with a page table (batch, max_pages_per_seq): sequence b's position
    i is row ``i % page_size`` of page ``table[b, i // page_size]``.  ``call`` and ``table_name`` name the caller's
    call and argument in errors."""

    def __init__(self, call: str, table_name: str, k, v, table, batch: int):
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{call}: with {table_name}, the paged {name} cache must be (num_pages, page_size, "
                                 f"kv_heads, head_dim), got {got}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"{call}: the paged k {tuple(k.shape)} and v {tuple(v.shape)} caches must hold the same "
                             "(num_pages, page_size, kv_heads)")
        if not per_sequence_integers(table, batch, dims=2):
            got = f"{table.dtype} of shape {tuple(table.shape)}" if isinstance(table, torch.Tensor) \
                else type(table).__name__
            raise ValueError(f"{call}: {table_name} must be a ({batch}, max_pages_per_seq) integer tensor, got {got}")
        super().__init__(k, v)
        self.call, self.table_name = call, table_name
        self.table = table.to(device=self.device, dtype=torch.int64)
        self.page = k.shape[1]
        self.capacity = table.shape[1] * self.page  # (the positions a table row addresses)

    def at(self, seq, pos):
        return self.table[seq, pos // self.page], pos % self.page

    def check_pages(self, ends: Sequence[int]) -> None:
        """Every page sequence b's positions ``[0, ends[b])`` use is one of the caches' pages."""
        for b, e in enumerate(ends):
            if e > self.capacity:
                raise ValueError(f"{self.call}: sequence {b} takes {e} cache positions, past the {self.capacity} its "
                                 f"{self.table_name} row addresses ({self.table.shape[1]} pages of {self.page})")
        used = torch.arange(self.table.shape[1], device=self.device)[None, :] * self.page \
            < torch.tensor(list(ends), device=self.device, dtype=torch.int64)[:, None]
        pages = self.tensors[0].shape[0]
        bad = used & ((self.table < 0) | (self.table >= pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{self.call}: {self.table_name}[{b}, {j}]={int(self.table[b, j])} is not one of the "
                             f"caches' {pages} pages")
