"""torch's ``scaled_dot_product_attention`` on fa4dist: the same signature and layout ((batch..., heads, seqlen,
head_dim): any number of leading batch dims, none included), computed by :func:`fa4dist.attention`. ``is_causal`` is
torch's: aligned to the top-left corner (query i sees keys 0..i, also when the query and key lengths differ), unlike
flash-attn's bottom-right. ``enable_gqa`` as torch takes it (fewer key/value heads only with it). A mask tensor,
dropout and nested tensors are refused by name: fa4dist computes causal, windowed and packed masks, which it takes
from its own arguments (:func:`fa4dist.attention`)."""

from __future__ import annotations

import math

import torch

import fa4dist

from . import conventions


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """query (batch..., heads, seqlen_q, head_dim), key and value (batch..., kv_heads, seqlen_k, head_dim[_v]) ->
    out (batch..., heads, seqlen_q, head_dim_v); the leading batch dims (none or more) the same in all three."""
    call = "scaled_dot_product_attention"
    conventions.refuse(call, attn_mask=attn_mask, dropout_p=dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, torch.Tensor) and t.is_nested:  # (a strided nested tensor has no sizes to check)
            raise TypeError(f"{call}: {name} is a nested tensor, which fa4dist does not take; pack variable-length "
                            "sequences as (total_tokens, heads, head_dim) with cu_seqlens (fa4dist.attention, or "
                            "fa4dist.compat.flash_attn.flash_attn_varlen_func)")
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{call}: {name} must be a (batch..., heads, seqlen, head_dim) tensor, got {shape}")
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"{call}: query, key and value must share their leading batch dims (fa4dist does not "
                         f"broadcast them), got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"{call}: query has {query.shape[-3]} heads but key {key.shape[-3]}; pass enable_gqa=True "
                         "for grouped-query attention (as torch requires)")
    if key.shape[-3] != value.shape[-3]:  # (named in the caller's layout, not fa4dist's)
        raise ValueError(f"{call}: key has {key.shape[-3]} heads but value {value.shape[-3]}; fa4dist takes as many "
                         "value heads as key heads")
    if scale is not None and not isinstance(scale, bool) and isinstance(scale, (int, float)) and scale == 0:
        raise ValueError(f"{call}: scale=0 (a plain average over the visible keys) is not supported by fa4dist, "
                         "whose softmax_scale must be non-zero")
    # (one batch dim; its size given, not -1: a length of 0 left -1 ambiguous)
    q, k, v = (t.reshape(math.prod(batch), *t.shape[-3:]).transpose(1, 2) for t in (query, key, value))
    out = fa4dist.attention(q, k, v, causal=bool(is_causal), softmax_scale=scale)
    return out.transpose(1, 2).reshape(*batch, *out.shape[2:3], out.shape[1], out.shape[3])
