"""Drop-in replacements for flash-attn's Python entry points, computed by :func:`fa4dist.attention`.

- :mod:`fa4dist.compat.flash_attn`: flash-attn 2's ``flash_attn_func``, ``flash_attn_varlen_func``, their
  ``qkvpacked`` / ``kvpacked`` forms and ``flash_attn_with_kvcache`` on a contiguous cache
  (``from fa4dist.compat.flash_attn import flash_attn_func``).
- :mod:`fa4dist.compat.flash_attn_cute`: flash-attn 4's ``flash_attn_func`` / ``flash_attn_varlen_func``
  (``flash_attn.cute``), which return ``(out, lse)`` and take ``learnable_sink``.
- :mod:`fa4dist.compat.sdpa`: torch's ``scaled_dot_product_attention`` (its layout, top-left ``is_causal``,
  ``enable_gqa``).

flash-attn's conventions are translated in one place (:mod:`fa4dist.compat.conventions`): causal masks and windows
aligned to the bottom-right corner when the query and key lengths differ, ``window_size`` with -1 (flash-attn 2)
or None (flash-attn 4) unbounded, ``softcap=0.0`` meaning none.  What fa4dist does not compute (dropout, ALiBi,
paged KV caches, score / mask modifications) is refused by name, never ignored.
"""
