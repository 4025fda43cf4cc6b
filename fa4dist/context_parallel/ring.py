"""Ring attention over the members of a :class:`~fa4dist.context_parallel.schedule.Schedule`.

Forward: at step ``t`` member ``m`` sends the key rows that member ``m + t`` reads (K and V at the KV head count, a
message pair per row range, views of its own rows; a dense batch's packed into one pair once) straight to it, and
receives from ``m - t`` the rows it reads itself (into one flat buffer); rows nobody
reads are never sent, and a step with nothing to receive is not computed (with a sliding window most steps carry
nothing).  The transfer of the next step is posted before a step computes, so it overlaps.  Every step is one
work-list call (:mod:`fa4dist.kernels.worklist`: on cute, one launch per wave of blocks with disjoint query rows,
with the per-block loop's bits) of the schedule's blocks for the held keys, merged into the member's fp32 (fp64 for
fp64 inputs) running ``(out, lse)``, so nothing is rounded between steps; the merge order is (step, query block,
key), a function of the plan alone.  Optionally (``FA4DIST_RING_STEPS_PER_LAUNCH``, :func:`ring_steps_per_launch`;
``auto``: half the remote steps) the remote steps run in launch groups, forward and backward: a group's transfers
land in place in one buffer and its steps' blocks are one coalesced work list, merged once per row (then the order
is (group, query block, key)).  In the one-GPU simulation at cp = 8 with steady timing, groups of four read
0.97-0.98 forward against 0.84-0.92 one launch per step, 0.93-0.94 backward against 0.91-0.93 (bench/RESULTS.md,
fiftieth and fifty-first sessions), but a group waits for all its transfers before it computes, which the
simulation only models: one launch per step stays the default until a multi-GPU run decides.

Backward: the keys go out again the same way (in the forward's launch groups); each step's (or group's) work list
(on cute, one main kernel per group of blocks with disjoint key rows) recomputes its blocks against the global
``(out, lse)``, adding dQ into the member's shared query side (one preprocess and one dQ convert for all steps,
:func:`~fa4dist.kernels.worklist.share_queries`, where the backend has one; else its fp32 buffer) and dK/dV into
a fresh fp32 buffer for the rows it received, whose rows of each step go straight back to their owner (K and V as
two messages, posted after the launch, awaited one launch later so they overlap).
The owner adds its own dK/dV first, then the returns in step order: fixed by the plan, never by arrival.  A loss
of the returned lse adds its gradient in the same steps (``dlse``, joined to the row sums of dout * out; a loss of
the lse alone passes no dout).

Every member walks the same list of steps (those any member needs) and posts each step's sends and receives
together (``batch_isend_irecv``), so two members always post the messages between them in the same order and no
member blocks another, for any ring size.  :class:`MemberForward` and :class:`MemberBackward` (a member's steps
without the transfers) are also what ``bench/cp_sim.py`` times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kernels.problem import accum_dtype
from ..kernels.worklist import (WorkItem, attention_backward_items, attention_forward_items, share_queries,
                                uncovered_ranges)
from .comm import Pending, Transport, abandoned_on_failure
from .knobs import env_int
from .schedule import MemberLayout, Schedule


@dataclass(frozen=True)
class KernelOptions:
    """Per-call kernel options besides the mask (which the schedule gives each call)."""

    softmax_scale: Optional[float]
    softcap: Optional[float]
    backend: str
    deterministic: bool


class HeldKV:
    """K and V (or dK and dV) used in place: a member's own rows."""

    def __init__(self, k, v):
        self.k, self.v = k, v


