"""An independent oracle for the tests: dense softmax(QK^T)V in fp64, the mask written out by hand.

It shares no code with fa4dist (not even the mask module), so a bug there cannot hide in both."""

from __future__ import annotations

import torch


def _segments(q, k, cu_q, cu_k, q_offset, k_offset):
    if cu_q is None:
        for b in range(q.shape[0]):
            qo = q_offset if isinstance(q_offset, int) else int(q_offset[b])
            ko = k_offset if isinstance(k_offset, int) else int(k_offset[b])
            yield (b, slice(None)), (b, slice(None)), qo, ko
    else:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for s in range(len(cq) - 1):
            qo = q_offset if isinstance(q_offset, int) else int(q_offset[s])
            ko = k_offset if isinstance(k_offset, int) else int(k_offset[s])
            yield (slice(cq[s], cq[s + 1]),), (slice(ck[s], ck[s + 1]),), qo, ko


def naive_attention(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0, cu_seqlens_q=None,
                    cu_seqlens_k=None, window=(-1, -1), softcap=None, sinks=None):
    """Returns (out, lse) in fp64 with the contract's shapes; differentiable through torch autograd (sinks too).

    The mask, written out by hand: key at global position s is visible to the query at position p iff
    (not causal or s <= p) and (left == -1 or s >= p - left) and (right == -1 or s <= p + right).  softcap:
    scores = softcap * tanh(scores / softcap) after scaling.  sinks (one logit per query head): an extra column of
    the row's softmax whose value is zero."""
    q, k, v = q.double(), k.double(), v.double()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    group = q.shape[-2] // k.shape[-2]
    left, right = window
    outs, lses = [], []
    for qi, ki, qo, ko in _segments(q, k, cu_seqlens_q, cu_seqlens_k, q_offset, k_offset):
        qs = q[qi]  # (Sq, H, D)
        ks = k[ki].repeat_interleave(group, dim=-2)
        vs = v[ki].repeat_interleave(group, dim=-2)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        key_pos = ko + torch.arange(ks.shape[0], device=q.device)
        query_pos = qo + torch.arange(qs.shape[0], device=q.device)
        mask = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool, device=q.device)
        if causal:  # key j visible to query i iff its global position is not later
            mask &= key_pos[None, :] <= query_pos[:, None]
        if left != -1:
            mask &= key_pos[None, :] >= query_pos[:, None] - left
        if right != -1:
            mask &= key_pos[None, :] <= query_pos[:, None] + right
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # the sink column joins the softmax of every row of its head
            sink_col = sinks.double().view(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
            scores = torch.cat([scores, sink_col], dim=-1)
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.bool, device=q.device)], dim=-1)
            vs = torch.cat([vs, vs.new_zeros(1, *vs.shape[1:])], dim=0)
        if scores.shape[-1]:
            lse = torch.logsumexp(scores, dim=-1)
        else:
            lse = torch.full(scores.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        probs = torch.where(mask, torch.exp(scores - lse_safe.unsqueeze(-1)), torch.zeros_like(scores))
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        lses.append(lse)
    if cu_seqlens_q is None:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, dim=-1)


def random_cu_seqlens(n_segments, max_len, generator, allow_empty=True):
    low = 0 if allow_empty else 1
    lens = torch.randint(low, max_len + 1, (n_segments,), generator=generator)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)


def rel_error(got, want):
    """||got - want|| / ||want|| in fp64; NaN anywhere gives inf so it can never pass."""
    got, want = got.double(), want.double()
    if torch.isnan(got).any():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# Tolerances by input dtype for ||out - ref|| / ||ref|| against an fp64 oracle (METHOD.md: bf16 operands land
# between 1e-3 and 1e-2; fp16 has 3 more mantissa bits).
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}


def flash_op_keep(q_len: int, k_len: int, window=(-1, -1), causal: bool = False,
                  unbounded_from: int | None = None) -> torch.Tensor:
    """The (q_len, k_len) pairs torch's flash op keeps for one segment (flash-attn's documented rule, written out
    here so that the tests model the op independently of fa4dist's sub-block code): windows aligned to the
    bottom-right corner (query i sits at key position i + k_len - q_len), a window side of at least
    ``unbounded_from`` (the call's max_seqlen_k; default k_len) read as unbounded, and causal the right side 0."""
    limit = k_len if unbounded_from is None else unbounded_from
    left, right = (w if w < limit else -1 for w in window)
    if causal:
        right = 0
    i, j = torch.arange(q_len).view(-1, 1), torch.arange(k_len).view(1, -1)
    keep = torch.ones(q_len, k_len, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i + (k_len - q_len) - left
    if right >= 0:
        keep &= j <= i + (k_len - q_len) + right
    return keep


def visible_item_pairs(items):
    """Work items' visible (query row, key row) pairs with how many items hold each: the mask written out by hand
    (key position s = k_offset + j seen by query position p = q_offset + i when s <= p if causal and p - left <= s
    <= p + right for the window), independent of fa4dist.kernels.mask."""
    from collections import Counter

    seen = Counter()
    for it in items:
        left, right = it.window
        for i in range(it.q_len):
            p = it.q_offset + i
            for j in range(it.k_len):
                s = it.k_offset + j
                if (it.causal and s > p) or (left >= 0 and s < p - left) or (right >= 0 and s > p + right):
                    continue
                seen[(it.q_start + i, it.k_start + j)] += 1
    return seen
