"""Ring attention over the members of a :class:`~fa4dist.context_parallel.schedule.Schedule`.

Forward: K and V (at the KV head count, packed into one flat buffer) go round the ring, double-buffered: the
transfer for step t+1 is posted before step t computes.  Every step makes the schedule's contract calls for the
held keys with ``accumulate=True`` into per-block fp32 (fp64 for fp64 inputs) running ``(out, lse)``, so nothing
is rounded between steps; the merge order is (step, query block, key block), a function of the plan alone.

Backward: K and V go round again; each step recomputes its blocks against the global ``(out, lse)`` with
``attention_backward``, adding dQ into local fp32 buffers and dK/dV into a fresh fp32 partial, which is added to
the accumulated dK/dV arriving from the previous member (it trails K/V by one step, so the transfer overlaps the
next step's compute) and sent on; after the last step every member receives its own keys' dK/dV.

``batch_isend_irecv`` posts each step's send and receive together, so no member blocks another for any ring size,
odd sizes included.  ``forward_step`` and ``backward_step`` are also what ``bench/cp_sim.py`` times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import attention_backward, attention_forward
from .comm import Transport
from .schedule import MemberLayout, PairCall, Schedule


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KernelOptions:
    causal: bool
    softmax_scale: Optional[float]
    backend: str
    deterministic: bool


class _Held:
    """K and V used in place (a ring of one member sends nothing, so needs no buffer)."""

    def __init__(self, k, v):
        self.k, self.v = k, v


class KVBuffer:
    """K and V of one member, padded to the schedule's buffer length, as views of one flat buffer."""

    def __init__(self, flat: torch.Tensor, k_shape, v_shape):
        self.flat, self.k_shape, self.v_shape = flat, tuple(k_shape), tuple(v_shape)
        nk = 1
        for s in k_shape:
            nk *= s
        self.k = flat[:nk].view(k_shape)
        self.v = flat[nk:].view(v_shape)

    @staticmethod
    def shapes(k: torch.Tensor, v: torch.Tensor, length: int, seq_dim: int):
        ks, vs = list(k.shape), list(v.shape)
        ks[seq_dim] = vs[seq_dim] = length
        return ks, vs

    @classmethod
    def empty_like(cls, other: "KVBuffer", dtype=None) -> "KVBuffer":
        return cls(torch.empty(other.flat.shape, dtype=dtype or other.flat.dtype, device=other.flat.device),
                   other.k_shape, other.v_shape)

    @classmethod
    def zeros_like(cls, other: "KVBuffer", dtype=None) -> "KVBuffer":
        return cls(torch.zeros(other.flat.shape, dtype=dtype or other.flat.dtype, device=other.flat.device),
                   other.k_shape, other.v_shape)

    @classmethod
    def pack(cls, k: torch.Tensor, v: torch.Tensor, length: int, seq_dim: int) -> "KVBuffer":
        ks, vs = cls.shapes(k, v, length, seq_dim)
        n = _numel(ks) + _numel(vs)
        buf = cls(torch.empty(n, dtype=k.dtype, device=k.device), ks, vs)
        buf.k.narrow(seq_dim, 0, k.shape[seq_dim]).copy_(k)
        buf.v.narrow(seq_dim, 0, v.shape[seq_dim]).copy_(v)
        if length > k.shape[seq_dim]:  # padding is never read by a kernel; zero it so no NaN garbage travels
            buf.k.narrow(seq_dim, k.shape[seq_dim], length - k.shape[seq_dim]).zero_()
            buf.v.narrow(seq_dim, v.shape[seq_dim], length - v.shape[seq_dim]).zero_()
        return buf


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Cu:
    """int32 cu_seqlens tensors per (values, device), made once (the contract caches their host copies)."""

    def __init__(self):
        self._cache: dict = {}

    def __call__(self, values, device) -> torch.Tensor:
        key = (values, str(device))
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) >= 512:  # per-sample document structures: bounded
                self._cache.clear()
            t = self._cache[key] = torch.tensor(values, dtype=torch.int32, device=device)
        return t


_CU = _Cu()


