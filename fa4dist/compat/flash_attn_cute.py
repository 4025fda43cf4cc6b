"""flash-attn 4's Python API (``flash_attn.cute``) on fa4dist: ``flash_attn_func`` and ``flash_attn_varlen_func``
with its signatures, returning ``(out, lse)`` (the lse differentiable with ``return_lse=True``, detached
otherwise) and taking ``learnable_sink`` (per-head sinks, with their gradient).  Performance hints (``num_splits``,
``pack_gqa``, ``min_seqlen_k``, ``scheduler_metadata``, ...) are accepted and left to fa4dist's own dispatch;
what changes the result and fa4dist does not compute (``qv``, score / mask modifications, block sparsity, paged or
gathered KV, ``seqused_*``, and sparse MLA's backward options ``gather_bwd_*``, which flash-attn 4 itself refuses
without ``gather_kv_indices``) is refused by name.  ``window_size`` sides are taken literally, as flash-attn 4
does: None is unbounded, a negative int moves the band off the diagonal.  Conventions:
:mod:`fa4dist.compat.conventions`."""

from __future__ import annotations

from . import conventions


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
    conventions.refuse(call, qv=qv, seqused_q=seqused_q, seqused_k=seqused_k, gather_kv_indices=gather_kv_indices,
                       page_table=page_table, score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
                       block_sparse_tensors=block_sparse_tensors, aux_tensors=_empty_is_absent(aux_tensors),
                       aux_scalars=_empty_is_absent(aux_scalars),
                       gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk)
    return conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                 softmax_scale=softmax_scale, deterministic=deterministic, return_lse=return_lse,
                                 sinks=_sink(call, learnable_sink, q), cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 flash_attn=4)
