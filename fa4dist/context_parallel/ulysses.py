"""Ulysses: all-to-all between sequence sharding and head sharding inside a group of ``u`` ranks.

Before attention, rank j of the group sends every other member the heads it will own, for its own tokens, and
receives its heads for every member's tokens; the result is laid out in the ring member's global token order
(:class:`~fa4dist.context_parallel.schedule.MemberLayout`).  After attention the same exchange runs backwards.

GQA: query heads split evenly; key/value heads go to every member whose query heads use them, so with fewer KV
heads than members a KV head is replicated only to the members that need it (and its gradients are summed back in
member order, deterministically).  A split where some member's query heads would need a fraction of a KV-head
group is impossible and is refused with a message that names the 2-D (hybrid) strategy.

Head chunks (``FA4DIST_ULYSSES_CHUNKS``, :func:`requested_chunks`): each member's heads are cut into runs of whole
key/value head groups (:class:`HeadChunk`), exchanged and computed one after the other, so that chunk c + 1's
all-to-all travels while chunk c is computed and chunk c's result travels back while c + 1 is: only the first
chunk's exchange and the last chunk's return stay exposed.  A head's result does not depend on the chunks (every
head is computed alone), so chunking changes when heads travel, not what they get.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .comm import Pending, Transport, abandoned_on_failure
from .knobs import env_int
from .schedule import MemberLayout

CHUNKS_ENV = "FA4DIST_ULYSSES_CHUNKS"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class HeadSplit:
    """Which query and key/value heads member j of a Ulysses group of `degree` ranks owns."""

    heads_q: int
    heads_kv: int
    degree: int

    @staticmethod
    def problem(heads_q: int, heads_kv: int, degree: int):
        """None if the split works, else the reason it does not."""
        if heads_kv < 1 or heads_q % heads_kv:  # (more key/value heads than query heads divided by zero below)
            return f"{heads_q} query heads are not a multiple of {heads_kv} key/value heads"
        if heads_q % degree:
            return f"{heads_q} query heads do not split evenly over {degree} ranks"
        group = heads_q // heads_kv
        per = heads_q // degree
        for j in range(degree):
            lo, hi = j * per, (j + 1) * per
            kv_lo, kv_hi = lo // group, (hi - 1) // group + 1
            n_kv = kv_hi - kv_lo
            if per % n_kv or any((lo + i) // group - kv_lo != i // (per // n_kv) for i in range(per)):
                return (
                    f"rank {j}'s query heads {lo}..{hi - 1} would need part of a key/value head group "
                    f"({heads_q} query heads share {heads_kv} key/value heads)"
                )
        return None

    @staticmethod
    def feasible_degrees(heads_q: int, heads_kv: int, cp_size: int) -> list[int]:
        return [d for d in _divisors(cp_size) if HeadSplit.problem(heads_q, heads_kv, d) is None]

    @staticmethod
    def check(heads_q: int, heads_kv: int, degree: int, cp_size: int, groups: bool = False) -> "HeadSplit":
        """The split of ``degree`` Ulysses members; raises naming the degrees that work. ``groups``: the degree is
        the size of a given Ulysses group (a 2-D mesh or ulysses_group + ring_group), so the hint names group sizes
        rather than the ulysses_degree= option."""
        reason = HeadSplit.problem(heads_q, heads_kv, degree)
        if reason is not None:
            ok = [d for d in HeadSplit.feasible_degrees(heads_q, heads_kv, cp_size) if d > 1]
            if groups:
                hint = (f"build the 2-D groups with a Ulysses group size in {ok}" if ok else
                        "use one process group with strategy='ring'") + " (the Ulysses group size is the degree)"
            else:
                hint = (
                    f"use strategy='hybrid' with ulysses_degree in {ok} (Ulysses inside, ring across)"
                    if ok else "use strategy='ring' (or 'hybrid' once the head counts allow a Ulysses degree)"
                )
            raise ValueError(f"Ulysses degree {degree} is impossible: {reason}; {hint}")
        return HeadSplit(heads_q, heads_kv, degree)

    def q_heads(self, j: int) -> tuple[int, int]:
        per = self.heads_q // self.degree
        return j * per, (j + 1) * per

    def kv_heads(self, j: int) -> tuple[int, int]:
        lo, hi = self.q_heads(j)
        group = self.heads_q // self.heads_kv
        return lo // group, (hi - 1) // group + 1

    @property
    def kv_replicated(self) -> bool:
        spans = [self.kv_heads(j) for j in range(self.degree)]
        return any(a[1] > b[0] for a, b in zip(spans, spans[1:]))

    def chunk_count(self, requested: int) -> int:
        """The head chunks a call runs with when ``requested`` are asked for: the largest count up to it that cuts
        every member's key/value heads evenly (a chunk holds whole groups of query heads), 1 where members share
        replicated key/value heads (their gradients are summed over members)."""
        if self.kv_replicated:
            return 1
        lo, hi = self.kv_heads(0)
        return max(n for n in range(1, min(requested, hi - lo) + 1) if (hi - lo) % n == 0)

    def chunks(self, count: int) -> list["HeadChunk"]:
        return [HeadChunk(self, c, count) for c in range(count)]


@dataclass(frozen=True)
class HeadChunk:
    """Chunk ``index`` of ``count`` of a split: each member's query heads and their key/value heads cut into
    ``count`` equal runs (:meth:`HeadSplit.chunk_count`); it has :class:`HeadSplit`'s head ranges."""

    split: HeadSplit
    index: int
    count: int

    def _part(self, lo: int, hi: int) -> tuple[int, int]:
        per = (hi - lo) // self.count
        return lo + self.index * per, lo + (self.index + 1) * per

    def q_heads(self, j: int) -> tuple[int, int]:
        return self._part(*self.split.q_heads(j))

    def kv_heads(self, j: int) -> tuple[int, int]:
        return self._part(*self.split.kv_heads(j))