def _call_views(call: PairCall, packed: bool, q_layout: MemberLayout, k_layout: MemberLayout, seq_dim: int):
    """Slices (along the token dim) of the member tensors for one call, and whether to add a batch dim of 1."""
    qb, kb = q_layout.blocks[call.q_block], k_layout.blocks[call.k_block]
    q_rows = (qb.offset + call.q_start, call.q_len)
    k_rows = (kb.offset + call.k_start, call.k_len)
    block_rows = (call.q_start, call.q_len)  # rows within the query block's accumulators
    unsqueeze = packed and call.cu_seqlens is None
    return q_rows, k_rows, block_rows, unsqueeze


def _mask_kwargs(call: PairCall, opts: KernelOptions, device):
    kw = dict(causal=call.causal, softmax_scale=opts.softmax_scale, q_offset=call.q_offset, k_offset=call.k_offset)
    if call.cu_seqlens is not None:
        cu = _CU(call.cu_seqlens, device)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    return kw


class Accumulators(list):
    """Per query block: the running out (zeros) and lse (-inf) in the accumulation dtype.  A block's first call
    that covers all its rows writes instead of merging (one pass instead of a merge's several)."""

    def __init__(self, outs, lses):
        super().__init__([outs, lses])
        self.fresh = [True] * len(outs)


def new_accumulators(layout: MemberLayout, q: torch.Tensor, head_dim_v: int, packed: bool) -> Accumulators:
    """(outs, lses) per query block, unpackable as a pair."""
    acc = accum_dtype(q.dtype)
    outs, lses = [], []
    for b in layout.blocks:
        if packed:
            outs.append(torch.zeros(b.length, q.shape[1], head_dim_v, dtype=acc, device=q.device))
            lses.append(torch.full((q.shape[1], b.length), float("-inf"), dtype=acc, device=q.device))
        else:
            outs.append(torch.zeros(q.shape[0], b.length, q.shape[2], head_dim_v, dtype=acc, device=q.device))
            lses.append(torch.full((q.shape[0], q.shape[2], b.length), float("-inf"), dtype=acc, device=q.device))
    return Accumulators(outs, lses)


def forward_step(sched: Schedule, member: int, source: int, q: torch.Tensor, kv, acc: Accumulators,
                 opts: KernelOptions) -> None:
    """Member `member`'s contract calls against `source`'s keys (held in `kv`), merged into `acc`."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    q_layout, k_layout = sched.members[member], sched.members[source]
    outs, lses = acc
    for call in sched.calls(member, source):
        q_rows, k_rows, rows, unsq = _call_views(call, packed, q_layout, k_layout, sd)
        qc = q.narrow(sd, *q_rows)
        kc, vc = kv.k.narrow(sd, *k_rows), kv.v.narrow(sd, *k_rows)
        out, lse = outs[call.q_block], lses[call.q_block]
        whole = call.q_start == 0 and call.q_len == q_layout.blocks[call.q_block].length
        accumulate = not (whole and acc.fresh[call.q_block])
        acc.fresh[call.q_block] = False
        if packed:
            out, lse = out.narrow(0, *rows), lse.narrow(1, *rows)
        if unsq:
            qc, kc, vc, out, lse = (t.unsqueeze(0) for t in (qc, kc, vc, out, lse))
        attention_forward(qc, kc, vc, out=out, lse=lse, accumulate=accumulate, backend=opts.backend,
                          **_mask_kwargs(call, opts, q.device))


def backward_step(sched: Schedule, member: int, source: int, dout: torch.Tensor, q: torch.Tensor, kv: KVBuffer,
                  out: torch.Tensor, lses, dqs, dkv: KVBuffer, opts: KernelOptions) -> None:
    """Member `member`'s backward calls against `source`'s keys: adds into the per-block dQ accumulators `dqs` and
    the dK/dV buffer `dkv` (laid out like `kv`)."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    q_layout, k_layout = sched.members[member], sched.members[source]
    for call in sched.calls(member, source):
        q_rows, k_rows, rows, unsq = _call_views(call, packed, q_layout, k_layout, sd)
        qc, doc, oc = (t.narrow(sd, *q_rows) for t in (q, dout, out))
        kc, vc = kv.k.narrow(sd, *k_rows), kv.v.narrow(sd, *k_rows)
        dkc, dvc = dkv.k.narrow(sd, *k_rows), dkv.v.narrow(sd, *k_rows)
        lse, dq = lses[call.q_block], dqs[call.q_block]
        if packed:
            lse, dq = lse.narrow(1, *rows), dq.narrow(0, *rows)
        tensors = (doc, qc, kc, vc, oc, lse, dq, dkc, dvc)
        if unsq:
            tensors = tuple(t.unsqueeze(0) for t in tensors)
        doc, qc, kc, vc, oc, lse, dq, dkc, dvc = tensors
        attention_backward(doc, qc, kc, vc, oc, lse, dq=dq, dk=dkc, dv=dvc, accumulate=True,
                           deterministic=opts.deterministic, backend=opts.backend,
                           **_mask_kwargs(call, opts, q.device))


