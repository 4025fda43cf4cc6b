"""flash-attn 4's Python API (``flash_attn.cute``) on fa4dist: ``flash_attn_func`` and ``flash_attn_varlen_func`` with
its signatures, returning ``(out, lse)`` (the lse differentiable with ``return_lse=True``, detached otherwise) and
taking ``learnable_sink`` (per-head sinks, with their gradient). Performance hints (``num_splits``, ``pack_gqa``,
``min_seqlen_k``, ``scheduler_metadata``, ...) are accepted and left to fa4dist's own dispatch; ``seqused_q`` /
``seqused_k`` (the rows each sequence uses, from its first) and a paged KV cache (``page_table``) are read as flash-
attn 4 reads them, each sequence's used rows packed into one call; a query row a sequence does not use gets out 0
and lse -inf. What changes the result and fa4dist does not compute (``qv``, score / mask modifications, block
sparsity, gathered KV, and sparse MLA's backward options ``gather_bwd_*``, which flash-attn 4 itself refuses without
``gather_kv_indices``) is refused by name. ``window_size`` sides are taken literally, as flash-attn 4 does: None is
unbounded, a negative int moves the band off the diagonal. Conventions: :mod:`fa4dist.compat.conventions`."""

from __future__ import annotations

import torch

from . import conventions
from .addressing import Batched, Packed, Paged, packed_order, per_sequence_integers


def _empty_is_absent(value):
    """flash-attn 4 tests ``aux_tensors`` / ``aux_scalars`` for truth: an empty list or tuple is not given."""
    return None if isinstance(value, (list, tuple)) and not value else value


def _sink(call: str, learnable_sink, q):
    """flash-attn 4's ``learnable_sink``, checked under its own name: one logit per query head."""
    heads = q.shape[-2] if hasattr(q, "shape") and len(q.shape) >= 3 else None
    if learnable_sink is not None and (not hasattr(learnable_sink, "shape") or tuple(learnable_sink.shape) != (heads,)):
        got = tuple(learnable_sink.shape) if hasattr(learnable_sink, "shape") else type(learnable_sink).__name__
        raise ValueError(f"{call}: learnable_sink must be a tensor of shape (num_heads,) = ({heads},), got {got}")
    if learnable_sink is not None and not learnable_sink.dtype.is_floating_point:
        raise TypeError(f"{call}: learnable_sink must be a float16, bfloat16 or float32 tensor (one logit per query "
                        f"head), got {learnable_sink.dtype}")
    return learnable_sink


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim) -> (out, lse)."""
    call = "flash_attn_func"
    conventions.refuse(call, qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                       score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=_empty_is_absent(aux_tensors),
                       aux_scalars=_empty_is_absent(aux_scalars), block_sparse_tensors=block_sparse_tensors,
                       block_sparse_tensors_bwd=block_sparse_tensors_bwd, gather_bwd_recompute_p=gather_bwd_recompute_p,
                       gather_bwd_token_chunk=gather_bwd_token_chunk)
    return conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                 softmax_scale=softmax_scale, deterministic=deterministic, return_lse=return_lse,
                                 sinks=_sink(call, learnable_sink, q), flash_attn=4)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                           gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """q (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim) with int32 ``cu_seqlens_*`` ->
    (out, lse (heads, total_q)); without cu_seqlens, (batch, seqlen, heads, head_dim) tensors as
    :func:`flash_attn_func` takes them."""
    call = "flash_attn_varlen_func"
    conventions.refuse(call, qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                       score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors,
                       aux_tensors=_empty_is_absent(aux_tensors), aux_scalars=_empty_is_absent(aux_scalars),
                       gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale,
                   deterministic=deterministic, return_lse=return_lse, sinks=_sink(call, learnable_sink, q),
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, flash_attn=4)
    if seqused_q is None and seqused_k is None and page_table is None and \
            (cu_seqlens_q is None) == (cu_seqlens_k is None):
        return conventions.attention(call, q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options)
    return _used_rows(call, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, options)


def _seqused(call: str, name: str, value, batch: int, available: list[int]) -> list[int]:
    """``seqused_q`` / ``seqused_k``: each sequence's used rows, at most the ``available`` ones (all by default)."""
    if value is None:
        return available
    if not per_sequence_integers(value, batch):
        got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
            else type(value).__name__
        raise ValueError(f"{call}: {name} must be a ({batch},) int32 tensor, got {got}")
    used = value.tolist()
    for b, (n, most) in enumerate(zip(used, available)):
        if not 0 <= n <= most:
            raise ValueError(f"{call}: {name}[{b}]={n} is outside the sequence's {most} rows")
    return used