class KVBuffer:
    """K and V of some key rows (or their fp32 gradients), as views of one flat buffer: what a transfer moves."""

    def __init__(self, flat: torch.Tensor, k_shape, v_shape):
        self.flat, self.k_shape, self.v_shape = flat, tuple(k_shape), tuple(v_shape)
        nk = _numel(k_shape)
        self.k = flat[:nk].view(k_shape)
        self.v = flat[nk:].view(v_shape)

    @staticmethod
    def shapes(k: torch.Tensor, v: torch.Tensor, length: int, seq_dim: int):
        ks, vs = list(k.shape), list(v.shape)
        ks[seq_dim] = vs[seq_dim] = length
        return ks, vs

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor, length: int, seq_dim: int, dtype=None) -> "KVBuffer":
        """A buffer for `length` rows shaped like k and v."""
        ks, vs = cls.shapes(k, v, length, seq_dim)
        flat = torch.empty(_numel(ks) + _numel(vs), dtype=dtype or k.dtype, device=k.device)
        return cls(flat, ks, vs)

    @classmethod
    def empty_like(cls, other: "KVBuffer", dtype=None) -> "KVBuffer":
        return cls(torch.empty(other.flat.shape, dtype=dtype or other.flat.dtype, device=other.flat.device),
                   other.k_shape, other.v_shape)

    @classmethod
    def gather(cls, k: torch.Tensor, v: torch.Tensor, ranges, seq_dim: int) -> "KVBuffer":
        """The rows of k and v in `ranges` ((start, length), ...), back to back."""
        buf = cls.empty(k, v, sum(n for _, n in ranges), seq_dim)
        at = 0
        for start, n in ranges:
            buf.k.narrow(seq_dim, at, n).copy_(k.narrow(seq_dim, start, n))
            buf.v.narrow(seq_dim, at, n).copy_(v.narrow(seq_dim, start, n))
            at += n
        return buf

    def rows(self, start: int, length: int, seq_dim: int) -> "HeldKV":
        """K and V of rows [start, start + length): views (contiguous where the buffer holds one sequence or packed
        rows, as a launch group's buffer does)."""
        return HeldKV(self.k.narrow(seq_dim, start, length), self.v.narrow(seq_dim, start, length))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class Accumulators:
    """The running fp32 (fp64 for fp64 inputs) ``out`` and ``lse`` of a member's rows, in its layout.  ``fresh``:
    no step has written yet, so the first step's work list writes where it can instead of merging (a merge is
    several passes for backends without a fused epilogue)."""

    out: torch.Tensor
    lse: torch.Tensor
    fresh: bool = False

    @classmethod
    def empty(cls, layout: MemberLayout, q: torch.Tensor, head_dim_v: int, packed: bool,
              first_items: Sequence[WorkItem] = ()) -> "Accumulators":
        """(0, -inf) for every row (what rows no key reaches keep), except the rows ``first_items`` cover: the first
        step's fresh call writes those (the result of merging into (0, -inf)), so they are not filled first (at a
        4096-token window and cp = 2 the two fills were ~3% of a member's forward)."""
        acc, n = accum_dtype(q.dtype), layout.length
        if packed:
            out = torch.empty(n, q.shape[1], head_dim_v, dtype=acc, device=q.device)
            lse = torch.empty((q.shape[1], n), dtype=acc, device=q.device)
        else:
            out = torch.empty(q.shape[0], n, q.shape[2], head_dim_v, dtype=acc, device=q.device)
            lse = torch.empty((q.shape[0], q.shape[2], n), dtype=acc, device=q.device)
        for a, b in uncovered_ranges([(it.q_start, it.q_start + it.q_len) for it in first_items], 0, n):
            out.narrow(0 if packed else 1, a, b - a).zero_()
            lse.narrow(-1, a, b - a).fill_(float("-inf"))
        return cls(out, lse, fresh=True)


