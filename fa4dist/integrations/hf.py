"""fa4dist attention inside Hugging Face transformers models (one process; context parallelism:
:func:`enable_context_parallel`, in :mod:`fa4dist.integrations.hf_context_parallel`).

```python
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fa4dist.integrations.hf import register

name = register()  # "fa4dist"
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(config, attn_implementation=name)  # or model.set_attn_implementation(name)
logits = model(input_ids=torch.randint(0, 128, (2, 16))).logits
```

``register`` adds an attention function to transformers' ``AttentionInterface`` *and* a mask function to its
``AttentionMaskInterface`` under the same name.  The mask function is what keeps masking honest: transformers hands
it the mask it wants (causal or sliding-window causal, padding from ``attention_mask``, packed documents detected
from ``position_ids`` restarts, cache offsets) as a predicate; we turn that into the kernel's description (packed
segments with ``cu_seqlens``, global offsets, and for a sliding-window layer the window that transformers names in
``local_size``) and then *check* the predicate against that description -- every (query, key) pair for small
problems, a fixed set of structural probes (the diagonal, the window's edge, the segments' first keys) plus random
pairs for large ones -- so a bidirectional mask, chunked attention, a custom 4-D mask or anything else the kernel
cannot express is an error, never silently dropped.  Flash-attention-style ``cu_seq_lens_q``/``cu_seq_lens_k``
keyword arguments (from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) are honoured as well, and so
are the documents of ``position_ids`` when transformers did not turn them into a document mask itself (it does so
only with ``use_cache=False`` and no ``attention_mask``, and never for models that do not hand ``position_ids`` to
their mask, as GPT-OSS; there its stock attentions silently let packed documents see each other, while
flash-attention and this function keep them apart).  A model whose attention call is not handed ``position_ids``
either (Llama 4) keeps transformers' documents only: with a cache or an ``attention_mask`` its packed documents
see each other, as in its own attention.

Which tokens start a document is one rule, transformers' own (:func:`document_starts`): the first, and every one
whose position does not continue the one before by one -- a return to 0, but also a gap (0, 1, 2, 5, 6: two
documents), a repeat or a drop.  So a row gives the same documents with a cache or without, and under context
parallelism (:mod:`fa4dist.integrations.hf_context_parallel` uses the same function).  transformers' flash-attention
path starts documents only where positions return to the row's smallest one (a gap is no boundary there); on what
``DataCollatorWithFlattening`` makes the two rules agree.

What the attention call adds to the mask is passed on to the kernels: the softmax ``scaling`` (Gemma's
``query_pre_attn_scalar``), logit soft-capping (``softcap``, Gemma 2), and learned per-head attention sinks
(``s_aux``, GPT-OSS; they get their gradient).  A ``sliding_window`` argument must agree with the window of the
layer's mask (a window of W tokens, the query included: the kernels' ``window=(W - 1, 0)``).  Attention dropout in
training and per-token sinks are refused.  Under ``torch.autocast`` the attention runs in the autocast dtype, as
eager, sdpa and flash-attention do (:func:`autocast_operands`).

Query rows that are padding get a zero output (the stock attention computes something meaningless there), except
right padding after a cache offset, which sees the row's keys.  After a cache offset (generation) each row is one
document from its first real token: position_ids that show a packed document there (a restart within the call, or
positions below the query's distance from the row's first real token) are refused, since the keys of earlier calls
carry no position_ids in this call.

``to_hf_llama(model)`` converts an :class:`fa4dist.models.FA4Llama` into a ``LlamaForCausalLM`` with the same
weights (parameter names match).
"""

from __future__ import annotations

import importlib.util
import operator
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

import fa4dist
from fa4dist.kernels.mask import Mask
from fa4dist.kernels.problem import int32_cu_seqlens

if importlib.util.find_spec("transformers") is None:  # (imported where used: this only names the install)
    raise ImportError('fa4dist.integrations.hf needs transformers (>=5, <6), which is not installed: pip install '
                      '"fa4dist[hf]", or pip install -e ".[hf]" from the repository root')

NAME = "fa4dist"
_SETTINGS: dict[str, dict] = {}
# Problems up to this many (batch x query x key) pairs are checked exhaustively; larger ones by probes.
EXHAUSTIVE_CHECK_PAIRS = 1 << 20
RANDOM_PROBES_PER_QUERY = 8
NO_WINDOW = (-1, -1)


class UnsupportedMask(ValueError):
    """The model asked for attention that fa4dist's kernels cannot express (they compute causal attention within
    documents, optionally with a sliding window, soft-capping and per-head sinks)."""


def window_of(sliding_window) -> tuple[int, int]:
    """The kernels' ``window`` for transformers' sliding window of W tokens (the query and the W - 1 keys before it,
    transformers' ``kv_idx > q_idx - W``): ``(W - 1, 0)``; None: no window.  W is an integer (a Python or NumPy
    int, or an integer 0-d tensor); a bool or a float is refused, never truncated (``kv_idx > q_idx - 4.5`` is a
    window of 5 tokens, not 4)."""
    if sliding_window is None:
        return NO_WINDOW
    try:
        tokens = None if isinstance(sliding_window, bool) else operator.index(sliding_window)
    except TypeError:
        tokens = None
    if tokens is None or tokens < 1:
        raise UnsupportedMask(f"a sliding window must be a positive number of tokens, got {sliding_window!r}")
    return (tokens - 1, 0)