@dataclass
class RingPeers:
    """The ring members as ranks of `transport`'s group; this process is member `index`."""

    transport: Optional[Transport]
    ranks: list
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]


def ring_forward(sched: Schedule, ring: RingPeers, q, k, v, opts: KernelOptions):
    """Returns per-block (outs, lses) of this member's queries over every member's keys."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    m, R = ring.index, sched.ring_size
    acc = new_accumulators(sched.members[m], q, v.shape[-1], packed)
    if R == 1:
        forward_step(sched, m, m, q, _Held(k, v), acc, opts)
        return acc
    bufs = [KVBuffer.pack(k, v, sched.buffer_len, sd)]
    bufs.append(KVBuffer.empty_like(bufs[0]))
    for t in range(R):
        cur = bufs[t % 2]
        pending = None
        if t + 1 < R:
            pending = ring.transport.post(
                [(cur.flat, ring.next())], [(bufs[(t + 1) % 2].flat, ring.prev())],
                f"K/V of forward ring step {t + 1}", tag=10,
            )
        forward_step(sched, m, sched.source(m, t), q, cur, acc, opts)
        if pending is not None:
            pending.wait()
    return acc


def ring_backward(sched: Schedule, ring: RingPeers, dout, q, k, v, out, lses, opts: KernelOptions):
    """Returns (dq, dk, dv) of this member's tokens in the accumulation dtype."""
    packed = sched.plan.packed
    sd = 0 if packed else 1
    m, R = ring.index, sched.ring_size
    acc = accum_dtype(q.dtype)
    layout = sched.members[m]
    dqs = [torch.zeros(o.shape, dtype=acc, device=q.device) for o in _block_views(q, layout, sd)]
    if R == 1:
        dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
        backward_step(sched, m, m, dout, q, _Held(k, v), out, lses, dqs, _Held(dk, dv), opts)
        return torch.cat(dqs, dim=sd) if dqs else torch.zeros(q.shape, dtype=acc, device=q.device), dk, dv
    bufs = [KVBuffer.pack(k, v, sched.buffer_len, sd)]
    if R > 1:
        bufs.append(KVBuffer.empty_like(bufs[0]))
    dkv_pending, dkv_incoming = None, None
    for t in range(R):
        cur = bufs[t % 2]
        kv_pending = None
        if t + 1 < R:
            kv_pending = ring.transport.post(
                [(cur.flat, ring.next())], [(bufs[(t + 1) % 2].flat, ring.prev())],
                f"K/V of backward ring step {t + 1}", tag=20,
            )
        partial = KVBuffer.zeros_like(cur, dtype=acc)
        backward_step(sched, m, sched.source(m, t), dout, q, cur, out, lses, dqs, partial, opts)
        if dkv_pending is not None:
            dkv_pending.wait()
            dkv_incoming.flat.add_(partial.flat)
            partial = dkv_incoming
        if R > 1:
            dkv_incoming = KVBuffer.empty_like(partial)
            what = f"dK/dV after backward ring step {t}" if t + 1 < R else "this rank's own dK/dV (end of the ring)"
            dkv_pending = ring.transport.post(
                [(partial.flat, ring.next())], [(dkv_incoming.flat, ring.prev())], what, tag=21,
            )
        if kv_pending is not None:
            kv_pending.wait()
    if R > 1:
        dkv_pending.wait()
        partial = dkv_incoming
    n = layout.length
    dq = torch.cat(dqs, dim=sd) if dqs else torch.zeros_like(q, dtype=acc)
    return dq, partial.k.narrow(sd, 0, n), partial.v.narrow(sd, 0, n)


def _block_views(x: torch.Tensor, layout: MemberLayout, sd: int):
    return [x.narrow(sd, b.offset, b.length) for b in layout.blocks]


def concat_blocks(blocks, dim: int, like: torch.Tensor, empty_shape) -> torch.Tensor:
    if blocks:
        return torch.cat(blocks, dim=dim)
    return torch.zeros(empty_shape, dtype=like.dtype, device=like.device)