class MemberForward:
    """A member's forward running result: the launches that compute (the own step first, then each launch group
    that received keys) merge into one fp32 ``(out, lse)`` in turn, rows the first launch writes left unfilled as in
    :class:`Accumulators`.  :func:`ring_forward` runs it between its transfers; ``bench/cp_sim.py`` times it.

    (Two running results on two CUDA streams, so that a launch's last partial wave overlaps the next launch, were
    tried in the forty-sixth / forty-seventh sessions and removed: the simulation read 3-5% lower with them at
    cp = 4 and 8, even with only two launches, bench/RESULTS.md.)

    ``overlap_launches``: every launch after the first may start while the one before it finishes (the contract's
    ``overlap_previous``, programmatic dependent launch on the cute backend), for a caller whose stream holds
    nothing between them that writes q or the keys: ``bench/cp_sim.py --directions fwd_pdl``, keys resident."""

    def __init__(self, layout: MemberLayout, q: torch.Tensor, head_dim_v: int, packed: bool,
                 first_items: Sequence[WorkItem], overlap_launches: bool = False):
        self.acc = Accumulators.empty(layout, q, head_dim_v, packed, first_items)
        self.overlap_launches = overlap_launches

    def launch(self, q: torch.Tensor, incoming: "IncomingKeys", opts: KernelOptions) -> None:
        """The next launch: `incoming`'s keys awaited, then its work list on them merged into the running result;
        nothing more where it received no keys."""
        held = incoming.wait()
        if held is not None:
            # (the running result is fresh until the first launch: that one follows unknown work)
            forward_items(q, held, incoming.items, self.acc, opts,
                          overlap_previous=self.overlap_launches and not self.acc.fresh)

    def result(self) -> Accumulators:
        return self.acc


def forward_items(q: torch.Tensor, kv, items, acc: Accumulators, opts: KernelOptions,
                  overlap_previous: bool = False) -> None:
    """A work list on the keys held in `kv` (a step's, or a launch group's), merged into `acc`: one call
    (``overlap_previous``: the contract's promise, :class:`MemberForward`)."""
    attention_forward_items(q, kv.k, kv.v, items, acc.out, acc.lse, softmax_scale=opts.softmax_scale,
                            softcap=opts.softcap, fresh=acc.fresh, backend=opts.backend,
                            overlap_previous=overlap_previous)
    acc.fresh = False


def backward_step(sched: Schedule, member: int, source: int, dout: Optional[torch.Tensor], q: torch.Tensor, kv,
                  out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dkv, opts: KernelOptions,
                  items=None, shared=None, fresh_dkv: bool = False, dlse=None) -> None:
    """Member `member`'s backward work list against `source`'s keys (or the given part of it): adds into the fp32
    `dq` (member layout; or into `shared`, the member's shared query side, until its finish) and the dK/dV buffer
    `dkv` (laid out like `kv`): one call. `fresh_dkv`: `dkv` holds nothing yet (written, zeros where no item is).
    `dlse`: the member's rows' lse gradient (lse's layout), which joins every step's gradients; `dout` None with it:
    a loss of the lse alone (as the work list takes it)."""
    items = sched.items(member, source) if items is None else items
    if items:
        attention_backward_items(dout, q, kv.k, kv.v, out, lse, items, dq, dkv.k, dkv.v,
                                 softmax_scale=opts.softmax_scale, softcap=opts.softcap,
                                 deterministic=opts.deterministic, backend=opts.backend, shared=shared,
                                 fresh_dkv=fresh_dkv, dlse=dlse)
    elif fresh_dkv:
        dkv.k.zero_()
        dkv.v.zero_()


@dataclass
class RingPeers:
    """The ring members as ranks of `transport`'s group; this process is member `index`."""

    transport: Optional[Transport]
    ranks: list
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, member: int) -> int:
        return self.ranks[member % self.size]


MAX_RANGE_MESSAGES = 8  # more row ranges than this in one step's send are packed (each message has its latency)
# message tags: K and V of a ring step (gloo matches by tag, NCCL by posting order; both sides post alike)
_KEY_TAGS = {"forward": (10, 11), "backward": (20, 22)}
_GRADS_TAGS = (21, 23)  # a backward step's dK / dV partial, back to the keys' owner