def text_config(config):
    """The config of the language model (a multimodal config's text part, or the config itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_chunk(config, local_size) -> Optional[int]:
    """The chunk size of a chunked attention layer's mask (Llama 4: transformers names ``attention_chunk_size`` in
    ``local_size``, as it names a sliding window), else None.  ``config``: the one transformers hands the mask
    functions (None: not handed, no chunks)."""
    chunk = getattr(text_config(config), "attention_chunk_size", None) if config is not None else None
    return int(chunk) if chunk and local_size is not None and int(local_size) == int(chunk) else None


def describe_window(window: tuple[int, int]) -> str:
    return "no sliding window" if window[0] < 0 else f"a sliding window of {window[0] + 1} tokens"


@dataclass
class FA4MaskInfo:
    """What the mask function hands to the attention function (instead of a dense 4-D mask).

    Segments are runs of tokens in one batch row; segment s's queries ``q_index[cu_q[s]:cu_q[s+1]]`` (flat indices
    ``b * q_length + i``) see its keys ``k_index[cu_k[s]:cu_k[s+1]]`` causally by global position
    (``k_offsets[s] + j <= q_offsets[s] + i``), within ``window`` (the kernels' ``(left, right)``) when it has one."""

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    dense: bool  # one segment per row covering every query and key: the dense kernel layout
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    q_index: Optional[torch.Tensor] = None
    k_index: Optional[torch.Tensor] = None
    q_offsets: list = field(default_factory=list)
    k_offsets: list = field(default_factory=list)
    checked: str = ""  # how the predicate was verified ("exhaustive" / "probes")
    segments: list = field(default_factory=list)  # (row, q_start, q_end, k_start, k_end)
    window: tuple = NO_WINDOW  # verified against the predicate, like the segments
    derived: dict = field(default_factory=dict, repr=False)  # per-forward cache (every layer shares the mask)
    chunk: Optional[int] = None  # chunked attention read from local_size after a cache offset (_chunk_segments)
    origins: list = field(default_factory=list)  # after a cache offset: each row's first real cache position

    @property
    def shape(self):  # for code that only looks at the mask's shape
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:  # as a prepared 4-D mask (transformers checks it before building one)
        return 4


# ---------------------------------------------------------------------------------------------------------------
# the mask: from transformers' predicate to segments and a window, then verified


def _predicate(mask_function, padding_mask, q_offset, kv_offset):
    def visible(b, i, j):
        h = torch.zeros_like(b)
        out = mask_function(b, h, i + q_offset, j + kv_offset)
        out = torch.as_tensor(out, device=b.device).to(torch.bool).expand(b.shape)
        if padding_mask is not None:
            out = out & padding_mask[b, j + kv_offset]
        return out

    return visible


@dataclass
class _Layout:
    """Our description on (batch, query, key) indices: segment ids (-1: none) and the band of ``mask`` on global
    positions (query ``i + q_offset``, key ``j + kv_offset``)."""

    seg_q: torch.Tensor
    seg_k: torch.Tensor
    q_offset: int
    kv_offset: int
    mask: Mask

    def visible(self, b, i, j):
        sq, sk = self.seg_q[b, i], self.seg_k[b, j]
        diff = (j + self.kv_offset) - (i + self.q_offset)  # s - p, as in fa4dist.kernels.mask
        keep = (sq >= 0) & (sq == sk)
        if self.mask.hi is not None:
            keep &= diff <= self.mask.hi
        if self.mask.lo is not None:
            keep &= diff >= self.mask.lo
        return keep


def _padding_holes(padding: torch.Tensor) -> list:
    """(row, its runs of real tokens) of the rows of a (batch, keys) padding mask that are padded in the middle."""
    runs = [_runs(row, torch.zeros_like(row)) for row in padding]
    return [(b, r) for b, r in enumerate(runs) if len(r) > 1]


def _runs(valid: torch.Tensor, boundary: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of the maximal runs of valid positions with no boundary inside (boundary[i]: i starts a run).
    Found with tensor ops, and only the runs' edges read back (a Python walk over every key cost ~10 ms per 32k-key
    row at each decoding step)."""
    valid, boundary = valid.bool(), boundary.bool()
    if valid.numel() == 0:
        return []
    before = torch.cat([valid.new_zeros(1), valid[:-1]])  # position i - 1 valid
    after = torch.cat([valid[1:], valid.new_zeros(1)])  # position i + 1 valid
    cut_after = torch.cat([boundary[1:], boundary.new_ones(1)])  # a run must end at i (i + 1 starts one)
    starts = (valid & (~before | boundary)).nonzero().flatten()
    ends = (valid & (~after | cut_after)).nonzero().flatten() + 1
    return list(zip(starts.tolist(), ends.tolist()))


def fa4dist_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask: Optional[torch.Tensor] = None, local_size: Optional[int] = None,
                 device="cpu", **kwargs) -> FA4MaskInfo:
    """transformers' mask interface entry: returns an :class:`FA4MaskInfo` or raises :class:`UnsupportedMask`.

    ``local_size`` (transformers passes it for sliding-window layers, and for chunked attention) is read as a
    sliding window of that many tokens; the predicate check then tells whether it was one.  Chunked attention
    (Llama 4's ``attention_chunk_size``, :func:`layer_chunk`) passes that check over a whole sequence, where its
    chunks are documents; with a cache offset (generation) its segments are the chunks (:func:`_chunk_segments`),
    checked the same way."""
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask

    config = kwargs.get("config")
    if config is not None and getattr(text_config(config), "alibi", False) is True:
        # (Falcon adds its ALiBi biases to the mask it gets back, which is no tensor here)
        raise UnsupportedMask("the model adds ALiBi position biases to its attention scores (config.alibi=True), "
                              "which fa4dist attention does not compute; use attn_implementation='sdpa' or 'eager'")
    if isinstance(attention_mask, FA4MaskInfo):
        # built for this very forward already: generate() with a static cache makes the mask up front and passes it
        # back in as the attention mask
        built = (attention_mask.batch_size, attention_mask.q_length, attention_mask.kv_length)
        if built != (batch_size, q_length, kv_length):
            raise UnsupportedMask(f"a prepared fa4dist mask for (batch, queries, keys) = {built} was passed to a call "
                                  f"with {(batch_size, q_length, kv_length)}")
        if attention_mask.chunk is not None:
            if attention_mask.chunk != local_size:
                raise UnsupportedMask(f"a prepared fa4dist mask of chunks of {attention_mask.chunk} tokens was passed "
                                      f"to a layer whose mask has local_size={local_size}")
        elif attention_mask.window != window_of(local_size):  # (a full-attention mask kept no window, silently)
            raise UnsupportedMask(f"a prepared fa4dist mask with window {attention_mask.window} was passed to a layer "
                                  f"whose mask has window {window_of(local_size)} (local_size={local_size})")
        return attention_mask
    window = window_of(local_size)
    mask_function = mask_function or causal_mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding.to(device=device, dtype=torch.bool)
    visible = _predicate(mask_function, padding, q_offset, kv_offset)
    # A whole row from its first token: no cache, or a prefill into an empty cache (a static cache's keys run on to
    # its max_cache_len; the ones past the queries are unwritten slots no query sees).
    self_attn = q_offset == 0 and kv_offset == 0 and kv_length >= q_length

    seg_q = torch.full((batch_size, q_length), -1, dtype=torch.long, device=device)
    seg_k = torch.full((batch_size, kv_length), -1, dtype=torch.long, device=device)
    segments = []  # (b, qs, qe, ks, ke)
    for b in range(batch_size):
        key_valid = padding[b, kv_offset:kv_offset + kv_length] if padding is not None else \
            torch.ones(kv_length, dtype=torch.bool, device=device)
        if self_attn:
            key_valid = key_valid[:q_length]
            # Documents: i starts a new one where query i cannot see key i - 1 (both tokens real).
            i = torch.arange(1, q_length, device=device)
            bb = torch.full_like(i, b)
            sees_prev = visible(bb, i, i - 1) if q_length > 1 else torch.zeros(0, dtype=torch.bool, device=device)
            boundary = torch.cat([torch.ones(1, dtype=torch.bool, device=device), ~sees_prev])
            for s, e in _runs(key_valid, boundary):
                segments.append((b, s, e, s, e))
        else:
            # With a cache: one segment per row, the real keys (must be contiguous) against every query.
            runs = _runs(key_valid, torch.zeros_like(key_valid))
            if len(runs) > 1:
                raise UnsupportedMask(f"row {b}: the real keys are not contiguous ({runs[:4]}...); fa4dist "
                                      "attention supports left or right padding only (a right-padded batch that "
                                      "generates has its padding between the prompt and the new tokens: pad on the "
                                      "left to generate)")
            if runs:
                segments.append((b, 0, q_length, runs[0][0], runs[0][1]))
    chunk = None if self_attn else layer_chunk(kwargs.get("config"), local_size)
    if chunk is not None:  # with a cache offset a chunked layer is not a window: one segment per chunk
        segments, window = _chunk_segments(segments, padding, chunk, q_offset, kv_offset), NO_WINDOW
    # (rows padded in the middle are named if the check fails: looked for only then, no host reads otherwise)
    holes = (lambda: _padding_holes(padding[:, :q_length])) if self_attn and padding is not None else (lambda: [])
    _verify(visible, _layout_of(segments, seg_q, seg_k, q_offset, kv_offset, window), batch_size, q_length,
            kv_length, device, local_size, chunk, holes)
    checked = "exhaustive" if batch_size * q_length * kv_length <= EXHAUSTIVE_CHECK_PAIRS else "probes"

    info = _info_from_segments(segments, batch_size, q_length, kv_length, q_offset, kv_offset, device, checked,
                               window)
    info.chunk = chunk
    if not self_attn:
        info.origins = [_first_real(padding, b) for b in range(batch_size)]
    return info


def _first_real(padding: Optional[torch.Tensor], b: int) -> int:
    """The cache position of row ``b``'s first real token (0 without padding, or for a row of padding only)."""
    if padding is None or not bool(padding[b].any()):
        return 0
    return int(padding[b].to(torch.int8).argmax())


def _layout_of(segments, seg_q, seg_k, q_offset, kv_offset, window) -> _Layout:
    """Our description of ``segments`` (b, q_start, q_end, k_start, k_end), written into the -1 filled segment id
    tensors ``seg_q`` / ``seg_k``, causal within ``window``."""
    for n, (b, qs, qe, ks, ke) in enumerate(segments):
        seg_q[b, qs:qe] = n
        seg_k[b, ks:ke] = n
    return _Layout(seg_q, seg_k, q_offset, kv_offset, Mask.canonical(True, window))


def _chunk_segments(row_segments, padding, chunk: int, q_offset: int, kv_offset: int) -> list:
    """Chunked attention (Llama 4) after a cache offset, as segments: transformers' chunks are ``chunk`` tokens of
    cache positions counted from each row's first real token (``masking_utils.chunked_overlay``: positions minus
    the row's left padding), and a query sees the keys of its own chunk, causally.  ``row_segments`` are the rows'
    one segment each (b, 0, q_length, first real key, end of the real keys); each becomes one segment per chunk its
    queries fall in, with that chunk's real keys (none for a query before the row's first real token)."""
    segments = []
    for b, qs, qe, ks, ke in row_segments:
        origin = _first_real(padding, b)
        i = qs
        while i < qe:
            c = (q_offset + i - origin) // chunk  # the chunk of query i (negative: left padding)
            end = min(qe, origin + (c + 1) * chunk - q_offset)  # the first query of the next chunk
            k_lo = min(max(ks, origin + c * chunk - kv_offset), ke)
            k_hi = max(min(ke, origin + (c + 1) * chunk - kv_offset), k_lo)
            segments.append((b, i, end, k_lo, k_hi) if c >= 0 else (b, i, end, k_lo, k_lo))
            i = end
    return segments


def _info_from_segments(segments, batch_size, q_length, kv_length, q_offset, kv_offset, device, checked,
                        window) -> FA4MaskInfo:
    dense = len(segments) == batch_size and all(
        qs == 0 and qe == q_length and ks == 0 and ke == kv_length for _, qs, qe, ks, ke in segments)
    info = FA4MaskInfo(batch_size, q_length, kv_length, q_offset, kv_offset, dense, checked=checked,
                       segments=list(segments), window=window)
    if dense:
        return info
    q_idx, k_idx, cu_q, cu_k = [], [], [0], [0]
    for b, qs, qe, ks, ke in segments:
        q_idx.append(torch.arange(qs, qe, device=device) + b * q_length)
        k_idx.append(torch.arange(ks, ke, device=device) + b * kv_length)
        cu_q.append(cu_q[-1] + qe - qs)
        cu_k.append(cu_k[-1] + ke - ks)
        info.q_offsets.append(q_offset + qs)
        info.k_offsets.append(kv_offset + ks)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    info.q_index = torch.cat(q_idx) if q_idx else empty
    info.k_index = torch.cat(k_idx) if k_idx else empty
    info.cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device=device)
    info.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=device)
    return info


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where packed documents start in rows of ``position_ids`` (..., L), as a bool tensor of their shape: at the
    first token and wherever a position does not continue the one before by one.

    This is transformers' own rule (``masking_utils.find_packed_sequence_indices``, which builds the document mask of
    its eager, sdpa and flex attentions), the one fa4dist follows everywhere: in one process (:func:`fa4dist_mask`
    gets it from transformers' mask; with a cache or an ``attention_mask``, where transformers builds no document
    mask, from here) and under context parallelism (``ContextParallelHandle.document_boundaries``).  transformers'
    flash-attention path reads only returns to the row's smallest position as starts
    (``prepare_fa_kwargs_from_position_ids``); the two agree on the positions ``DataCollatorWithFlattening`` makes
    (0, 1, ... in every document) and differ on a gap (0, 1, 2, 5, 6), a repeat or a drop that is not to the
    smallest position, where every rule of fa4dist starts a document."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


