"""flash-attn 4's Python API (``flash_attn.cute``) on fa4dist: ``flash_attn_func`` and ``flash_attn_varlen_func``
with its signatures, returning ``(out, lse)`` (the lse differentiable with ``return_lse=True``, detached
otherwise) and taking ``learnable_sink`` (per-head sinks, with their gradient).  Performance hints (``num_splits``,
``pack_gqa``, ``min_seqlen_k``, ``scheduler_metadata``, ...) are accepted and left to fa4dist's own dispatch;
what changes the result and fa4dist does not compute (``qv``, score / mask modifications, block sparsity, paged or
gathered KV, ``seqused_*``, and sparse MLA's backward options ``gather_bwd_*``, which flash-attn 4 itself refuses
without ``gather_kv_indices``) is refused by name.  Conventions: :mod:`fa4dist.compat.conventions`."""

from __future__ import annotations

from . import conventions


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim) -> (out, lse)."""
    call = "flash_attn_func"
    conventions.refuse(call, qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                       score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                       aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                       block_sparse_tensors_bwd=block_sparse_tensors_bwd, gather_bwd_recompute_p=gather_bwd_recompute_p,
                       gather_bwd_token_chunk=gather_bwd_token_chunk)
    return conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                 softmax_scale=softmax_scale, deterministic=deterministic, return_lse=return_lse,
                                 sinks=learnable_sink)


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
                       block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
                       gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk)
    return conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                 softmax_scale=softmax_scale, deterministic=deterministic, return_lse=return_lse,
                                 sinks=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