def requested_chunks() -> int:
    """The Ulysses head chunks this process asks for: ``FA4DIST_ULYSSES_CHUNKS`` (an int >= 1), else 1 (part of a
    call's agreed signature: :mod:`~fa4dist.context_parallel.knobs`)."""
    return env_int(CHUNKS_ENV, 1, 1, MAX_CHUNKS, "the Ulysses exchange's head chunks")


MAX_CHUNKS = 64  # (each chunk's messages have tags of their own)


class Exchange:
    """An all-to-all in flight: :meth:`wait` completes it and returns its tensors."""

    def __init__(self, pending: Pending, finish: Callable[[], list]):
        self.pending, self._finish = pending, finish

    def wait(self) -> list:
        self.pending.wait()
        return self._finish()


class UlyssesGroup:
    """The exchange among the `degree` members of one Ulysses group (group ranks `peers` of `transport`)."""

    def __init__(self, transport: Transport, peers: list[int], index: int, layout: MemberLayout, local_lens,
                 seq_dim: int):
        self.transport, self.peers, self.index = transport, peers, index
        self.layout, self.local_lens, self.seq_dim = layout, list(local_lens), seq_dim
        self.degree = len(peers)
        self._posted: Optional[list] = None  # the exchanges posted inside abandoned_on_failure

    def seq_to_head(self, items) -> list[torch.Tensor]:
        """Local tokens, all heads -> the member's tokens (global order), this rank's heads, for every (tensor,
        heads, name) in `items` in one exchange; `heads(j)` gives the [lo, hi) head range of member j."""
        return self.post_seq_to_head(items).wait()

    def post_seq_to_head(self, items, chunk: int = 0) -> Exchange:
        """:meth:`seq_to_head`, posted: its result comes from the returned exchange's ``wait()``.  ``chunk``: the
        head chunk it moves (its messages' tags; several chunks may be in flight)."""
        sends, recvs, all_pieces = [], [], []
        for i, (x, heads, _) in enumerate(items):
            hd = x.dim() - 2
            lo, hi = heads(self.index)
            pieces = []
            for j, peer in enumerate(self.peers):
                if j == self.index:
                    pieces.append(x.narrow(hd, lo, hi - lo))
                    continue
                a, b = heads(j)
                sends.append((x.narrow(hd, a, b - a).contiguous(), peer, _tag(1, chunk, i)))
                shape = list(x.shape)
                shape[self.seq_dim], shape[hd] = self.local_lens[j], hi - lo
                buf = x.new_empty(shape)
                recvs.append((buf, peer, _tag(1, chunk, i)))
                pieces.append(buf)
            all_pieces.append(pieces)
        pending = self._post(sends, recvs, [item[2] for item in items], chunk)
        return Exchange(pending, lambda: [self.layout.to_member_order(torch.cat(p, dim=self.seq_dim), self.seq_dim)
                                          for p in all_pieces])

    def head_to_seq(self, items) -> list[torch.Tensor]:
        """Inverse of :meth:`seq_to_head` for every (tensor, heads, num_heads, name, reduce) in `items`: the
        member's tokens, this rank's heads -> local tokens, all `num_heads` heads.  With `reduce`, heads that
        several members hold (replicated KV heads) are summed in member order."""
        return self.post_head_to_seq(items).wait()

    def post_head_to_seq(self, items, into: Optional[list] = None, chunk: int = 0) -> Exchange:
        """:meth:`head_to_seq`, posted.  ``into``: per item, the local tensor (all heads) whose heads of this
        exchange its ``wait()`` writes (with ``reduce``: adds into), instead of a new one holding only them."""
        sends, recvs, plans = [], [], []
        for i, (y, heads, num_heads, _, reduce) in enumerate(items):
            hd = y.dim() - 2
            y = self.layout.to_rank_order(y, self.seq_dim)
            parts = list(torch.split(y, self.local_lens, dim=self.seq_dim))
            shape = list(parts[self.index].shape)
            shape[hd] = num_heads
            received = {self.index: parts[self.index]}
            for j, peer in enumerate(self.peers):
                if j == self.index:
                    continue
                sends.append((parts[j].contiguous(), peer, _tag(2, chunk, i)))
                a, b = heads(j)
                rshape = list(shape)
                rshape[hd] = b - a
                received[j] = y.new_empty(rshape)
                recvs.append((received[j], peer, _tag(2, chunk, i)))
            target = None if into is None else into[i]
            if target is not None and (tuple(target.shape) != tuple(shape) or target.dtype != y.dtype):
                raise ValueError(f"the Ulysses return of {items[i][3]} goes into a {target.dtype} tensor of shape "
                                 f"{tuple(target.shape)}, but its heads come as {y.dtype} of shape {tuple(shape)}")
            plans.append((y, shape, hd, heads, reduce, received, target))
        pending = self._post(sends, recvs, [item[3] for item in items], chunk)

        def finish() -> list:
            outs = []
            for y, shape, hd, heads, reduce, received, out in plans:
                if out is None:
                    out = y.new_zeros(shape) if reduce else y.new_empty(shape)
                for j in range(self.degree):
                    a, b = heads(j)
                    target = out.narrow(hd, a, b - a)
                    if reduce:
                        target.add_(received[j])
                    else:
                        target.copy_(received[j])
                outs.append(out)
            return outs

        return Exchange(pending, finish)

    def _post(self, sends, recvs, names, chunk: int) -> Pending:
        what = f"the Ulysses all-to-all of {', '.join(names)}" + (f" (head chunk {chunk})" if chunk else "")
        pending = self.transport.post_tagged(sends, recvs, what)
        if self._posted is not None:
            self._posted.append(pending)
        return pending

    @contextlib.contextmanager
    def abandoned_on_failure(self, direction: str):
        """Runs a call's chunked exchanges (:func:`~fa4dist.context_parallel.comm.abandoned_on_failure`: an error
        with exchanges of the call in flight, a failed ring exchange of a 2-D grid included, records the group as
        out of step)."""
        self._posted = []
        try:
            with abandoned_on_failure(self.transport, self._posted,
                                      f"its {direction} Ulysses head chunks with exchanges"):
                yield
        finally:
            self._posted = None


def _tag(kind: int, chunk: int, item: int) -> int:
    """The message tag of item ``item`` of head chunk ``chunk``'s exchange (kind 1: to heads, 2: back to tokens):
    every exchange that may be in flight at once has its own (gloo matches messages by tag)."""
    return 100 * kind + 1000 * chunk + item