def _split_at_position_breaks(info: FA4MaskInfo, position_ids: torch.Tensor, device) -> FA4MaskInfo:
    """Splits segments where :func:`document_starts` says ``position_ids`` start a document.  transformers' own mask
    finds packed documents only without a cache and without an ``attention_mask`` (and not at all for models that do
    not hand it ``position_ids``, as GPT-OSS); flash-attention reads them in the attention call whatever the cache or
    mask, and so do we, by transformers' rule, for self-attention over a whole row (no cache offset: no cache, or a
    prefill into an empty one, static caches included).  After a cache offset, documents the cache hides are refused
    (:func:`_refuse_documents_behind_a_cache`)."""
    if position_ids is None or position_ids.dim() != 2:
        return info
    pos = position_ids.expand(info.batch_size, -1) if position_ids.shape[0] != info.batch_size else position_ids
    if pos.shape[-1] != info.q_length:
        return info
    restart = document_starts(pos)
    if info.q_offset or info.kv_offset or info.kv_length < info.q_length:
        _refuse_documents_behind_a_cache(info, pos, restart)
        return info
    if not bool(restart[:, 1:].any()):
        return info
    starts = [set(torch.nonzero(restart[b]).flatten().tolist()) for b in range(info.batch_size)]
    segments = []
    for b, qs, qe, ks, ke in info.segments:
        cuts = [qs] + sorted(i for i in starts[b] if qs < i < qe) + [qe]
        segments.extend((b, a, c, a, c) for a, c in zip(cuts[:-1], cuts[1:]))
    if len(segments) == len(info.segments):
        return info
    return _info_from_segments(segments, info.batch_size, info.q_length, info.kv_length, 0, 0, device,
                               info.checked + "+position_ids", info.window)


