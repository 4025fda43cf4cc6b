"""Sharding plans: which global tokens each context-parallel rank holds.

A plan cuts the token stream (one sequence of ``seqlen`` tokens, or a packed batch of documents given by
``cu_seqlens``) into ``num_chunks`` contiguous chunks of ``chunk_size`` tokens (the last real chunk may be short and
chunks past the end are empty: any length works, the padding never reaches a kernel) and gives every rank the same
number of chunks.  A rank's local tokens are its chunks' tokens in global order.

Balancers (how chunks go to ranks):

- ``contiguous``: rank r holds one contiguous run of chunks.
- ``zigzag``: with 2c chunks per round, rank r holds chunks r and 2c-1-r of each round (the classic causal balance).
- ``lpt`` (default): every chunk is costed from the mask (the visible (query, key) pairs of its queries under
  causal and the sliding window; for packed documents only pairs within a document, see
  :func:`fa4dist.kernels.mask.visible_pairs`), then :func:`fa4dist.context_parallel.balance.lpt` assigns them
  (longest first to the least-loaded rank with room, then chunk swaps).  With 2c equal chunks of
  one causal sequence this is exactly zigzag's balance.

Every balancer but zigzag also gives each rank as many *real* chunks (chunks with tokens) as the others, within
one: chunks past the end are empty, and without that rule they are free slots where the real chunks can pile up
(contiguous: on the first ranks; LPT: the chunks of short documents, cheap in visible pairs, on a few ranks, with
all their tokens).  Empty chunks exist when the chunk size rounds the stream up by a whole chunk or more: a stream
shorter than the chunk count, or ``align`` (chunk sizes a multiple of it, as the cp_invariant training step's
canonical token blocks need).  An aligned plan holds whole ``align``-token blocks, so a short stream (few blocks per
rank) or one whose visible pairs sit in few blocks is imbalanced whatever the balancer: ``balance_report()`` gives
the bounds (:meth:`ShardPlan.aligned_floor`).

For the 2-D (Ulysses x ring) strategy, ``ulysses_degree=u`` balances over the ``cp_size / u`` ring groups (a
group's ranks share its attention work by heads) and then hands each group's chunks to its u ranks; cp rank
``ring_index * u + ulysses_index``.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Union

import torch

from ..kernels.mask import Mask, visible_pairs
from ..kernels.problem import (check_cu_seqlens_values, check_int, check_integer_dtype, check_integer_ndarray,
                               check_mask, is_ndarray, type_name)
from .balance import BALANCER_FNS, BALANCERS


@dataclass(frozen=True)
class Piece:
    """The part of one document inside one chunk (or block): ``length`` tokens starting ``start`` tokens into the
    chunk, at position ``position`` of document ``doc``."""

    doc: int
    start: int
    length: int
    position: int


@dataclass(frozen=True)
class BalanceReport:
    """Attention work per rank in visible (query, key) pairs (the cost model of the plan), and the ring steps the
    mask leaves: a member computes (and receives K/V) only at the steps where its queries see the source's keys."""

    balancer: str
    cp_size: int
    ulysses_degree: int
    num_chunks: int
    chunk_size: int
    work: tuple[int, ...]  # per cp rank
    group_work: tuple[int, ...]  # per ring group (== work when ulysses_degree == 1)
    tokens: tuple[int, ...]  # real tokens per cp rank
    mask: str  # the mask the plan was costed with
    steps_run: tuple[int, ...]  # remote ring steps (1..R-1) that some member needs; the others are skipped
    member_steps: tuple[tuple[int, ...], ...]  # per ring member: the remote steps at which it receives keys
    received: tuple[int, ...]  # per ring member: K/V tokens received over a forward (the backward: again)
    align: int  # chunk sizes are multiples of it (1: unaligned)
    # For an aligned plan (else None): the least max/mean compute over ring groups and the least max/mean tokens
    # over cp ranks that *any* plan whose chunks are multiples of `align` can reach (ShardPlan.aligned_floor).
    floor: Optional[float]
    token_floor: Optional[float]

    @property
    def ring_size(self) -> int:
        return len(self.group_work)

    @property
    def skipped_steps(self) -> tuple[int, ...]:
        """Per ring member: remote steps it neither receives at nor computes (out of R - 1)."""
        return tuple(self.ring_size - 1 - len(s) for s in self.member_steps)

    @property
    def max_work(self) -> int:
        return max(self.group_work)

    @property
    def mean_work(self) -> float:
        return sum(self.group_work) / len(self.group_work)

    @property
    def imbalance(self) -> float:
        """max / mean work over the ring groups (1.0 is perfect)."""
        return self.max_work / self.mean_work if self.mean_work else 1.0

    @property
    def token_imbalance(self) -> float:
        """max / mean real tokens over the cp ranks: the work of the layers around the attention (projections, MLP,
        loss) is per token, and for short documents it outweighs the attention's visible pairs by far."""
        mean = sum(self.tokens) / len(self.tokens)
        return max(self.tokens) / mean if mean else 1.0

    @property
    def efficiency(self) -> float:
        """mean / max: the fraction of the busiest rank's compute time the average rank is busy."""
        return 1.0 / self.imbalance

    def as_dict(self) -> dict:
        return dict(
            balancer=self.balancer, cp_size=self.cp_size, ulysses_degree=self.ulysses_degree,
            num_chunks=self.num_chunks, chunk_size=self.chunk_size, work=list(self.work),
            group_work=list(self.group_work), compute=list(self.compute), tokens=list(self.tokens),
            max_work=self.max_work,
            mean_work=self.mean_work, imbalance=self.imbalance, mask=self.mask, steps_run=list(self.steps_run),
            member_steps=[list(s) for s in self.member_steps], skipped_steps=list(self.skipped_steps),
            received=list(self.received), token_imbalance=self.token_imbalance, align=self.align, floor=self.floor,
            token_floor=self.token_floor,
        )

    @property
    def compute(self) -> tuple[float, ...]:
        """Visible pairs each cp rank computes: its ring group's work over the group's u ranks (Ulysses splits a
        group's attention by heads), the rank's own chunks' work for a plain ring."""
        u = self.ulysses_degree
        return tuple(self.group_work[r // u] / u for r in range(self.cp_size))

    def __str__(self) -> str:
        mean = sum(self.compute) / len(self.compute) if self.compute else 0.0
        lines = [
            f"balance ({self.balancer}, {self.num_chunks} chunks of {self.chunk_size} tokens, cp={self.cp_size}"
            + (f", ulysses={self.ulysses_degree}: each rank computes 1/{self.ulysses_degree} of its group's heads"
               if self.ulysses_degree > 1 else "")
            + f"): max/mean compute over ranks = {self.imbalance:.4f}",
        ]
        for r, (c, t) in enumerate(zip(self.compute, self.tokens)):
            share = c / mean if mean else 1.0
            lines.append(f"  rank {r}: {t} tokens, {c:,.0f} visible pairs computed ({share:.3f} x mean)")
        lines.append(f"tokens: max/mean over ranks = {self.token_imbalance:.4f}")
        if self.floor is not None:
            blocks = -(-sum(self.tokens) // self.align)
            groups = f"{self.ring_size} ring groups" if self.ulysses_degree > 1 else f"{self.cp_size} ranks"
            lines.append(
                f"aligned to {self.align}-token blocks ({blocks} blocks for {groups}): a rank holds whole blocks, so "
                f"no aligned plan does better than max/mean compute {self.floor:.4f} and max/mean tokens "
                f"{self.token_floor:.4f}")
        if self.ring_size > 1:
            member = "rank" if self.ulysses_degree == 1 else "ring group"
            lines.append(f"ring of {self.ring_size} ({self.mask}): remote steps run {list(self.steps_run)} of "
                         f"1..{self.ring_size - 1}")
            for m, (steps, got) in enumerate(zip(self.member_steps, self.received)):
                lines.append(f"  {member} {m}: receives K/V at steps {list(steps)} ({got} tokens), skips "
                             f"{self.skipped_steps[m]} of {self.ring_size - 1}")
        return "\n".join(lines)


def _documents(seqlen_or_cu_seqlens) -> tuple[int, Optional[tuple[int, ...]]]:
    """(total tokens, document boundaries or None for one dense sequence)."""
    if isinstance(seqlen_or_cu_seqlens, bool):
        raise TypeError("seqlen_or_cu_seqlens must be an int (sequence length) or cu_seqlens, got bool")
    if isinstance(seqlen_or_cu_seqlens, numbers.Integral):  # int, or a NumPy integer
        return check_int("seqlen", int(seqlen_or_cu_seqlens), 1), None
    if isinstance(seqlen_or_cu_seqlens, torch.Tensor):
        t = seqlen_or_cu_seqlens
        check_integer_dtype("cu_seqlens", t)
        if t.is_meta:
            raise ValueError("seqlen_or_cu_seqlens is on the meta device, which holds no values: the document "
                             "boundaries must be read (pass a cpu or cuda tensor, or a list)")
        if t.dim() == 0:
            return check_int("seqlen", int(t), 1), None
        if t.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D (documents + 1), got shape {tuple(t.shape)}")
        values = tuple(int(x) for x in t.tolist())
    elif is_ndarray(seqlen_or_cu_seqlens):  # as a tensor, as NumPy integers are taken as ints
        a = seqlen_or_cu_seqlens
        check_integer_ndarray("cu_seqlens", a)
        if a.ndim == 0:
            return check_int("seqlen", int(a), 1), None
        if a.ndim != 1:
            raise ValueError(f"cu_seqlens must be 1-D (documents + 1), got shape {tuple(a.shape)}")
        values = tuple(int(x) for x in a.tolist())
    elif isinstance(seqlen_or_cu_seqlens, (list, tuple)):
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in seqlen_or_cu_seqlens):
            raise TypeError(f"cu_seqlens must hold ints, got {list(seqlen_or_cu_seqlens)[:8]!r}")
        values = tuple(int(x) for x in seqlen_or_cu_seqlens)
    else:
        raise TypeError(
            "seqlen_or_cu_seqlens must be an int (one sequence) or cu_seqlens (a 1-D int tensor, NumPy array or list "
            f"of document boundaries), got {type(seqlen_or_cu_seqlens).__name__}"
        )
    if len(values) < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries (documents + 1), got {list(values)}")
    check_cu_seqlens_values("cu_seqlens", values)
    if values[-1] < 1:
        raise ValueError("cu_seqlens describes no tokens (cu_seqlens[-1] == 0)")
    return values[-1], values


def _aligned_chunk_count(total: int, cp_size: int, align: int) -> int:
    """The default chunk count of a packed plan with ``align > 1``.

    The unaligned default cuts the stream into 8 chunks per rank, all real and of one size.  Rounding that size up
    to a multiple of ``align`` ends the stream early (up to half of the chunks are empty at 65 tokens a chunk and
    align 64), and the real ones are coarser: LPT has fewer, larger pieces to balance, and as a rank holds whole
    chunks (as many real ones as the others, within one) its tokens can exceed the mean by up to a chunk.  Here the
    chunk size is a multiple of ``align`` no larger than the unaligned one (at least ``align``) and giving at most
    16 real chunks per rank, the one whose busiest rank holds the fewest tokens (the largest on a tie); the count
    is the real chunks rounded up to a multiple of cp."""
    target = total // (8 * cp_size)  # the unaligned chunk size, rounded down
    lo, hi = max(1, -(-total // (16 * cp_size * align))), max(1, target // align)
    best = None
    for k in range(hi, lo - 1, -1):
        size = k * align
        real = -(-total // size)
        busiest = -(-real // cp_size) * size
        if best is None or busiest < best[0]:
            best = (busiest, real)
    return -(-best[1] // cp_size) * cp_size


# ---------------------------------------------------------------------------------------------------------------


class ShardPlan:
    """Chunks of the global token stream and their assignment to cp ranks.  Build one with :func:`make_plan`; one
    built directly (a balancer of your own, a plan rebuilt from ``describe()``) is checked alike: every chunk
    owned by a rank of ``cp_size``, so that every token is computed."""

    def __init__(self, total_len: int, cu_seqlens: Optional[tuple[int, ...]], cp_size: int, num_chunks: int,
                 owner: Sequence[int], balancer: str, mask: Mask, ulysses_degree: int = 1, align: int = 1):
        # (>= 1 as make_plan: a plan of no tokens crashed in aligned_floor and unshard)
        total_len = check_int("total_len", total_len, 1)
        cp_size = check_int("cp_size", cp_size, 1)
        num_chunks = check_int("num_chunks", num_chunks, 1)
        ulysses_degree = check_int("ulysses_degree", ulysses_degree, 1)
        align = check_int("align", align, 1)
        if cp_size % ulysses_degree:
            raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide cp_size ({cp_size})")
        if cu_seqlens is not None:
            cu_seqlens = tuple(check_int("cu_seqlens entries", x) for x in cu_seqlens)
            if len(cu_seqlens) < 2 or cu_seqlens[-1] != total_len:
                raise ValueError(f"cu_seqlens must run from 0 to total_len ({total_len}), got {list(cu_seqlens)[:8]}")
            check_cu_seqlens_values("cu_seqlens", cu_seqlens)
        if not isinstance(balancer, str):
            raise TypeError(f"balancer must be a str (its name), got {type_name(balancer)}")
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a fa4dist.kernels.mask.Mask, got {type_name(mask)}")
        owner = tuple(check_int("owner entries", r) for r in owner)
        if len(owner) != num_chunks:
            raise ValueError(f"owner must name one rank per chunk ({num_chunks}), got {len(owner)}")
        stray = [(c, r) for c, r in enumerate(owner) if not 0 <= r < cp_size]
        if stray:  # (their tokens would belong to no rank: never computed, no error)
            raise ValueError(f"owner must name ranks in [0, {cp_size}) (cp_size), got chunk {stray[0][0]} -> rank "
                             f"{stray[0][1]}")
        self.total_len = total_len
        self.cu_seqlens = cu_seqlens
        self.cp_size = cp_size
        self.num_chunks = num_chunks
        self.align = align
        self.chunk_size = -(-(-(-total_len // num_chunks)) // align) * align  # ceil(total / chunks), up to align
        self.balancer = balancer
        self.mask = mask  # what the cost model assumes (the attention's own mask)
        self.ulysses_degree = ulysses_degree
        self.ring_degree = cp_size // ulysses_degree
        self.chunk_owner: tuple[int, ...] = tuple(owner)
        held = [[] for _ in range(cp_size)]
        for c, r in enumerate(self.chunk_owner):  # (one pass: cp_size x num_chunks stalls at a large cp)
            held[r].append(c)
        self._rank_chunks = tuple(map(tuple, held))

    # ---- structure ----------------------------------------------------------------------------------------------

    @property
    def packed(self) -> bool:
        """True for a packed batch of documents (local tensors are (tokens, heads, head_dim))."""
        return self.cu_seqlens is not None

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk_size

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        """[start, end) of a chunk's real tokens in the global token stream (empty past the end)."""
        start = min(chunk * self.chunk_size, self.total_len)
        return start, min(start + self.chunk_size, self.total_len)

    def chunk_len(self, chunk: int) -> int:
        start, end = self.chunk_bounds(chunk)
        return end - start

    def rank_chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks rank `rank` holds, in global order (its local tokens are theirs, in this order)."""
        return self._rank_chunks[self._check_rank(rank)]

    @property
    def assignment(self) -> tuple[tuple[int, ...], ...]:
        """Chunks per rank."""
        return self._rank_chunks

    def local_len(self, rank: int) -> int:
        return sum(self.chunk_len(c) for c in self.rank_chunks(rank))

    def local_ranges(self, rank: int) -> list[tuple[int, int]]:
        """The rank's local tokens as [start, end) ranges of the global token stream, adjacent chunks merged."""
        ranges: list[list[int]] = []
        for c in self.rank_chunks(rank):
            start, end = self.chunk_bounds(c)
            if end == start:
                continue
            if ranges and ranges[-1][1] == start:
                ranges[-1][1] = end
            else:
                ranges.append([start, end])
        return [(a, b) for a, b in ranges]

    def global_indices(self, rank: Optional[int] = None, device=None) -> torch.Tensor:
        """int64 indices into the global token stream of the rank's local tokens (made on ``device``: no copy)."""
        parts = [torch.arange(a, b, device=device)
                 for a, b in self.local_ranges(self._resolve_rank(rank, "global_indices"))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    # ---- documents ----------------------------------------------------------------------------------------------

    @cached_property
    def _doc_of_token(self) -> Optional[torch.Tensor]:
        if self.cu_seqlens is None:
            return None
        cu = torch.tensor(self.cu_seqlens, dtype=torch.int64)
        return torch.searchsorted(cu, torch.arange(self.total_len), right=True) - 1

    def _check_span(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= self.total_len:
            raise ValueError(f"[{start}, {end}) must be a range of the plan's {self.total_len} tokens "
                             f"(0 <= start <= end <= {self.total_len})")

    def pieces(self, start: int, end: int) -> list[Piece]:
        """The documents inside the global token range [start, end), in order (empty documents skipped).  For a
        dense plan the whole range is one piece of document 0."""
        self._check_span(start, end)
        if end == start:
            return []
        if self.cu_seqlens is None:
            return [Piece(0, 0, end - start, start)]
        import bisect

        cu = self.cu_seqlens
        out = []
        d = bisect.bisect_right(cu, start) - 1
        while d < len(cu) - 1 and cu[d] < end:
            a, b = max(cu[d], start), min(cu[d + 1], end)
            if b > a:
                out.append(Piece(d, a - start, b - a, a - cu[d]))
            d += 1
        return out

    def positions(self, rank: Optional[int] = None) -> torch.Tensor:
        """int64 positions of the rank's local tokens: the global position for one sequence, the position within
        its document for packed documents (what RoPE needs)."""
        idx = self.global_indices(self._resolve_rank(rank, "positions"))
        if self.cu_seqlens is None:
            return idx
        cu = torch.tensor(self.cu_seqlens, dtype=torch.int64)
        return idx - cu[self._doc_of_token[idx]]

    def document_ids(self, rank: Optional[int] = None) -> torch.Tensor:
        """int64 document index of each local token (all 0 for one sequence)."""
        idx = self.global_indices(self._resolve_rank(rank, "document_ids"))
        if self.cu_seqlens is None:
            return torch.zeros_like(idx)
        return self._doc_of_token[idx]

    def local_cu_seqlens(self, rank: Optional[int] = None) -> torch.Tensor:
        """int32 boundaries of the rank's local segments: maximal runs of consecutive tokens of one document."""
        bounds = [0]
        offset = 0
        for a, b in self.local_ranges(self._resolve_rank(rank, "local_cu_seqlens")):
            for p in self.pieces(a, b):
                offset += p.length
                bounds.append(offset)
        return torch.tensor(bounds, dtype=torch.int32)

    def split_documents(self, starts) -> "ShardPlan":
        """This plan with its documents also cut at the global token indices ``starts`` (a 1-D integer tensor or
        sequence, each in [0, total_len]): the same chunks on the same ranks, so one sharding of the inputs serves
        layers whose masks differ only in where documents end (chunked attention: Llama 4's chunked layers see
        their own chunk of each document; :mod:`fa4dist.integrations.hf_context_parallel`).  The balancer's choice
        is kept (it was costed with the original documents); a dense plan becomes a packed one.  Its documents are
        the pieces: its :meth:`positions` restart at every cut, so take RoPE's positions from this plan, not from
        the split one."""
        if isinstance(starts, (str, bytes)) or starts is None:
            raise TypeError(f"starts must be a 1-D tensor or sequence of token indices, got {type(starts).__name__}")
        try:
            cuts = torch.as_tensor(starts).flatten()
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"starts must be a 1-D tensor or sequence of token indices, got {starts!r}") from None
        if cuts.numel() == 0:
            return self
        check_integer_dtype("starts", cuts)
        cuts = [int(c) for c in cuts.tolist()]
        bad = [c for c in cuts if not 0 <= c <= self.total_len]
        if bad:
            raise ValueError(f"starts must be token indices in [0, {self.total_len}] (the plan's tokens), got "
                             f"{bad[:4]}")
        old = self.cu_seqlens if self.cu_seqlens is not None else (0, self.total_len)
        known = set(old)  # (the plan's boundaries all kept: an empty document keeps its number in document_ids)
        cu = tuple(sorted([*old, *(c for c in set(cuts) if c not in known)]))
        if cu == self.cu_seqlens:
            return self
        return ShardPlan(self.total_len, cu, self.cp_size, self.num_chunks, self.chunk_owner, self.balancer,
                         self.mask, self.ulysses_degree, self.align)

    def cu_seqlens_tensor(self, device=None) -> torch.Tensor:
        """The global document boundaries as an int32 tensor ([0, total_len] for one sequence)."""
        values = self.cu_seqlens if self.cu_seqlens is not None else (0, self.total_len)
        return torch.tensor(values, dtype=torch.int32, device=device)

    # ---- cost model ---------------------------------------------------------------------------------------------

    @property
    def causal(self) -> bool:
        return self.mask.causal

    def range_cost(self, start: int, end: int, mask: Optional[Mask] = None) -> int:
        """Visible (query, key) pairs of the queries in [start, end) against every key they may see."""
        mask = self.mask if mask is None else mask
        if self.cu_seqlens is None:
            self._check_span(start, end)
            return visible_pairs(end - start, self.total_len, start, 0, mask)
        cost = 0
        for p in self.pieces(start, end):
            doc_len = self.cu_seqlens[p.doc + 1] - self.cu_seqlens[p.doc]
            cost += visible_pairs(p.length, doc_len, p.position, 0, mask)
        return cost

    @cached_property
    def chunk_costs(self) -> tuple[int, ...]:
        return tuple(self.range_cost(*self.chunk_bounds(c)) for c in range(self.num_chunks))

    def work(self, rank: int) -> int:
        return sum(self.chunk_costs[c] for c in self.rank_chunks(rank))

    def balance_report(self) -> BalanceReport:
        """Work per rank and, for the ring of the plan's Ulysses degree under its mask, the steps each member runs
        and skips (see :class:`~fa4dist.context_parallel.schedule.Schedule`)."""
        from .schedule import Schedule  # the schedule is built on plans

        work = tuple(self.work(r) for r in range(self.cp_size))
        u = self.ulysses_degree
        group_work = tuple(sum(work[g * u:(g + 1) * u]) for g in range(self.ring_degree))
        sched = Schedule(self, u, self.mask)
        members = range(sched.ring_size)
        floor, token_floor = self.aligned_floor() if self.align > 1 else (None, None)
        return BalanceReport(
            balancer=self.balancer, cp_size=self.cp_size, ulysses_degree=u, num_chunks=self.num_chunks,
            chunk_size=self.chunk_size, work=work, group_work=group_work,
            tokens=tuple(self.local_len(r) for r in range(self.cp_size)), mask=str(self.mask),
            steps_run=sched.steps(), member_steps=tuple(sched.member_steps(m) for m in members),
            received=tuple(sched.member_received(m) for m in members), align=self.align, floor=floor,
            token_floor=token_floor,
        )

    def aligned_floor(self) -> tuple[float, float]:
        """(compute, tokens): lower bounds on the max/mean visible pairs over ring groups and the max/mean real
        tokens over cp ranks of *every* plan of this stream whose chunk size is a multiple of ``align``.

        Such a plan's chunks start at multiples of ``align``, so a rank holds whole ``align``-token blocks of the
        stream (the last one short): whatever the balancer, the busiest group does at least the work of the costliest
        block, and of the two cheapest among the ``G + 1`` costliest blocks when there are more blocks than its G
        groups (two of those share a group); the busiest rank holds at least ceil(blocks / cp) blocks.  A sample of
        few blocks per rank, or one whose visible pairs sit in few blocks (the end of one long document among short
        ones), is imbalanced in every aligned plan: the alignment, not the balancer, forces it."""
        a, total, groups = self.align, self.total_len, self.ring_degree
        costs = sorted((self.range_cost(s, min(s + a, total)) for s in range(0, total, a)), reverse=True)
        mean = sum(costs) / groups
        bound = max(mean, costs[0], costs[groups - 1] + costs[groups] if len(costs) > groups else 0)
        blocks, cp = len(costs), self.cp_size
        q = -(-blocks // cp)  # blocks of the busiest rank
        with_q = blocks - (q - 1) * cp  # ranks holding q blocks
        last = total - (blocks - 1) * a
        busiest = (q - 1) * a + last if with_q == 1 else q * a  # (one rank with q: it takes the short last block)
        return (bound / mean if mean else 1.0), busiest / (total / cp)

    # ---- sharding -----------------------------------------------------------------------------------------------

    def _check_rank(self, rank) -> int:
        rank = check_int("rank", rank)
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}) for this plan (cp_size={self.cp_size}), got {rank}")
        return rank

    def _resolve_rank(self, rank: Optional[int], what: str = "this") -> int:
        if rank is None:
            raise TypeError(
                f"{what} needs rank=, the cp rank whose tokens you mean: FA4ContextParallelAttention.cp_rank (or use "
                "module.shard(x, plan)).  It is not the global rank on a 2-D mesh, with dp > 1 or with explicit "
                "groups, so it is never guessed"
            )
        return self._check_rank(rank)

    def _check_seq(self, x, seq_dim: int, expected: int, what: str) -> int:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        seq_dim = check_int("seq_dim", seq_dim)  # (a NumPy integer as an int, like rank)
        if not -x.dim() <= seq_dim < x.dim():
            raise ValueError(f"seq_dim={seq_dim} is out of range for a {x.dim()}-D tensor")
        seq_dim %= x.dim()
        if x.shape[seq_dim] != expected:
            raise ValueError(
                f"{what} has {x.shape[seq_dim]} tokens along seq_dim={seq_dim}, but the plan expects {expected}"
            )
        return seq_dim

    def shard(self, x: torch.Tensor, seq_dim: int = 1, rank: Optional[int] = None) -> torch.Tensor:
        """The local part of a global tensor (all `total_len` tokens along `seq_dim`) for cp rank `rank`."""
        rank = self._resolve_rank(rank, "shard")
        seq_dim = self._check_seq(x, seq_dim, self.total_len, "x")
        parts = [x.narrow(seq_dim, a, b - a) for a, b in self.local_ranges(rank)]
        if not parts:
            return x.narrow(seq_dim, 0, 0).clone()
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=seq_dim)

    def unshard(self, x_local, seq_dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's local part: a list of cp_size local tensors (in rank order), or
        their concatenation along `seq_dim`.  The local parts differ in length in general (``local_len(rank)``), so
        ``dist.all_gather`` of them needs each padded to the longest and cut back, or a list gather."""
        if isinstance(x_local, torch.Tensor):
            seq_dim = self._check_seq(x_local, seq_dim, self.total_len, "the gathered tensor")
            sizes = [self.local_len(r) for r in range(self.cp_size)]
            x_local = list(torch.split(x_local, sizes, dim=seq_dim))
        if not isinstance(x_local, (list, tuple)) or len(x_local) != self.cp_size:
            raise ValueError(f"unshard needs {self.cp_size} local tensors (one per rank) or their concatenation")
        pieces, others = {}, None
        for r, t in enumerate(x_local):
            d = self._check_seq(t, seq_dim, self.local_len(r), f"the local tensor of rank {r}")
            rest = (t.dim(), t.shape[:d] + t.shape[d + 1:])
            if others is not None and rest != others:
                raise ValueError(f"unshard: the local tensor of rank {r} has shape {tuple(t.shape)}, which differs "
                                 f"from rank 0's {tuple(x_local[0].shape)} outside seq_dim")
            others = rest
            offset = 0
            for a, b in self.local_ranges(r):
                pieces[a] = t.narrow(d, offset, b - a)
                offset += b - a
        return torch.cat([pieces[a] for a in sorted(pieces)], dim=d)

    # ---- identity -----------------------------------------------------------------------------------------------

    def describe(self) -> dict:
        return dict(
            total_len=self.total_len, cu_seqlens=list(self.cu_seqlens) if self.cu_seqlens else None,
            cp_size=self.cp_size, ulysses_degree=self.ulysses_degree, num_chunks=self.num_chunks,
            chunk_size=self.chunk_size, balancer=self.balancer, causal=self.mask.causal, window=list(self.mask.window),
            owner=list(self.chunk_owner), align=self.align,
        )

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of everything that decides which rank holds which token."""
        d = self.describe()
        d.pop("balancer")  # two balancers giving the same assignment are the same plan
        d.pop("causal")  # the mask only informed the costs
        d.pop("window")
        d.pop("align")  # (its effect, the chunk size, is kept)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardPlan) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        kind = f"{len(self.cu_seqlens) - 1} documents, " if self.cu_seqlens else ""
        return (
            f"ShardPlan({kind}{self.total_len} tokens, cp_size={self.cp_size}"
            + (f", ulysses_degree={self.ulysses_degree}" if self.ulysses_degree > 1 else "")
            + f", {self.num_chunks} chunks of {self.chunk_size}, balancer={self.balancer!r}, "
            f"fingerprint={self.fingerprint})"
        )


def make_plan(
    seqlen_or_cu_seqlens: Union[int, torch.Tensor, Sequence[int]],
    cp_size: int,
    balancer: str = "lpt",
    num_chunks: Optional[int] = None,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    ulysses_degree: int = 1,
    align: int = 1,
) -> ShardPlan:
    """Plans how `cp_size` ranks share one sequence (an int length) or a packed batch of documents (cu_seqlens: a
    1-D integer tensor, NumPy array, list or tuple).

    - ``balancer``: ``"lpt"`` (default), ``"zigzag"`` or ``"contiguous"``.
    - ``num_chunks``: a multiple of ``cp_size`` (every rank holds as many chunks); default ``2 * cp_size`` for one
      sequence (zigzag's count), ``8 * cp_size`` for packed documents (finer chunks let LPT balance a mix
      dominated by one long document), and for ``lpt`` ``16 * cp_size`` where 8 per rank leave the busiest ring
      group over 1% above the mean, 16 balance it better and chunks stay at least 128 tokens (one chunk can cost
      nearly a group's share: the end of a long document); with ``align > 1``, for packed
      documents, 8 to 16 real chunks per rank where the stream has that many aligned chunks
      (:func:`_aligned_chunk_count`; for ``zigzag`` rounded up to two chunks per ring group and round).
    - ``causal``, ``window``: the mask the cost model assumes (use the attention's own; ``window=(left, right)`` as
      in :func:`fa4dist.kernels.attention_forward`).  With a window, ``balance_report()`` shows the ring steps it
      leaves; a ``contiguous`` plan keeps a member's window inside its neighbour's chunks (fewest transfers).
    - ``ulysses_degree``: for the 2-D strategy, balance over ``cp_size // ulysses_degree`` ring groups.
    - ``align``: chunk sizes are a multiple of it, so every chunk starts at a multiple of ``align`` tokens of the
      stream (the cp_invariant training step's canonical token blocks, :mod:`fa4dist.models.invariant_grads`).
    """
    total, cu = _documents(seqlen_or_cu_seqlens)
    # (the checked Python ints: NumPy integers kept in the plan would break its JSON fingerprint)
    cp_size = check_int("cp_size", cp_size, 1)
    if not isinstance(balancer, str) or balancer not in BALANCERS:
        raise ValueError(f"balancer must be one of {BALANCERS}, got {balancer!r}")
    mask = check_mask(causal, window)
    ulysses_degree = check_int("ulysses_degree", ulysses_degree, 1)
    align = check_int("align", align, 1)
    if cp_size % ulysses_degree:
        raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide cp_size ({cp_size})")
    groups = cp_size // ulysses_degree
    finer = None  # the count tried where the default leaves the groups' work over 1% apart
    if num_chunks is None:  # packed documents balance far better with more, smaller chunks
        num_chunks = (8 if cu is not None else 2) * cp_size
        if cu is not None and align > 1:
            num_chunks = _aligned_chunk_count(total, cp_size, align)
            if balancer == "zigzag":  # (a multiple of cp): zigzag also needs two chunks per ring group and round
                step = math.lcm(cp_size, 2 * groups)
                num_chunks = -(-num_chunks // step) * step
        elif cu is not None and balancer == "lpt" and total >= 16 * cp_size * _MIN_FINER_CHUNK:
            finer = 16 * cp_size
    num_chunks = check_int("num_chunks", num_chunks, 1)
    if num_chunks % cp_size:
        raise ValueError(
            f"num_chunks must be a multiple of cp_size ({cp_size}) so every rank holds as many chunks, got {num_chunks}"
        )
    plan, spread = _balanced_plan(total, cu, cp_size, num_chunks, balancer, mask, ulysses_degree, align)
    if finer is not None and spread > 1.01:
        # One chunk can cost nearly a group's share (the end of a long document), and every group holds as many
        # chunks: halving them lets the balancer even it out (bench/cp_balance.py, 31 seeds of 400 random 4k-128k
        # mixes at cp 2-8: none over 1% with it).  The finer plan is taken only where it balances better.
        other, other_spread = _balanced_plan(total, cu, cp_size, finer, balancer, mask, ulysses_degree, align)
        if other_spread < spread:
            plan = other
    return plan


_MIN_FINER_CHUNK = 128  # tokens: the finer default count never cuts a chunk below one 128-row kernel tile


def _balanced_plan(total, cu, cp_size, num_chunks, balancer, mask, ulysses_degree, align) -> tuple[ShardPlan, float]:
    """The plan of `balancer` at `num_chunks`, and its busiest ring group's work over the mean."""
    groups = cp_size // ulysses_degree
    plan = ShardPlan(total, cu, cp_size, num_chunks, [0] * num_chunks, balancer, mask, ulysses_degree, align)
    real = [plan.chunk_len(c) > 0 for c in range(num_chunks)]
    costs = plan.chunk_costs
    group_of = BALANCER_FNS[balancer](costs, groups, real)
    # Within a ring group, its u ranks take contiguous runs of the group's real chunks (in global order, as many
    # each as the others within one), then its empty chunks fill their slots.
    per_rank = num_chunks // cp_size
    owner = [0] * num_chunks
    u = ulysses_degree
    held = [[] for _ in range(groups)]
    for c, g in enumerate(group_of):
        held[g].append(c)
    for g, chunks in enumerate(held):
        full = [c for c in chunks if real[c]]
        low, extra = divmod(len(full), u)
        count, j = [0] * u, 0
        for c in full:
            while count[j] == low + (j < extra):
                j += 1
            owner[c] = g * u + j
            count[j] += 1
        j = 0
        for c in chunks:
            if not real[c]:
                while count[j] == per_rank:
                    j += 1
                owner[c] = g * u + j
                count[j] += 1
    work = [0] * groups
    for c, g in enumerate(group_of):
        work[g] += costs[c]
    spread = max(work) * groups / sum(work) if sum(work) else 1.0
    return ShardPlan(total, cu, cp_size, num_chunks, owner, balancer, mask, ulysses_degree, align), spread
