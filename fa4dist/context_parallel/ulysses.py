"""Ulysses: all-to-all between sequence sharding and head sharding inside a group of ``u`` ranks.

Before attention, rank j of the group sends every other member the heads it will own, for its own tokens, and
receives its heads for every member's tokens; the result is laid out in the ring member's global token order
(:class:`~fa4dist.context_parallel.schedule.MemberLayout`).  After attention the same exchange runs backwards.

GQA: query heads split evenly; key/value heads go to every member whose query heads use them, so with fewer KV
heads than members a KV head is replicated only to the members that need it (and its gradients are summed back in
member order, deterministically).  A split where some member's query heads would need a fraction of a KV-head
group is impossible and is refused with a message that names the 2-D (hybrid) strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import Transport
from .schedule import MemberLayout


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


class UlyssesGroup:
    """The exchange among the `degree` members of one Ulysses group (group ranks `peers` of `transport`)."""

    def __init__(self, transport: Transport, peers: list[int], index: int, layout: MemberLayout, local_lens,
                 seq_dim: int):
        self.transport, self.peers, self.index = transport, peers, index
        self.layout, self.local_lens, self.seq_dim = layout, list(local_lens), seq_dim
        self.degree = len(peers)

    def seq_to_head(self, items) -> list[torch.Tensor]:
        """Local tokens, all heads -> the member's tokens (global order), this rank's heads, for every (tensor,
        heads, name) in `items` in one exchange; `heads(j)` gives the [lo, hi) head range of member j."""
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
                sends.append((x.narrow(hd, a, b - a).contiguous(), peer, 100 + i))
                shape = list(x.shape)
                shape[self.seq_dim], shape[hd] = self.local_lens[j], hi - lo
                buf = x.new_empty(shape)
                recvs.append((buf, peer, 100 + i))
                pieces.append(buf)
            all_pieces.append(pieces)
        self._exchange(sends, recvs, [item[2] for item in items])
        return [self.layout.to_member_order(torch.cat(p, dim=self.seq_dim), self.seq_dim) for p in all_pieces]

    def head_to_seq(self, items) -> list[torch.Tensor]:
        """Inverse of :meth:`seq_to_head` for every (tensor, heads, num_heads, name, reduce) in `items`: the
        member's tokens, this rank's heads -> local tokens, all `num_heads` heads.  With `reduce`, heads that
        several members hold (replicated KV heads) are summed in member order."""
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
                sends.append((parts[j].contiguous(), peer, 200 + i))
                a, b = heads(j)
                rshape = list(shape)
                rshape[hd] = b - a
                received[j] = y.new_empty(rshape)
                recvs.append((received[j], peer, 200 + i))
            plans.append((y, shape, hd, heads, reduce, received))
        self._exchange(sends, recvs, [item[3] for item in items])
        outs = []
        for y, shape, hd, heads, reduce, received in plans:
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

    def _exchange(self, sends, recvs, names) -> None:
        self.transport.post_tagged(sends, recvs, f"the Ulysses all-to-all of {', '.join(names)}").wait()