def _refuse_documents_behind_a_cache(info: FA4MaskInfo, pos: torch.Tensor, restart: torch.Tensor) -> None:
    """After a cache offset each row is one document from its first real token (what transformers' masks compute
    there too).  The keys of earlier calls are in the cache but their ``position_ids`` are not in this call, so a
    packed row's documents cannot be told apart there: raises UnsupportedMask when this call's positions show a
    document start, inside the call (a real query whose position does not continue the real one before it) or
    before it (a position below the query's distance from the row's first real token: an earlier position did not
    continue by one).  A position above that distance (positions that count cache slots, left padding included)
    is read as the row's one document."""
    device = pos.device
    origins = torch.tensor(info.origins or [0] * info.batch_size, device=device)[:, None]
    key_real = torch.zeros(info.batch_size, info.kv_length + 1, dtype=torch.bool, device=device)  # (+1: no key)
    for b, _, _, ks, ke in info.segments:
        key_real[b, ks:ke] = True
    cache_position = info.q_offset + torch.arange(info.q_length, device=device)
    own_key = (cache_position - info.kv_offset).clamp(-1, info.kv_length)
    own_key = torch.where(own_key < 0, info.kv_length, own_key)  # (outside the keys: the column that is never real)
    real = (cache_position[None] >= origins) & key_real[:, own_key]  # a real query: its own key is a real one
    previous_real = torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], dim=1)
    started = real & ((previous_real & restart) | (pos < cache_position[None] - origins))
    if bool(started.any()):  # (one host read per forward: the layers share the result)
        b, i = (int(x) for x in torch.nonzero(started)[0])
        raise UnsupportedMask(
            f"row {b}: query {i} (cache position {info.q_offset + i}, position_ids {int(pos[b, i])}) is in a packed "
            f"document that starts after the row's first real token (cache position {int(origins[b])}); after a KV "
            "cache offset fa4dist cannot tell which cached keys share its document (their position_ids are not in "
            "this call). Run packed rows without a cache offset (use_cache=False, or prefill into an empty cache in "
            "one call), or generate with one document per row")


