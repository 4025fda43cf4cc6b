"""cp_invariant numerics: one definition of every result that does not depend on how ranks split the work.

The rule (for any backend, compared with itself):

- a query row's ``out``, ``lse`` and ``dq`` come from one contract call whose keys are *all* the keys of the row's
  document (sequence or packed segment), starting at the document's first key: the backend's key tiles then sit
  at the same document positions whatever the layout, and a row's result depends only on the row;
- a key's ``dk`` and ``dv`` come from one contract call whose queries are *all* the queries of its document,
  starting at the first: the query tiles whose contributions a key sums are the same in every layout;
- results are computed into fp32 buffers (``accumulate`` into zeros) and rounded to the input dtype once;
- GQA: keys and values are expanded to one head per query head, so ``dk``/``dv`` exist per query head, and a
  key/value head's gradient is the sum over its query heads in ascending head order (never a sum over a subset
  first, which is what a Ulysses head split would otherwise do).

One device computes it with one call per document (the backward's one call gives both the rows' dq and the keys'
dk/dv); context parallelism gathers the other ranks' keys (forward, dq) and queries (dk, dv) and makes the same
calls for its own rows and keys (:mod:`fa4dist.context_parallel.gather`).  Backends must be row-independent and
deterministic (the reference is; the CuTe kernels are by construction, in deterministic mode).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .worklist import WorkItem, attention_backward_items, attention_forward_items


ENV = "FA4DIST_CP_INVARIANT"


def enabled(cp_invariant: Optional[bool]) -> bool:
    """The mode asked for: the argument, or (None) the environment variable FA4DIST_CP_INVARIANT=1."""
    if cp_invariant is None:
        value = os.environ.get(ENV, "0").strip().lower()
        if value not in ("", "0", "1", "false", "true", "no", "yes"):
            raise ValueError(f"{ENV} must be 0 or 1, got {os.environ[ENV]!r}")
        return value in ("1", "true", "yes")
    if not isinstance(cp_invariant, bool):
        raise TypeError(f"cp_invariant must be a bool or None, got {type(cp_invariant).__name__}")
    return cp_invariant


def expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(..., heads_kv, d) -> (..., heads_kv * group, d): query head h reads key/value head h // group."""
    return t if group == 1 else t.repeat_interleave(group, dim=-2)


def sum_group(grad: torch.Tensor, group: int) -> torch.Tensor:
    """(..., heads_kv * group, d) per query head -> (..., heads_kv, d): the group's heads added in ascending order."""
    if group == 1:
        return grad
    parts = grad.unflatten(-2, (-1, group))
    total = parts[..., 0, :].clone()
    for g in range(1, group):
        total += parts[..., g, :]
    return total


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(q, k, v, items: list[WorkItem], *, softmax_scale=None, softcap=None, backend="auto"):
    """(out fp32, lse) of the rows the items cover (every row by exactly one item), keys already expanded."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
    lse_shape = (q.shape[-2], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, float("-inf"), dtype=acc, device=q.device)
    attention_forward_items(q, k, v, items, out, lse, softmax_scale=softmax_scale, softcap=softcap, fresh=True,
                            backend=backend, cp_invariant=True)
    return out, lse


def backward(dout, q, k, v, out, lse, items: list[WorkItem], *, softmax_scale=None, softcap=None, backend="auto",
             grads: str = "all"):
    """fp32 (dq, dk, dv) of the items (keys already expanded; deterministic kernels), added into zeros.
    ``grads="dq"`` / ``"dkv"``: only those (the others are None and not computed; the kept ones have the same bits
    as with ``"all"``, since each is its own sum in the kernels)."""
    if grads not in ("all", "dq", "dkv"):
        raise ValueError(f"grads must be 'all', 'dq' or 'dkv', got {grads!r}")
    acc = accum_dtype(q.dtype)
    wanted = {"all": (True, True, True), "dq": (True, False, False), "dkv": (False, True, True)}[grads]
    bufs = [torch.zeros(t.shape, dtype=acc, device=t.device) if want else None for t, want in zip((q, k, v), wanted)]
    attention_backward_items(dout, q, k, v, out, lse, items, *bufs, softmax_scale=softmax_scale, softcap=softcap,
                             deterministic=True, backend=backend, cp_invariant=True)
    return bufs


def single_device_items(problem) -> list[WorkItem]:
    """One item per sequence (dense) or segment (packed): all its queries against all its keys."""
    mask = dict(causal=problem.mask.causal, window=problem.mask.window)
    if not problem.varlen:
        return [WorkItem(0, problem.seqlen_q, 0, problem.seqlen_k, problem.q_offsets[0], problem.k_offsets[0], **mask)]
    return [WorkItem(qs, ql, ks, kl, qo, ko, **mask) for _, qs, ql, ks, kl, qo, ko in problem.segments()]