class _Exchange:
    """The point-to-point transfers of this member's ring steps: key rows out and in, and (backward) their fp32
    gradients back to the owner."""

    def __init__(self, sched: Schedule, ring: RingPeers, k: torch.Tensor, v: torch.Tensor, direction: str):
        self.sched, self.ring, self.k, self.v, self.direction = sched, ring, k, v, direction
        self.sd = 0 if sched.plan.packed else 1
        self._packed: dict = {}  # gathered send buffers by ranges (a dense batch's send is packed once)
        # one message pair per row range, each a view of the rows it moves (no pack copy), where every member's
        # ranges are contiguous rows: one sequence or packed documents (the batch is agreed by every rank)
        self._per_range = grouped_launch_allowed(sched, k)
        self._posted: list = []  # this call's transfers (Pending), to tell whether any is still in flight

    def abandoned_on_failure(self):
        """Runs a member's ring steps (:func:`~fa4dist.context_parallel.comm.abandoned_on_failure`: an error with
        transfers of this call in flight records the group as out of step)."""
        return abandoned_on_failure(self.ring.transport, self._posted,
                                    f"its {self.direction} ring steps with transfers")

    def _by_range(self, ranges) -> bool:
        """Whether rows `ranges` travel as one message pair per range (else packed into one pair): a function of
        the agreed batch and the schedule, so the sender and the receiver pick alike."""
        return self._per_range and len(ranges) <= MAX_RANGE_MESSAGES

    def _send_parts(self, ranges) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (K, V) messages that carry this member's rows `ranges` (merged, sorted): one pair per range, views of
        its own rows (copied only where the caller's tensors are strided), or (a dense batch, or many ranges) one
        pair packed once per call.  (The pack was a copy of all of a member's K / V per direction at cp = 2.)"""
        if self._by_range(ranges):
            parts = []
            for start, n in ranges:
                pair = (self.k.narrow(self.sd, start, n), self.v.narrow(self.sd, start, n))
                parts.append(tuple(t if t.is_contiguous() else t.contiguous() for t in pair))
            return parts
        buf = self._packed.get(ranges)
        if buf is None:
            buf = self._packed[ranges] = KVBuffer.gather(self.k, self.v, ranges, self.sd)
        return [(buf.k, buf.v)]

    def _recv_parts(self, held: KVBuffer, at: int, ranges) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Where the sender's :meth:`_send_parts` messages of rows `ranges` land in `held`, from its row `at` on."""
        sd = self.sd
        if not self._by_range(ranges):
            total = sum(n for _, n in ranges)
            return [(held.k.narrow(sd, at, total), held.v.narrow(sd, at, total))]
        parts = []
        for _, n in ranges:
            parts.append((held.k.narrow(sd, at, n), held.v.narrow(sd, at, n)))
            at += n
        return parts

    def post_keys(self, step: int) -> "IncomingKeys":
        """Posts step `step`'s sends and receives of key rows; returns what will hold the received rows (with the
        step's work list on them)."""
        sched, ring, m = self.sched, self.ring, self.ring.index
        send_ranges, recv_len = sched.send_ranges(m, step), sched.recv_len(m, step)
        k_tag, v_tag = _KEY_TAGS[self.direction]
        sends, recvs = [], []
        if send_ranges:
            peer = ring.peer(sched.dest(m, step))
            sends = [msg for kp, vp in self._send_parts(send_ranges) for msg in ((kp, peer, k_tag), (vp, peer, v_tag))]
        held = KVBuffer.empty(self.k, self.v, recv_len, self.sd) if recv_len else None
        if held is not None:
            source = sched.source(m, step)
            peer = ring.peer(source)
            recvs = [msg for kp, vp in self._recv_parts(held, 0, sched.needed(m, source))
                     for msg in ((kp, peer, k_tag), (vp, peer, v_tag))]
        items = sched.items(m, sched.source(m, step)) if held is not None else ()
        return IncomingKeys(self._post(sends, recvs, f"K/V of {self.direction} ring step {step}"), held, items,
                            ((step, 0, recv_len),))

    def post_key_group(self, group: tuple[int, ...]) -> "IncomingKeys":
        """Posts the key transfers of the steps of `group` (:meth:`Schedule.launch_groups`) at once; each step's rows
        land in place in one buffer for the group (K and V as two messages, into the group's K and V views), which
        the group's one work list reads.  A group of one step is :meth:`post_keys`."""
        sched, ring, m, sd = self.sched, self.ring, self.ring.index, self.sd
        if len(group) == 1:
            return self.post_keys(group[0])
        places, items = sched.group_items(m, group)
        total = sum(n for _, _, n in places)
        held = KVBuffer.empty(self.k, self.v, total, sd) if total else None
        k_tag, v_tag = _KEY_TAGS[self.direction]
        sends, recvs = [], []
        for t in group:
            send_ranges = sched.send_ranges(m, t)
            if send_ranges:
                peer = ring.peer(sched.dest(m, t))
                sends += [msg for kp, vp in self._send_parts(send_ranges)
                          for msg in ((kp, peer, k_tag), (vp, peer, v_tag))]
        for t, at, n in places:
            if n:
                source = sched.source(m, t)
                parts = self._recv_parts(held, at, sched.needed(m, source))
                if not all(p.is_contiguous() for pair in parts for p in pair):  # grouped_launch_allowed rules it out
                    raise AssertionError("a grouped ring step's rows must be contiguous in the group buffer")
                recvs += [msg for kp, vp in parts for msg in ((kp, ring.peer(source), k_tag),
                                                               (vp, ring.peer(source), v_tag))]
        pending = self._post(sends, recvs, f"K/V of {self.direction} ring steps {list(group)}")
        return IncomingKeys(pending, held, items if held is not None else (), places)

    def post_grads(self, step: int, partial, acc) -> "ReturningGrads":
        """Posts the return of step `step`'s dK/dV partial (a :class:`KVBuffer`, or a launch group's rows of one,
        :meth:`KVBuffer.rows`: K and V each contiguous) to the keys' owner, and the receive of the partial for the
        rows this member sent at that step."""
        sched, ring, m = self.sched, self.ring, self.ring.index
        sent = sched.send_ranges(m, step)
        sends, recvs = [], []
        if partial is not None:
            peer = ring.peer(sched.source(m, step))
            sends = [(partial.k, peer, _GRADS_TAGS[0]), (partial.v, peer, _GRADS_TAGS[1])]
        incoming = KVBuffer.empty(self.k, self.v, sum(n for _, n in sent), self.sd, dtype=acc) if sent else None
        if incoming is not None:
            peer = ring.peer(sched.dest(m, step))
            recvs = [(incoming.k, peer, _GRADS_TAGS[0]), (incoming.v, peer, _GRADS_TAGS[1])]
        pending = self._post(sends, recvs, f"dK/dV of backward ring step {step}")
        return ReturningGrads(pending, incoming, sent, self.sd, partial)

    def _post(self, sends, recvs, what: str) -> Optional[Pending]:
        """Posts tagged messages, (tensor, group peer, tag) each; None where there are none."""
        if not sends and not recvs:
            return None
        pending = self.ring.transport.post_tagged(sends, recvs, what)
        self._posted.append(pending)
        return pending


@dataclass
class IncomingKeys:
    """Key rows on their way (``pending``: the transfer, None for rows already here) into ``held``, with the work
    list to run on them."""

    pending: Optional[Pending]
    held: Optional[KVBuffer]
    items: tuple = ()  # the work list on `held` (a step's, or a launch group's)
    places: tuple = ()  # ((step, first row in `held`, rows), ...): where each step's rows are

    def wait(self) -> Optional[KVBuffer]:
        if self.pending is not None:
            self.pending.wait()
        return self.held


@dataclass
class ReturningGrads:
    """A backward step's dK/dV partial on its way back (``pending``: the transfer, None for one already here) into
    ``incoming``, for this member's rows ``ranges`` (back to back there); :func:`add_returns` adds it into the
    member's dK/dV."""

    pending: Optional[Pending]
    incoming: Optional[KVBuffer]
    ranges: tuple
    seq_dim: int
    partial: object = None  # this member's partial for the step (or its rows of a group's), alive until sent

    def wait(self) -> Optional[KVBuffer]:
        if self.pending is not None:
            self.pending.wait()
        return self.incoming


def add_returns(returns, dk: torch.Tensor, dv: torch.Tensor, seq_dim: int) -> None:
    """Adds the returned partials ``returns`` (:class:`ReturningGrads` in step order; None: nothing came) into dk /
    dv.  Every row gets its returns' rows in step order, the bits of adding the returns one after another; each
    stretch of rows that two or more returns cover is summed in one pass where the CuTe DSL is at hand
    (``kernels/cute/sum_into.py``: each partial read once, dK / dV read and written once, against once per return),
    else with torch's adds in the same order."""
    pieces = []  # (first row, end row, return index, row in the return's buffer)
    held = []
    for g in returns:
        incoming = None if g is None else g.wait()
        if incoming is None:
            continue
        at = 0
        for start, n in g.ranges:
            pieces.append((start, start + n, len(held), at))
            at += n
        held.append(incoming)
    if not pieces:
        return
    fused = None
    cuts = sorted({p[0] for p in pieces} | {p[1] for p in pieces})
    for a, b in zip(cuts, cuts[1:]):
        covering = sorted((i, at + a - start) for start, end, i, at in pieces if start <= a and b <= end)
        for dst, part in ((dk, "k"), (dv, "v")):
            rows = dst.narrow(seq_dim, a, b - a)
            sources = [getattr(held[i], part).narrow(seq_dim, at, b - a) for i, at in covering]
            if len(sources) > 1:
                if fused is None:
                    fused = _fused_sum(dst)
                if fused is not None and fused(rows, sources):
                    continue
            for src in sources:
                rows.add_(src)


def _fused_sum(t: torch.Tensor):
    """kernels/cute/sum_into.sum_into where it can run for tensors like `t` (CUDA, the CuTe DSL importable), else
    None."""
    if not t.is_cuda:
        return None
    from ..kernels.cute import host

    if not host.cutlass_importable():
        return None
    from ..kernels.cute.sum_into import sum_into

    return sum_into


STEPS_PER_LAUNCH_ENV = "FA4DIST_RING_STEPS_PER_LAUNCH"


def grouped_launch_allowed(sched: Schedule, k: torch.Tensor) -> bool:
    """Whether a launch group's steps can land in place in one buffer: each step's rows are contiguous there only in
    the packed layout or for one sequence (batch 1); dense batches keep one launch per step."""
    return sched.plan.packed or k.shape[0] == 1


AUTO_STEPS_PER_LAUNCH = "auto"


def requested_steps_per_launch() -> "int | str":
    """The ring's remote steps per launch this process asks for: ``FA4DIST_RING_STEPS_PER_LAUNCH`` (an int >= 0;
    0: all remote steps in one launch; ``auto``: half the schedule's remote steps, :func:`ring_steps_per_launch`),
    else 1 (part of a call's agreed signature: :mod:`~fa4dist.context_parallel.knobs`)."""
    text = os.environ.get(STEPS_PER_LAUNCH_ENV)
    if text is not None and text.strip().lower() == AUTO_STEPS_PER_LAUNCH:
        return AUTO_STEPS_PER_LAUNCH
    return env_int(STEPS_PER_LAUNCH_ENV, 1, 0, None, "0: every remote step in one launch; or auto")


def ring_steps_per_launch(sched: Schedule, k: torch.Tensor, requested: "int | str | None" = None) -> int:
    """The ring's remote steps per launch, forward and backward alike (:meth:`Schedule.launch_groups`; 0: all):
    `requested` (default :func:`requested_steps_per_launch`), or 1 where :func:`grouped_launch_allowed` says no.
    ``auto``: ceil(remote steps / 2), two launch groups (one step at cp = 2), the setting the one-GPU simulation
    favours on one NVLink host (bench/RESULTS.md, fiftieth and fifty-first sessions: each group's transfers land
    under the previous launch by its model).  A function of the schedule, the shapes and the agreed request alone,
    so every member picks the same groups."""
    requested = requested_steps_per_launch() if requested is None else requested
    if requested == AUTO_STEPS_PER_LAUNCH:
        requested = max(1, -(-len(sched.steps()) // 2))
    sched.launch_groups(requested)  # checks it
    return requested if grouped_launch_allowed(sched, k) else 1


def ring_forward(sched: Schedule, ring: RingPeers, q, k, v, opts: KernelOptions,
                 steps_per_launch: "int | str | None" = None) -> Accumulators:
    """The fp32 (out, lse) of this member's queries over every member's keys: its own keys first (while the first
    remote keys travel), then the remote steps in launch groups (:func:`ring_steps_per_launch`), each group's
    transfers posted before the previous group computes, all merged into one running result
    (:class:`MemberForward`)."""
    m = ring.index
    groups = sched.launch_groups(ring_steps_per_launch(sched, k, steps_per_launch))
    running = MemberForward(sched.members[m], q, v.shape[-1], sched.plan.packed, sched.items(m, m))
    exchange = _Exchange(sched, ring, k, v, "forward")
    with exchange.abandoned_on_failure():
        incoming = exchange.post_key_group(groups[0]) if groups else None
        running.launch(q, IncomingKeys(None, HeldKV(k, v), sched.items(m, m)), opts)
        for i, group in enumerate(groups):
            following = exchange.post_key_group(groups[i + 1]) if i + 1 < len(groups) else None
            running.launch(q, incoming, opts)
            incoming = following
    return running.result()


def ring_backward(sched: Schedule, ring: RingPeers, dout, q, k, v, out, lse, opts: KernelOptions, dlse=None,
                  steps_per_launch: "int | str | None" = None):
    """Returns (dq, dk, dv) of this member's tokens in the accumulation dtype; ``dlse``: its rows' lse gradient
    (lse's layout, the accumulation dtype), joined to out's in the same steps; ``dout=None`` with it: a loss of the
    lse alone (dv is zero; a backend without ``lse_gradient`` runs each step's lse pass only, with no pass of a zero
    dout).  The remote steps run in the forward's launch groups (:func:`ring_steps_per_launch`)."""
    groups = sched.launch_groups(ring_steps_per_launch(sched, k, steps_per_launch))
    exchange = _Exchange(sched, ring, k, v, "backward")
    with exchange.abandoned_on_failure():
        return _ring_backward_steps(sched, ring, exchange, groups, dout, q, k, v, out, lse, opts, dlse)


class MemberBackward:
    """A member's backward in the ring's order: the first half of its own keys' work (:meth:`Schedule.own_halves`,
    while the first remote keys travel), each remote step's keys (dQ into the member's rows, dK/dV into a fresh
    fp32 partial for their owner), the second half of its own keys (while the last partial travels back), then
    the shared query side's dQ.  :func:`ring_backward` runs it between its transfers; ``bench/cp_sim.py`` times it.

    ``remote``: the ring has remote steps (else the own keys' work is one call, with no shared query side)."""

    def __init__(self, sched: Schedule, member: int, dout, q, k, v, out, lse, opts: KernelOptions, dlse=None,
                 remote: bool = True):
        self.sched, self.member, self.opts = sched, member, opts
        self.dout, self.q, self.k, self.v, self.out, self.lse, self.dlse = dout, q, k, v, out, lse, dlse
        self.acc = accum_dtype(q.dtype)
        self.seq_dim = 0 if sched.plan.packed else 1
        self.dq = torch.zeros(q.shape, dtype=self.acc, device=q.device)
        # dK / dV buffers are written by their first step's kernels (fresh_dkv), not zero-filled first: at cp = 8
        # the fills were ~1.5% of a member's backward
        self.dk = torch.empty(k.shape, dtype=self.acc, device=k.device)
        self.dv = torch.empty(v.shape, dtype=self.acc, device=v.device)
        self.shared = share_queries(dout, q, out, lse, softmax_scale=opts.softmax_scale, softcap=opts.softcap,
                                    deterministic=opts.deterministic, backend=opts.backend,
                                    dlse=dlse) if remote else None
        self.own_first, self.own_last = sched.own_halves(member) if remote else (sched.items(member, member), ())

    def own_start(self) -> None:
        """The first half of the own keys' work (writes dK/dV)."""
        self._own(self.own_first, fresh_dkv=True)

    def own_end(self) -> None:
        """The second half of the own keys' work (adds into dK/dV)."""
        self._own(self.own_last, fresh_dkv=False)

    def _own(self, items, fresh_dkv: bool) -> None:
        m = self.member
        backward_step(self.sched, m, m, self.dout, self.q, HeldKV(self.k, self.v), self.out, self.lse, self.dq,
                      HeldKV(self.dk, self.dv), self.opts, items, self.shared, fresh_dkv=fresh_dkv, dlse=self.dlse)

    def remote(self, incoming: IncomingKeys) -> Optional[KVBuffer]:
        """The keys `incoming` holds (awaited; a step's or a launch group's, with its work list; None: nothing
        received): their fp32 dK/dV partial, laid out as the keys, to return to their owners."""
        held = incoming.wait()
        if held is None:
            return None
        partial = KVBuffer.empty_like(held, dtype=self.acc)
        backward_step(self.sched, self.member, None, self.dout, self.q, held, self.out, self.lse, self.dq, partial,
                      self.opts, incoming.items, shared=self.shared, fresh_dkv=True, dlse=self.dlse)
        return partial

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv): the shared query side's dQ added into dq (dk / dv take the returned partials after)."""
        if self.shared is not None:
            self.shared.finish(self.dq)
        return self.dq, self.dk, self.dv


def member_backward_steps(member: MemberBackward, groups, receive, give_back):
    """(dq, dk, dv) of `member` in the ring's order: the first half of its own keys' work, then for each launch
    group of remote steps (:meth:`Schedule.launch_groups`; one step each by default) its keys' backward in one call
    (``receive(i, group)``: the :class:`IncomingKeys` of the i-th group), each step's rows of the partial handed to
    ``give_back(t, rows)`` (None where nothing came), which returns the :class:`ReturningGrads` for the rows this
    member sent at ``t`` (None: it sent none; a group's returns are added one group later, in step order,
    :func:`add_returns`), then the second half of its own keys, the shared query side's dQ, and the last group's
    returns.  :func:`ring_backward` runs it with its transfers,
    ``bench/cp_sim.py`` with keys and returns already at hand."""
    member.own_start()
    returning = ()
    for i, group in enumerate(groups):
        incoming = receive(i, group)
        partial = member.remote(incoming)
        posted = [give_back(t, None if partial is None or not n else partial.rows(at, n, member.seq_dim))
                  for t, at, n in incoming.places]
        add_returns(returning, member.dk, member.dv, member.seq_dim)  # the previous group's, in step order
        returning = posted
    member.own_end()
    dq, dk, dv = member.finish()
    add_returns(returning, dk, dv, member.seq_dim)
    return dq, dk, dv


def _ring_backward_steps(sched: Schedule, ring: RingPeers, exchange: _Exchange, groups, dout, q, k, v, out, lse,
                         opts: KernelOptions, dlse):
    """:func:`ring_backward`'s steps, inside its exchange's failure guard: each launch group's keys posted one group
    ahead (the first before the own keys' work), each partial posted back as soon as it is computed."""
    posted = [exchange.post_key_group(groups[0])] if groups else []
    member = MemberBackward(sched, ring.index, dout, q, k, v, out, lse, opts, dlse, remote=bool(groups))

    def receive(i, group):
        incoming = posted.pop()
        if i + 1 < len(groups):  # the next group's transfers travel while this one computes
            posted.append(exchange.post_key_group(groups[i + 1]))
        return incoming

    def give_back(t, partial):
        return exchange.post_grads(t, partial, member.acc)

    return member_backward_steps(member, groups, receive, give_back)