def _probe_pairs(layout: _Layout, batch, q_length, kv_length, device):
    """(b, i, j) to check for a large problem: per query the diagonal and its neighbours, the window's edge and the
    key just outside it, the first and last key, its segment's first key, the one before and the last real key
    before it (across padding in the middle of a row, which our segments cut and transformers' mask may not), and
    random keys."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    bi = torch.arange(batch).repeat_interleave(q_length)
    ii = torch.arange(q_length).repeat(batch)
    diagonal = ii + layout.q_offset - layout.kv_offset
    probes_j = [diagonal, diagonal + 1, diagonal - 1, torch.zeros_like(ii), torch.full_like(ii, kv_length - 1)]
    if layout.mask.lo is not None:
        probes_j += [diagonal + layout.mask.lo, diagonal + layout.mask.lo - 1]
    probes_j += [torch.randint(0, kv_length, ii.shape, generator=gen) for _ in range(RANDOM_PROBES_PER_QUERY)]
    seg_k = layout.seg_k
    if seg_k.numel():
        sk_first = torch.full((seg_k.max().item() + 2,), kv_length, dtype=torch.long)
        flat = seg_k.cpu()
        for bb in range(batch):
            idx = torch.nonzero(flat[bb] >= 0).flatten()
            if idx.numel():
                sk_first.scatter_reduce_(0, flat[bb, idx], idx, reduce="amin")
        sq = layout.seg_q.cpu()[bi, ii]
        first = torch.where(sq >= 0, sk_first[sq.clamp(min=0)], torch.zeros_like(sq))
        keys = torch.arange(kv_length).expand(batch, -1)
        last_real = torch.where(flat >= 0, keys, -1).cummax(dim=1).values  # per row: the last real key up to j
        before = last_real[bi, (first - 1).clamp(0, kv_length - 1)]
        probes_j += [first, first - 1, torch.where(first >= 1, before, 0)]
    j = torch.cat(probes_j).clamp(0, kv_length - 1).to(device)
    return bi.repeat(len(probes_j)).to(device), ii.repeat(len(probes_j)).to(device), j


def _verify(visible, layout: _Layout, batch, q_length, kv_length, device, local_size=None, chunk=None,
            holes=lambda: []):
    """Raises UnsupportedMask unless transformers' predicate equals ours on every real query row checked.
    ``holes()``: (row, runs of real tokens) of rows padded in the middle, named in the error (a document across such
    padding is what the kernels' segments cannot hold)."""
    if batch * q_length * kv_length <= EXHAUSTIVE_CHECK_PAIRS:
        b, i, j = torch.meshgrid(torch.arange(batch, device=device), torch.arange(q_length, device=device),
                                 torch.arange(kv_length, device=device), indexing="ij")
        b, i, j = b.flatten(), i.flatten(), j.flatten()
    else:
        b, i, j = _probe_pairs(layout, batch, q_length, kv_length, device)
    real_query = layout.seg_q[b, i] >= 0
    theirs = visible(b, i, j)
    ours = layout.visible(b, i, j)
    bad = torch.nonzero(real_query & (theirs != ours)).flatten()
    if bad.numel():
        n = int(bad[0])
        if chunk is not None:
            hint = (f"; transformers named local_size={local_size}, the config's attention_chunk_size, read as "
                    "chunks of that many tokens from each row's first real token")
        elif local_size is not None:
            hint = (f"; transformers named local_size={local_size}, read as "
                    f"{describe_window(window_of(local_size))} (the query and the ones before it)")
        else:
            hint = ""
        padded = holes()
        if padded:
            row, runs = padded[0]
            hint += (f"; the attention_mask pads row {row} in the middle (its real tokens are {runs[:4]}...): "
                     "fa4dist attention supports left or right padding only")
        raise UnsupportedMask(
            f"the model's mask differs from what fa4dist attention computes (causal within documents, padding, "
            f"cache offsets, sliding windows) at batch {int(b[n])}, query {int(i[n])}, key {int(j[n])}: the model "
            f"says {'visible' if bool(theirs[n]) else 'masked'} ({bad.numel()} pairs differ){hint}; use "
            f"attn_implementation='sdpa' or 'eager' for this model or mask")


# ---------------------------------------------------------------------------------------------------------------
# the attention function


def layer_window(mask_window: Optional[tuple], sliding_window: Optional[int]) -> tuple[int, int]:
    """The kernels' window of one attention call: the one its mask was verified to have (None: no mask was built),
    which must agree with the call's ``sliding_window`` argument when it has one (the two describe the same layer:
    the eager attention reads the mask, flash-attention the argument)."""
    asked = window_of(sliding_window)
    if mask_window is None:
        return asked
    if sliding_window is not None and asked != tuple(mask_window):
        raise UnsupportedMask(f"the attention call asks for {describe_window(asked)} but the layer's mask has "
                              f"{describe_window(tuple(mask_window))}; they must agree (the eager attention would "
                              "follow the mask, flash-attention the argument)")
    return tuple(mask_window)


def attention_sinks(kwargs: dict, heads_q: int) -> Optional[torch.Tensor]:
    """The learned per-head attention sinks of a call (GPT-OSS passes them as ``s_aux``), or None."""
    if kwargs.get("sinks") is not None:
        raise UnsupportedMask("the attention call passes `sinks` (per-token sink logits): fa4dist attention has "
                              "per-head learned sinks only (transformers' `s_aux`, as GPT-OSS)")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads_q,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise UnsupportedMask(f"s_aux (attention sinks) must be one logit per query head, shape ({heads_q},), got "
                              f"{shape}")
    return sinks


def _info_from_kwargs(query, kwargs, q_length, kv_length) -> Optional[FA4MaskInfo]:
    """Flash-attention style ``cu_seq_lens_q/k`` (batch 1, packed)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if query.shape[0] != 1:
        raise UnsupportedMask(f"cu_seq_lens_q/k describe one packed row; got batch {query.shape[0]}")
    # any integer dtype, checked before its narrowing to the kernels' int32: (tensor, host values), one read each
    got_q = int32_cu_seqlens("cu_seq_lens_q", cu_q, query.device) if cu_q is not None else None
    got_k = got_q if cu_k is None or cu_k is cu_q else int32_cu_seqlens("cu_seq_lens_k", cu_k, query.device)
    (cu_q, values_q), (cu_k, values_k) = got_q or got_k, got_k
    if values_q[-1] != q_length or values_k[-1] != kv_length:
        raise UnsupportedMask(f"cu_seq_lens_q/k end at {values_q[-1]}/{values_k[-1]}, but the row holds "
                              f"{q_length} queries / {kv_length} keys")
    info = FA4MaskInfo(1, q_length, kv_length, 0, 0, False, cu_q, cu_k,
                       torch.arange(q_length, device=query.device), torch.arange(kv_length, device=query.device),
                       checked="cu_seq_lens")
    # Segment-local causality, bottom-right aligned within each segment when q and k lengths differ.
    lq = [b - a for a, b in zip(values_q, values_q[1:])]
    lk = [b - a for a, b in zip(values_k, values_k[1:])]
    info.q_offsets = [k - q for q, k in zip(lq, lk)]
    info.k_offsets = [0] * len(lq)
    return info


def _chunks_within(info: FA4MaskInfo, documents: FA4MaskInfo) -> bool:
    """Whether the mask's segments ``info`` are the ``cu_seq_lens`` documents cut further into runs no longer than
    the layer's ``local_size`` (its verified window plus one): a chunked layer's mask (Llama 4) over a packed row,
    whose chunks transformers finds from ``position_ids`` (the attention call does not get them).  Every boundary
    of the documents must be one of the segments'; the segments, verified against the model's mask, are then what
    it computes."""
    if info.window == NO_WINDOW or info.dense or info.batch_size != 1 or info.q_length != info.kv_length or \
            info.q_offset or info.kv_offset or not torch.equal(documents.cu_seqlens_q, documents.cu_seqlens_k):
        return False
    local_size = info.window[0] + 1
    if any((qs, qe) != (ks, ke) or qe - qs > local_size for _, qs, qe, ks, ke in info.segments):
        return False
    bounds = {qs for _, qs, _, _, _ in info.segments} | {qe for _, _, qe, _, _ in info.segments}
    return set(documents.cu_seqlens_q.tolist()) <= bounds


def _layout_of_call(attention_mask, kwargs, query, batch, q_length, kv_length) -> FA4MaskInfo:
    """The segments of one call: the mask function's, split where ``position_ids`` start documents, or
    ``cu_seq_lens``."""
    from_kwargs = _info_from_kwargs(query, kwargs, q_length, kv_length)
    if isinstance(attention_mask, FA4MaskInfo):
        info = attention_mask
    elif attention_mask is None:
        # transformers skipped mask creation (a paged cache, flash-style kwargs): plain causal, bottom-right aligned.
        info = FA4MaskInfo(batch, q_length, kv_length, kv_length - q_length, 0, True, checked="none",
                           segments=[(b, 0, q_length, 0, kv_length) for b in range(batch)])
    else:
        raise UnsupportedMask(
            f"fa4dist attention got a precomputed {type(attention_mask).__name__} mask of shape "
            f"{tuple(getattr(attention_mask, 'shape', ()))}; it can only express causal masks (with sliding windows) "
            "with padding and packed documents (pass a 2-D attention_mask or position_ids), or use "
            "attn_implementation='sdpa'")
    if (info.batch_size, info.q_length, info.kv_length) != (batch, q_length, kv_length):
        raise UnsupportedMask(f"mask built for (batch, q, kv) = {(info.batch_size, info.q_length, info.kv_length)}"
                              f" but attention got {(batch, q_length, kv_length)}")
    position_ids = kwargs.get("position_ids")
    if info.segments and position_ids is not None:
        cache_key = ("split", id(position_ids))
        if cache_key not in info.derived:
            info.derived.clear()
            info.derived[cache_key] = (position_ids, _split_at_position_breaks(info, position_ids, query.device))
        info = info.derived[cache_key][1]
    if from_kwargs is not None:
        # cu_seq_lens may refine a mask of one document per row; documents found from the mask or from
        # position_ids must agree with them, or be cut further by the mask at a chunked layer's chunks
        if _chunks_within(info, from_kwargs):
            return info
        if not info.dense and not (len(info.segments) == len(from_kwargs.cu_seqlens_q) - 1 and torch.equal(
                info.cu_seqlens_q.cpu(), from_kwargs.cu_seqlens_q.cpu())):
            raise UnsupportedMask("cu_seq_lens_q disagrees with the documents found from position_ids / "
                                  "attention_mask")
        info = from_kwargs
    return info


def autocast_operands(query, key, value) -> tuple:
    """query, key and value in the dtype of an ambient ``torch.autocast`` on their device: under autocast the
    projections give bf16/fp16 tensors, and the rotary embedding (fp32 cos/sin) makes query and key fp32 again, so
    the call gets fp32 q/k with a lower-precision v.  Eager, sdpa and flash-attention all run the attention in the
    autocast dtype (flash-attention casts fp32 operands to it); so do we.  Without autocast, or for fp64 (which
    autocast never lowers), the operands are returned as they came."""
    kind = query.device.type
    if not (torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)):
        return query, key, value
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in (query, key, value))


def warn_no_attention_weights(kwargs: dict, what: str) -> None:
    """transformers passes ``output_attentions`` to the attention function: fa4dist's never makes the weights (as its
    own fused attentions, it warns; the model then returns no attentions)."""
    if kwargs.get("output_attentions", False):
        warnings.warn(f"{what} does not return attention weights (output_attentions=True gives none); use "
                      "attn_implementation='eager' for them", stacklevel=3)


def fa4dist_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                              sliding_window: Optional[int] = None, softcap: Optional[float] = None, **kwargs):
    """transformers' attention interface entry: query (B, Hq, Lq, D), key/value (B, Hkv, Lk, D) ->
    (out (B, Lq, Hq, D), None)."""
    settings = _SETTINGS.get(getattr(getattr(module, "config", None), "_attn_implementation", NAME),
                             _SETTINGS.get(NAME, {}))
    if dropout and module.training:
        raise UnsupportedMask("fa4dist attention has no attention dropout; set attention_dropout=0")
    warn_no_attention_weights(kwargs, "fa4dist attention")
    if not getattr(module, "is_causal", True):
        raise UnsupportedMask("fa4dist attention is causal only; this module is bidirectional")
    batch, heads_q, q_length, head_dim = query.shape
    kv_length = key.shape[2]
    sinks = attention_sinks(kwargs, heads_q)
    window = layer_window(attention_mask.window if isinstance(attention_mask, FA4MaskInfo) else None,
                          sliding_window)
    info = _layout_of_call(attention_mask, kwargs, query, batch, q_length, kv_length)
    query, key, value = autocast_operands(query, key, value)

    q = query.transpose(1, 2)  # (B, Lq, H, D)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    common = dict(causal=True, window=window, softcap=softcap or None, sinks=sinks, softmax_scale=scaling,
                  deterministic=settings.get("deterministic"), backend=settings.get("backend", "auto"))
    if info.dense:
        out = fa4dist.attention(q.contiguous(), k.contiguous(), v.contiguous(), q_offset=info.q_offset,
                                k_offset=info.kv_offset, **common)
        return out, None
    qf = q.reshape(batch * q_length, heads_q, head_dim)
    kf = k.reshape(batch * kv_length, k.shape[2], k.shape[3])
    vf = v.reshape(batch * kv_length, v.shape[2], v.shape[3])
    qp = qf.index_select(0, info.q_index)
    kp = kf.index_select(0, info.k_index)
    vp = vf.index_select(0, info.k_index)
    if qp.shape[0] == 0:
        return q.new_zeros(batch, q_length, heads_q, v.shape[-1]), None
    outp = fa4dist.attention(qp, kp, vp, cu_seqlens_q=info.cu_seqlens_q, cu_seqlens_k=info.cu_seqlens_k,
                             q_offset=info.q_offsets, k_offset=info.k_offsets, **common)
    out = qf.new_zeros(batch * q_length, heads_q, v.shape[-1]).index_copy(0, info.q_index, outp)
    return out.view(batch, q_length, heads_q, v.shape[-1]), None


def decoder_of(model):
    """The decoder stack (``.layers``, ``.norm``) of a transformers causal LM.  ``base_model_prefix`` names it for
    most classes, but not for all (Llama 4's text model keeps it as ``model`` under the prefix ``language_model``;
    ``get_decoder()`` then returns the LM itself)."""
    for name in (model.base_model_prefix, "model"):
        decoder = getattr(model, name, None)
        if decoder is not None and hasattr(decoder, "layers"):
            return decoder
    raise TypeError(f"{type(model).__name__} has no decoder stack with .layers under {model.base_model_prefix!r} "
                    "or 'model'")


def register(name: str = NAME, *, backend: str = "auto", deterministic: Optional[bool] = None) -> str:
    """Registers fa4dist attention (and its mask function) with transformers under ``name``; returns ``name``.

    Use it with ``attn_implementation=name`` (``from_pretrained``/``from_config``/model constructors) or
    ``model.set_attn_implementation(name)``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _SETTINGS[name] = {"backend": backend, "deterministic": deterministic}
    AttentionInterface.register(name, fa4dist_attention_forward)
    AttentionMaskInterface.register(name, fa4dist_mask)
    return name


