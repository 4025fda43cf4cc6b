"""flash-attn 2's Python API on fa4dist: ``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func``,
``flash_attn_varlen_kvpacked_func`` and ``flash_attn_with_kvcache`` (contiguous caches), with flash-attn 2's
signatures and results (``return_attn_probs=True``:
``(out, softmax_lse, S_dmask)``, the last an empty tensor as flash-attn 2 returns it without dropout; fa4dist never
forms the attention probabilities, and the lse is differentiable).
Paged KV caches (``block_table``) are read, and appended to, through their block tables.  Dropout and ALiBi are
refused by name.  Conventions: :mod:`fa4dist.compat.conventions`.  One
difference: a query row that sees no key (a causal call with more queries than keys) has out 0 and lse -inf, the
log of its empty sum, as in flash-attn 4; flash-attn 2's kernels write +inf there.  Windows follow flash-attn 2's
kernels (:func:`fa4dist.compat.conventions.window_of`): a side of at least the key count (``max_seqlen_k`` for
packed input) is unbounded, before ``causal`` sets the right one to 0, and an unbounded right side next to a bounded
left one is the key count."""

from __future__ import annotations

import operator

import torch

from . import conventions
from .addressing import Batched, Paged, per_sequence_integers


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
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


def _dense(call, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):
    """flash_attn_func and its packed forms, errors naming ``call``."""
    conventions.refuse(call, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    out, lse = conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                     softmax_scale=softmax_scale, deterministic=deterministic,
                                     return_lse=return_attn_probs, flash_attn=2)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim), sequence b of q against sequence b of
    k (int32 ``cu_seqlens_*``) -> out like q; the lse is (heads, total_q). With ``block_table`` (batch,
    max_blocks_per_seq), k and v are paged caches (num_blocks, page_block_size, kv_heads, head_dim): sequence b's
    key i is row ``i % page_block_size`` of block ``block_table[b, i // page_block_size]``, for the
    ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys of sequence b, as flash-attn 2 reads them."""
    return _varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table)


def _varlen(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table):
    """flash_attn_varlen_func and its packed forms, errors naming ``call``."""
    conventions.refuse(call, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    if block_table is not None:  # the pages' rows packed as cu_seqlens_k lays them out
        bounds = conventions.boundaries("cu_seqlens_k", cu_seqlens_k)
        sequences = len(conventions.boundaries("cu_seqlens_q", cu_seqlens_q)) - 1
        if sequences != len(bounds) - 1:
            raise ValueError(f"{call}: cu_seqlens_q holds {sequences} sequences but cu_seqlens_k {len(bounds) - 1}")
        pages = Paged(call, "block_table", k, v, block_table, sequences)
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        pages.check_pages(lengths)
        k, v = pages.gather([0] * sequences, lengths)
    out, lse = conventions.attention(call, q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                     softmax_scale=softmax_scale, deterministic=deterministic,
                                     return_lse=return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                     flash_attn=2)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, heads, head_dim)."""
    call = "flash_attn_qkvpacked_func"
    q, k, v = _unpack(call, "qkv", qkv, 2, 3, "(batch, seqlen, 3, heads, head_dim)")
    return _dense(call, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2, kv_heads, head_dim)."""
    call = "flash_attn_kvpacked_func"
    k, v = _unpack(call, "kv", kv, 2, 2, "(batch, seqlen_k, 2, kv_heads, head_dim)")
    return _dense(call, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, heads, head_dim)."""
    call = "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(call, "qkv", qkv, 1, 3, "(total, 3, heads, head_dim)")
    return _varlen(call, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, heads, head_dim), kv (total_k, 2, kv_heads, head_dim)."""
    call = "flash_attn_varlen_kvpacked_func"
    k, v = _unpack(call, "kv", kv, 1, 2, "(total_k, 2, kv_heads, head_dim)")
    return _varlen(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None)


def _rotary(x, cos, sin, positions, interleaved: bool):
    """flash-attn's rotary embedding of x (batch, seqlen, heads, dim) at ``positions`` (batch, seqlen): the first
    ``2 * cos.shape[1]`` channels turned, in pairs of neighbours (``interleaved``) or of halves (GPT-NeoX)."""
    half = cos.shape[1]  # (turned in fp32 at least, as flash-attn's kernels do, then rounded to x's dtype)
    work = torch.promote_types(x.dtype, torch.float32)
    c, s = cos.to(work)[positions].unsqueeze(2), sin.to(work)[positions].unsqueeze(2)  # (batch, seqlen, 1, half)
    turned, rest = x[..., :2 * half].to(work), x[..., 2 * half:]
    if interleaved:
        x1, x2 = turned[..., 0::2], turned[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = turned[..., :half], turned[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


def _per_sequence(call: str, name: str, value, batch: int, device, default: int) -> torch.Tensor:
    """An int or a (batch,) integer tensor of per-sequence cache indices, as an int64 tensor on the cache's device."""
    if value is None:
        return torch.full((batch,), default, dtype=torch.int64, device=device)
    if isinstance(value, torch.Tensor):
        if not per_sequence_integers(value, batch):
            raise ValueError(f"{call}: {name} must be an int or a ({batch},) integer tensor, got "
                             f"{value.dtype} of shape {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.int64)
    try:
        return torch.full((batch,), operator.index(value), dtype=torch.int64, device=device)
    except TypeError:
        raise TypeError(f"{call}: {name} must be an int or a ({batch},) integer tensor, got {value!r}") from None


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's decoding call on a KV cache: q (batch, seqlen_q, heads, head_dim) against, for sequence b, the
    cache positions ``[cache_leftpad[b], cache_seqlens[b])`` and, when k / v (batch, seqlen_new, kv_heads,
    head_dim) are given, those new rows, which are first written into the cache in place at ``cache_seqlens[b]``
    (required with them; without them the whole cache is read by default). The cache is contiguous, (cache_batches,
    seqlen_cache, kv_heads, head_dim) with sequence b in cache row ``cache_batch_idx[b]``, or paged, (num_blocks,
    page_block_size, kv_heads, head_dim) with ``block_table`` (batch, max_blocks_per_seq): position i of sequence
    b is row ``i % page_block_size`` of block ``block_table[b, i // page_block_size]`` (no ``cache_batch_idx`` or
    ``cache_leftpad`` then, as in flash-attn 2). With ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2)
    the new keys are turned at their cache positions, and q at ``cache_seqlens[b] + i`` (causal or windowed; else
    all at ``cache_seqlens[b]``), as flash-attn does. Masks align bottom-right to each sequence's keys. Returns out
    like q (and the lse, (batch, heads, seqlen_q), with ``return_softmax_lse``). ALiBi is refused; ``num_splits``
    is a kernel hint and is ignored. A malformed call is refused before the cache is written. Sequences of unequal
    key counts, and paged caches, are computed as one packed call over a copy of their cache rows (equal ones of a
    contiguous cache read it in place)."""
    call = "flash_attn_with_kvcache"
    conventions.refuse(call, alibi_slopes=alibi_slopes)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"{call}: q must be a 4-D tensor (batch, seqlen, heads, head_dim), got {got}")
    batch, seqlen_q = q.shape[0], q.shape[1]
    if block_table is None:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{call}: {name} must be a 4-D tensor (batch, seqlen, heads, head_dim), got {got}")
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(f"{call}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must hold "
                             "the same (batch, seqlen_cache, kv_heads)")
    else:
        for name, given in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if given is not None:
                raise ValueError(f"{call}: {name} cannot be given with block_table (a paged cache addresses each "
                                 "sequence through its block_table row, from position 0; flash-attn 2 refuses it "
                                 "too)")
    if (k is None) != (v is None):
        raise ValueError(f"{call}: give both k and v (the rows to append), or neither")
    device = k_cache.device
    if block_table is None:
        cache_batches = k_cache.shape[0]
        if cache_batch_idx is None:
            if cache_batches < batch:
                raise ValueError(f"{call}: the caches hold {cache_batches} sequences for a batch of {batch} (pass "
                                 "cache_batch_idx)")
            rows = torch.arange(batch, device=device)
        else:
            rows = _per_sequence(call, "cache_batch_idx", cache_batch_idx, batch, device, 0)
        cache = Batched(k_cache, v_cache, rows=rows)
    else:
        cache = Paged(call, "block_table", k_cache, v_cache, block_table, batch)
        rows = None
    new = 0
    if k is not None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != batch or v.shape[:3] != k.shape[:3] \
                or k.shape[2:] != k_cache.shape[2:] or v.shape[2:] != v_cache.shape[2:]:
            raise ValueError(f"{call}: k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch={batch}, "
                             f"seqlen_new, kv_heads, head_dim) like the caches' rows")
        if (k.dtype, v.dtype) != (k_cache.dtype, v_cache.dtype):  # (flash-attn 2 refuses them too: no cast)
            raise TypeError(f"{call}: k and v ({k.dtype}, {v.dtype}) must have the caches' dtype ({k_cache.dtype}, "
                            f"{v_cache.dtype})")
        if cache_seqlens is None:  # (flash-attn 2 refuses it too: where would the new rows go)
            raise ValueError(f"{call}: pass cache_seqlens with k and v: the new rows are written at each "
                             "sequence's cache_seqlens")
        new = k.shape[1]
    seqlen_cache = cache.capacity
    ends = _per_sequence(call, "cache_seqlens", cache_seqlens, batch, device, seqlen_cache)
    starts = _per_sequence(call, "cache_leftpad", cache_leftpad, batch, device, 0)
    ends_l, starts_l = ends.tolist(), starts.tolist()  # (one read each)
    rows_l = rows.tolist() if rows is not None else None
    for b, (a, e) in enumerate(zip(starts_l, ends_l)):
        if rows_l is not None and not 0 <= rows_l[b] < cache_batches:
            raise ValueError(f"{call}: cache_batch_idx[{b}]={rows_l[b]} is outside the caches' {cache_batches} "
                             "sequences")
        if not 0 <= a <= e or e + new > seqlen_cache:
            where = f"the cache's {seqlen_cache} rows" if block_table is None else \
                f"the {seqlen_cache} positions its block_table row addresses"
            raise ValueError(f"{call}: sequence {b} takes cache rows [{a}, {e}) and {new} new ones, outside {where} "
                             "(cache_leftpad <= cache_seqlens, cache_seqlens + seqlen_new <= the cache's length)")
    if block_table is not None:
        cache.check_pages([e + new for e in ends_l])
    # everything the attention call checks that reads no values, before the cache is written: a refused call leaves
    # the cache as it was
    window_left, window_right = conventions.check_call(
        call, q, k_cache.new_empty((batch, 0, *k_cache.shape[2:])), v_cache.new_empty((batch, 0, *v_cache.shape[2:])),
        causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale, flash_attn=2,
        keys=seqlen_cache)
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError(f"{call}: rotary_cos / rotary_sin turn the new keys: pass k and v with them")
        if rotary_cos is None or rotary_sin is None or rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"{call}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2)")
        if 2 * rotary_cos.shape[1] > q.shape[-1]:
            raise ValueError(f"{call}: rotary_dim ({2 * rotary_cos.shape[1]}) exceeds head_dim ({q.shape[-1]})")
        # flash-attn 2 steps q's positions in causal and local calls; local: a side bounded after the sides of at
        # least the cache's length became unbounded (window_of)
        stepped = bool(causal) or window_left >= 0 or window_right >= 0
        reach = max((e + max(new, seqlen_q if stepped else 1) for e in ends_l), default=0)
        if reach > rotary_cos.shape[0]:
            raise ValueError(f"{call}: rotary_cos / rotary_sin hold {rotary_cos.shape[0]} positions, the call "
                             f"turns up to position {reach - 1}")
        steps = torch.arange(seqlen_q, device=device) * int(stepped)
        q = _rotary(q, rotary_cos, rotary_sin, (ends[:, None] + steps).to(q.device), rotary_interleaved)
        k = _rotary(k, rotary_cos, rotary_sin, (ends[:, None] + torch.arange(new, device=device)).to(k.device),
                    rotary_interleaved)
    if k is not None:  # the new rows into the cache, in place: one indexed write per cache, not one per sequence
        at = cache.at(torch.arange(batch, device=device)[:, None].expand(batch, new),
                      ends[:, None] + torch.arange(new, device=device))
        with torch.no_grad():
            k_cache[at] = k.to(k_cache.device, k_cache.dtype)
            v_cache[at] = v.to(v_cache.device, v_cache.dtype)
    lengths = [e + new - a for a, e in zip(starts_l, ends_l)]
    options = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale,
                   deterministic=False, return_lse=return_softmax_lse, flash_attn=2)
    if rows_l == list(range(batch)) and len(set(lengths)) <= 1 and not any(starts_l):
        length = lengths[0] if lengths else 0  # every sequence the same cache rows: the cache itself, no copy
        out, lse = conventions.attention(call, q, k_cache[:batch, :length], v_cache[:batch, :length], **options,
                                         max_seqlen_k=seqlen_cache)
    else:
        keys, values = cache.gather(starts_l, lengths)
        cu_k = torch.tensor([0] + lengths, device=q.device).cumsum(0).to(torch.int32)
        cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * seqlen_q
        out, lse = conventions.attention(call, q.reshape(batch * seqlen_q, *q.shape[2:]), keys, values, **options,
                                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q,
                                         max_seqlen_k=seqlen_cache)
        out = out.view(batch, seqlen_q, *out.shape[1:])
        lse = lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1)
    return (out, lse) if return_softmax_lse else out