def _rows_of(call: str, name: str, t, bounds, batch: int) -> tuple:
    """(addressing, rows available per sequence) of a packed (``bounds``: its cu_seqlens' values) or batched
    (``bounds`` None) tensor."""
    if bounds is not None:
        if t[0].dim() != 3:
            raise ValueError(f"{call}: with cu_seqlens_{name}, {name} must be (total_{name}, heads, head_dim), got "
                             f"{tuple(t[0].shape)}")
        if len(bounds) != batch + 1:
            raise ValueError(f"{call}: cu_seqlens_{name} holds {len(bounds) - 1} sequences for a batch of {batch}")
        if bounds[-1] > t[0].shape[0]:
            raise ValueError(f"{call}: cu_seqlens_{name} ends at row {bounds[-1]}, past {name}'s {t[0].shape[0]} rows")
        return Packed(*t, first=bounds[:-1]), [b - a for a, b in zip(bounds, bounds[1:])]
    if t[0].dim() != 4 or t[0].shape[0] != batch:
        raise ValueError(f"{call}: without cu_seqlens_{name}, {name} must be (batch={batch}, seqlen, heads, "
                         f"head_dim), got {tuple(t[0].shape)}")
    return Batched(*t), [t[0].shape[1]] * batch


def _used_rows(call, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, options):
    """flash-attn 4's seqused_q / seqused_k / page_table, and a packed side with a batched one (cu_seqlens of one
    side only): every sequence's used query and key rows gathered into one packed call, its out and lse put back at
    the queries' rows (unused rows: out 0, lse -inf)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{call}: {name} must be a tensor, got {type(t).__name__}")
    # (each cu_seqlens read once: a CUDA tensor's read waits for the device)
    bounds_q, bounds_k = (None if cu is None else conventions.boundaries(f"cu_seqlens_{name}", cu)
                          for name, cu in (("q", cu_seqlens_q), ("k", cu_seqlens_k)))
    if bounds_q is not None:
        batch = len(bounds_q) - 1
    elif q.dim() == 4:
        batch = q.shape[0]
    else:
        raise ValueError(f"{call}: q must be (total_q, heads, head_dim) with cu_seqlens_q, or (batch, seqlen_q, "
                         f"heads, head_dim), got {tuple(q.shape)}")
    queries, q_rows = _rows_of(call, "q", (q,), bounds_q, batch)
    len_q = _seqused(call, "seqused_q", seqused_q, batch, q_rows)
    if page_table is not None:
        if cu_seqlens_k is not None:
            raise ValueError(f"{call}: page_table cannot be given with cu_seqlens_k (flash-attn 4 refuses it too): "
                             "give each sequence's key count as seqused_k")
        keys = Paged(call, "page_table", k, v, page_table, batch)
        len_k = _seqused(call, "seqused_k", seqused_k, batch, [keys.capacity] * batch)
        keys.check_pages(len_k)  # (a sequence longer than its page_table row addresses is refused here)
    else:
        keys, k_rows = _rows_of(call, "k", (k, v), bounds_k, batch)
        len_k = _seqused(call, "seqused_k", seqused_k, batch, k_rows)
    (q_packed,) = queries.gather([0] * batch, len_q)
    k_packed, v_packed = keys.gather([0] * batch, len_k)
    cu_q, cu_k = (torch.tensor([0, *n], device=q.device).cumsum(0).to(torch.int32) for n in (len_q, len_k))
    out, lse = conventions.attention(call, q_packed, k_packed, v_packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     **options)
    at = queries.at(*packed_order([0] * batch, len_q, q.device))
    full_out = out.new_zeros(*q.shape[:-1], out.shape[-1]).index_put(at, out)
    full_lse = lse.new_full((*q.shape[:-2], q.shape[-2]), float("-inf")).index_put(at, lse.transpose(0, 1))
    # flash-attn 4's lse: (heads, total_q) packed, (batch, heads, seqlen_q) batched
    full_lse = full_lse.transpose(0, 1) if q.dim() == 3 else full_lse.transpose(1, 2)
    return full_out, full_lse