# ---------------------------------------------------------------------------------------------------------------
# weights


def hf_llama_config(config, **extra):
    """A ``transformers.LlamaConfig`` equal to an :class:`fa4dist.models.ModelConfig`."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.resolved_ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.resolved_head_dim, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, max_position_embeddings=1 << 20, **extra,
    )


def to_hf_llama(model, attn_implementation: str = NAME):
    """A ``LlamaForCausalLM`` with ``model``'s weights (an :class:`fa4dist.models.FA4Llama`), on the device and in
    the dtype of its parameters (the weights copied exactly)."""
    from transformers import LlamaForCausalLM

    if attn_implementation == NAME and NAME not in _SETTINGS:
        register()
    cfg = hf_llama_config(model.config)
    first = next(model.parameters())
    with torch.device(first.device):  # built where the weights are, whatever the default device
        hf = LlamaForCausalLM(cfg, attn_implementation=attn_implementation) if _accepts_attn_kwarg() else \
            LlamaForCausalLM(cfg)
    # the parameters in the model's dtype before the weights go in (loading fp64 weights into fp32 parameters
    # rounds them); only the parameters: hf.to(dtype) cast the rotary inv_freq buffers too, so a bf16 model's copy
    # turned positions with bf16-rounded frequencies (whole radians off at a few thousand tokens), where ours and
    # from_pretrained(torch_dtype=torch.bfloat16) keep them fp32
    for p in hf.parameters():
        p.data = p.data.to(first.dtype)
    hf.set_attn_implementation(attn_implementation) if hasattr(hf, "set_attn_implementation") else None
    ours = {k: v for k, v in model.state_dict().items()}
    theirs = hf.state_dict()
    mapped = {}
    for k in theirs:
        src = k[len("model."):] if k.startswith("model.") else k
        if src not in ours:
            raise KeyError(f"no fa4dist parameter for {k}")
        mapped[k] = ours[src]
    hf.load_state_dict(mapped)
    return hf


def _accepts_attn_kwarg() -> bool:
    import inspect

    from transformers import LlamaForCausalLM

    return "attn_implementation" in inspect.signature(LlamaForCausalLM.__init__).parameters


def __getattr__(name):  # the context-parallel API lives in its own module, imported on first use
    if name in ("enable_context_parallel", "ContextParallelHandle"):
        from . import hf_context_parallel

        return getattr(hf_context_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
