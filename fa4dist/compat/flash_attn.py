"""flash-attn 2's Python API on fa4dist: ``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func`` and
``flash_attn_varlen_kvpacked_func``, with flash-attn 2's signatures and results (``return_attn_probs=True``:
``(out, softmax_lse, S_dmask)``, the last an empty tensor as flash-attn 2 returns it without dropout; fa4dist never
forms the attention probabilities, and the lse is differentiable).
Dropout, ALiBi and paged KV caches are refused by name.  Conventions: :mod:`fa4dist.compat.conventions`.  One
difference: a query row that sees no key (a causal call with more queries than keys) has out 0 and lse -inf, the
log of its empty sum, as in flash-attn 4; flash-attn 2's kernels write +inf there.  Windows follow flash-attn 2's
kernels (:func:`fa4dist.compat.conventions.window_of`): a side of at least the key count (``max_seqlen_k`` for
packed input) is unbounded, before ``causal`` sets the right one to 0, and an unbounded right side next to a bounded
left one is the key count."""

from __future__ import annotations

from . import conventions


def _result(out, lse, return_attn_probs: bool):
    # (flash-attn 2 returns an empty tensor of the output's dtype as the probabilities without dropout)
    return (out, lse, out.new_empty(0)) if return_attn_probs else out


def _unpack(call: str, name: str, packed, dim: int, count: int, layout: str) -> tuple:
    """q, k, v (or k, v) of a packed tensor, its ``count`` parts along ``dim`` (flash-attn's layouts)."""
    if not hasattr(packed, "unbind") or packed.dim() != dim + 3 or packed.shape[dim] != count:
        shape = tuple(packed.shape) if hasattr(packed, "shape") else type(packed).__name__
        raise ValueError(f"{call}: {name} must be {layout}, got shape {shape}")
    return packed.unbind(dim)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim) -> out like q."""
    call = "flash_attn_func"
    conventions.refuse(call, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    out, lse = conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                     softmax_scale=softmax_scale, deterministic=deterministic,
                                     return_lse=return_attn_probs, flash_attn=2)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim), sequence b of q against sequence b of
    k (int32 ``cu_seqlens_*``) -> out like q; the lse is (heads, total_q)."""
    call = "flash_attn_varlen_func"
    conventions.refuse(call, dropout_p=dropout_p, alibi_slopes=alibi_slopes, block_table=block_table)
    out, lse = conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                     softmax_scale=softmax_scale, deterministic=deterministic,
                                     return_lse=return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                     flash_attn=2)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, heads, head_dim)."""
    q, k, v = _unpack("flash_attn_qkvpacked_func", "qkv", qkv, 2, 3, "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2, kv_heads, head_dim)."""
    k, v = _unpack("flash_attn_kvpacked_func", "kv", kv, 2, 2, "(batch, seqlen_k, 2, kv_heads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, heads, head_dim)."""
    q, k, v = _unpack("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 1, 3, "(total, 3, heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, heads, head_dim), kv (total_k, 2, kv_heads, head_dim)."""
    k, v = _unpack("flash_attn_varlen_kvpacked_func", "kv", kv, 1, 2, "(total_k, 2, kv_heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
