"""fa4dist attention inside transformers models (built offline from configs): logits and gradients equal the stock
attention ("sdpa" and "eager") for padded batches, packed documents (position_ids restarts and flash-style
cu_seq_lens), cached generation; Gemma 2 (sliding and global layers, soft-capping), Gemma 3, Mistral (sliding
window), GPT-OSS (sliding window, sinks) and Llama 4 (chunked attention) equal their own eager attention in fp64
(``hf_tiny.EAGER_FP64``) with windows and chunks shorter than the documents; masks the kernel cannot express are
errors, never dropped."""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    bidirectional_mask_function, causal_mask_function, sliding_window_causal_mask_function,
)

import hf_tiny  # noqa: E402
from fa4dist.data import SingleRankPlan  # noqa: E402
from fa4dist.integrations.hf import (  # noqa: E402
    UnsupportedMask, fa4dist_attention_forward, fa4dist_mask, register, to_hf_llama,
)
from fa4dist.models import FA4Llama, get_config  # noqa: E402

NAME = register()
VOCAB = 96


def tiny_llama(seed=0, **overrides) -> LlamaForCausalLM:
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg = LlamaConfig(**{**options, **overrides})
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def logits_with(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("stock", ["sdpa", "eager"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_stock(model, stock, side):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=gen)
    mask = torch.ones(3, 20, dtype=torch.long)
    for row, pad in ((1, 5), (2, 13)):
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, 20 - pad:] = 0
    ref = logits_with(model, stock, input_ids=ids, attention_mask=mask)
    ours = logits_with(model, NAME, input_ids=ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-5, atol=1e-5)


def _packed(lengths_per_row, seed=2):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths_per_row[0])
    ids = torch.randint(0, VOCAB, (len(lengths_per_row), total), generator=gen)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths_per_row])
    return ids, pos


@pytest.mark.parametrize("stock", ["sdpa", "eager"])
def test_packed_position_ids_match_stock_and_separate_documents(model, stock):
    lengths = [[5, 9, 1, 9], [24]]
    ids, pos = _packed(lengths)
    # transformers' stock attentions separate packed documents only without a cache
    ref = logits_with(model, stock, input_ids=ids, position_ids=pos, use_cache=False)
    ours = logits_with(model, NAME, input_ids=ids, position_ids=pos, use_cache=False)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # with a cache (the default in eval mode) we still do, like flash-attention
    cached = logits_with(model, NAME, input_ids=ids, position_ids=pos)
    torch.testing.assert_close(cached, ref, rtol=1e-5, atol=1e-5)
    start = 0
    for n in lengths[0]:  # each packed document alone
        alone = logits_with(model, stock, input_ids=ids[:1, start:start + n])
        torch.testing.assert_close(ours[0, start:start + n], alone[0], rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("positions", [
    [0, 1, 2, 3, 4, 10, 11, 12, 13, 14],  # a gap
    [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],  # back to a position above the row's first
    [0, 1, 2, 3, 4, 4, 5, 6, 7, 8],  # a repeat
], ids=["gap", "drop", "repeat"])
def test_every_break_in_position_ids_starts_a_document_with_a_cache_or_without(model, positions):
    """transformers' own mask starts a packed document wherever a position does not continue the one before by one
    (use_cache=False, no attention_mask); with a cache it builds no document mask and fa4dist split the row only where
    positions came back to its first one (flash-attention's rule), so these rows were one causal sequence with
    use_cache=True and two documents with use_cache=False (and under context parallelism).  Now both: the second
    document's logits are its own, as alone."""
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor(positions)[None]
    alone = logits_with(model, "eager", input_ids=ids[:, 5:], position_ids=pos[:, 5:], use_cache=False)
    stock = logits_with(model, "eager", input_ids=ids, position_ids=pos, use_cache=False)
    torch.testing.assert_close(stock[:, 5:], alone, rtol=1e-5, atol=1e-5)  # transformers' own rule
    for use_cache in (False, True):
        ours = logits_with(model, NAME, input_ids=ids, position_ids=pos, use_cache=use_cache)
        torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5, msg=f"use_cache={use_cache}")


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_a_static_cache_prefill_keeps_packed_documents_apart(model):
    """A prefill into a static cache has more keys (max_cache_len) than queries; it is still a whole row from its
    first token, so its packed documents and padded query rows are those of the call without a cache (it was read
    as one segment per row: the second document saw the first)."""
    ids, pos = _packed([[7, 5]])
    alone = logits_with(model, "eager", input_ids=ids[:, 7:], position_ids=pos[:, 7:], use_cache=False)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    ours = logits_with(model, NAME, input_ids=ids, position_ids=pos, past_key_values=cache,
                       cache_position=torch.arange(12))
    torch.testing.assert_close(ours[:, 7:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_packed_documents_behind_a_cache_offset_are_refused(model):
    """After a cache offset the cached keys' position_ids are not in the call, so which of them share a document
    with the queries cannot be told: a decode step after a packed prefill is refused, not computed across the
    documents.  Rows that are one document from their first real token decode as before, whether their positions
    count from that token or count cache slots (left padding included)."""
    ids, pos = _packed([[7, 5]])
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=ids[:, :11], position_ids=pos[:, :11], past_key_values=cache)  # the prefill is exact
        with pytest.raises(UnsupportedMask, match="packed document that starts after the row's first real token"):
            model(input_ids=ids[:, 11:], position_ids=pos[:, 11:], past_key_values=cache)
        cache = transformers.DynamicCache(config=model.config)  # a restart inside a call with a cache offset
        model(input_ids=ids[:, :4], position_ids=pos[:, :4], past_key_values=cache)
        with pytest.raises(UnsupportedMask, match="packed document"):
            model(input_ids=ids[:, 4:], position_ids=pos[:, 4:], past_key_values=cache)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    two = torch.cat([ids, ids.flip(-1)])
    for positions in (torch.arange(12).expand(2, -1), (mask.cumsum(-1) - 1).clamp(min=0)):
        steps = {}
        for impl in ("sdpa", NAME):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                cache = transformers.DynamicCache(config=model.config)
                model(input_ids=two[:, :10], attention_mask=mask[:, :10], position_ids=positions[:, :10],
                      past_key_values=cache)
                steps[impl] = model(input_ids=two[:, 10:], attention_mask=mask, position_ids=positions[:, 10:],
                                    past_key_values=cache).logits
        torch.testing.assert_close(steps[NAME], steps["sdpa"], rtol=1e-5, atol=1e-5)


def test_alibi_models_are_refused_by_name():
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       alibi=True)
    model = transformers.FalconForCausalLM(config).eval()
    model.set_attn_implementation(NAME)
    with pytest.raises(UnsupportedMask, match="ALiBi"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))


def test_flash_style_cu_seq_lens(model):
    ids, pos = _packed([[6, 10, 8]])
    cu = torch.tensor([0, 6, 16, 24], dtype=torch.int32)
    ref = logits_with(model, "sdpa", input_ids=ids, position_ids=pos, use_cache=False)
    ours = logits_with(model, NAME, input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=10, max_length_k=10)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedMask, match="disagrees"):
        bad = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
        logits_with(model, NAME, input_ids=ids, position_ids=pos, cu_seq_lens_q=bad, cu_seq_lens_k=bad)


@pytest.mark.parametrize("name", ["cu_seq_lens_q", "cu_seq_lens_k"])
def test_cu_seq_lens_of_other_dtypes_are_checked_before_their_narrowing(model, name):
    """int64 cu_seq_lens (what a collator may make) give the int32 ones' logits; a float tensor (was truncated) and
    an int64 value past 2**31 - 1 (wrapped: 2**32 + 16 read as 16) are refused naming the argument."""
    ids, pos = _packed([[6, 10, 8]])
    cu = torch.tensor([0, 6, 16, 24], dtype=torch.int32)
    want = logits_with(model, NAME, input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    got = logits_with(model, NAME, input_ids=ids, position_ids=pos, **{"cu_seq_lens_q": cu, name: cu.long()})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    wrapping = r"must hold token counts in \[0, 2\*\*31 - 1\] \(the kernels read int32\), got 4294967312"
    for bad, error, message in ((torch.tensor([0.0, 6.5, 16.0, 24.0]), TypeError, "must hold integers, got dtype"),
                                (torch.tensor([0, 6, 2**32 + 16, 24]), ValueError, wrapping)):
        with pytest.raises(error, match=f"{name} {message}"):
            logits_with(model, NAME, input_ids=ids, position_ids=pos, **{"cu_seq_lens_q": cu, name: bad})


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cu_seq_lens_are_read_once_per_forward_not_per_layer(monkeypatch, dtype):
    """Every layer got the same cu_seq_lens_q/k and read them to the host again (a device sync per layer), and an
    int64 tensor was converted to a new int32 one per layer, which the kernels' per-tensor cache could not
    recognise: one read per tensor now, for the whole forward pass (and the next, while the tensor is unchanged);
    a tensor changed in place is read again."""
    model = tiny_llama(num_hidden_layers=4)
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(t):
        values = tolist(t)
        if t.dim() == 1 and not t.is_floating_point() and values[:1] == [0] and len(values) == 4:
            reads.append(tuple(values))  # a cu_seqlens of three documents
        return values

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    ids, pos = _packed([[6, 10, 8]])
    cu = torch.tensor([0, 6, 16, 24], dtype=dtype)
    first = logits_with(model, NAME, input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert reads == [(0, 6, 16, 24)]
    again = logits_with(model, NAME, input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert reads == [(0, 6, 16, 24)]
    cu[1] = 10  # documents of 10, 6 and 8 tokens: read again
    ids2, pos2 = _packed([[10, 6, 8]])
    moved = logits_with(model, NAME, input_ids=ids2, position_ids=pos2, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert reads == [(0, 6, 16, 24), (0, 10, 16, 24)]
    fresh = torch.tensor([0, 10, 16, 24], dtype=dtype)
    torch.testing.assert_close(moved, logits_with(model, NAME, input_ids=ids2, position_ids=pos2,
                                                  cu_seq_lens_q=fresh, cu_seq_lens_k=fresh), rtol=0, atol=0)
    assert reads[2:] == [(0, 10, 16, 24)]
    with pytest.raises(UnsupportedMask, match="disagrees"):  # still checked against the documents, not cached
        logits_with(model, NAME, input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_gradients_match_sdpa():
    ids, pos = _packed([[7, 11, 6]])
    labels = ids.clone()
    grads = {}
    for impl in ("sdpa", NAME):
        m = tiny_llama(seed=3)
        m.train()
        m.set_attn_implementation(impl)
        m(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for n, g in grads["sdpa"].items():
        torch.testing.assert_close(grads[NAME][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_matches_sdpa(model, cache):
    """A static cache makes generate() build the mask up front and pass it back in as the attention mask."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generate expects
    outs = {}
    for impl in ("sdpa", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        pad_token_id=0, cache_implementation=cache)
    assert torch.equal(outs[NAME], outs["sdpa"])


def test_masks_we_cannot_express_are_errors(model):
    ids = torch.randint(0, VOCAB, (1, 12))
    model.set_attn_implementation(NAME)
    custom = torch.ones(1, 1, 12, 12, dtype=torch.bool)  # a 4-D mask: arbitrary, not expressible
    with pytest.raises(UnsupportedMask, match="precomputed"):
        model(input_ids=ids, attention_mask=custom)
    kw = dict(batch_size=1, q_length=12, kv_length=12)
    assert fa4dist_mask(**kw, mask_function=causal_mask_function).dense
    window = fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(4), local_size=4)
    assert window.dense and window.window == (3, 0) and window.checked == "exhaustive"
    # the predicate is checked, not only the arguments: a window that local_size does not name (or names wrong),
    # chunked attention (which transformers also announces with local_size), bidirectional masks
    def bidirectional_window(b, h, q, kv):
        return (q - kv).abs() < 4

    for mask_function, local_size in ((sliding_window_causal_mask_function(4), None),
                                      (sliding_window_causal_mask_function(4), 5),
                                      (bidirectional_window, 4), (bidirectional_mask_function, None)):
        with pytest.raises(UnsupportedMask, match="differs"):
            fa4dist_mask(**kw, mask_function=mask_function, local_size=local_size)

    def chunked(b, h, q, kv):  # chunked attention (Llama 4), which transformers announces with local_size too
        return (kv <= q) & (kv // 4 == q // 4)

    # over a whole sequence its chunks are separate documents, which the kernels compute exactly ...
    info = fa4dist_mask(**kw, mask_function=chunked, local_size=4)
    assert [seg[1:3] for seg in info.segments] == [(0, 4), (4, 8), (8, 12)]
    # ... and after a cache offset, on a layer whose local_size is the config's attention_chunk_size (transformers
    # hands the mask functions the config), one segment per chunk the queries touch
    chunked_config = types.SimpleNamespace(attention_chunk_size=4)
    cached = dict(batch_size=1, q_length=3, kv_length=10, q_offset=7, config=chunked_config)
    info = fa4dist_mask(**cached, mask_function=chunked, local_size=4)
    assert info.segments == [(0, 0, 1, 4, 8), (0, 1, 3, 8, 10)] and info.chunk == 4 and info.window == (-1, -1)
    # chunks of another size than local_size names (read as a window), without the config (a window too), or a
    # mask that is not whole chunks, are still refused
    for local_size, config in ((3, chunked_config), (5, chunked_config), (4, None)):
        with pytest.raises(UnsupportedMask, match="read as a sliding window"):
            fa4dist_mask(**dict(cached, config=config), mask_function=chunked, local_size=local_size)
    with pytest.raises(UnsupportedMask, match="read as chunks of that many tokens"):
        fa4dist_mask(**cached, local_size=4,
                     mask_function=lambda b, h, q, kv: (kv <= q) & (kv // 4 == q // 4) & (kv % 4 != 1))
    with pytest.raises(UnsupportedMask, match="prepared fa4dist mask of chunks of 4"):
        fa4dist_mask(batch_size=1, q_length=3, kv_length=10, attention_mask=info, local_size=6)
    # a prepared mask passed back in (generate() with a static cache) must be the layer's: a full-attention one
    # handed to a sliding-window layer kept no window, silently
    full = fa4dist_mask(**kw, mask_function=causal_mask_function)
    assert fa4dist_mask(**kw, attention_mask=full) is full
    assert fa4dist_mask(**kw, attention_mask=window, local_size=4) is window
    for prepared, local_size in ((full, 4), (window, None), (window, 6)):
        with pytest.raises(UnsupportedMask, match="prepared fa4dist mask with window"):
            fa4dist_mask(**kw, attention_mask=prepared, local_size=local_size)


def test_padding_in_the_middle_of_a_row_is_named_in_the_error(model):
    """A row padded in the middle was refused in a prefill only as 'the model's mask differs ... at batch 1, query 6,
    key 0' (a decode step against a cache named the row's non-contiguous real keys); the error names the row and its
    runs of real tokens now.  Padding that separates packed documents the mask keeps apart still runs."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 4:6] = 0
    model.set_attn_implementation(NAME)
    message = (r"the attention_mask pads row 1 in the middle \(its real tokens are \[\(0, 4\), \(6, 12\)\]\.\.\.\): "
               "fa4dist attention supports left or right padding only")
    for use_cache in (False, True):
        with pytest.raises(UnsupportedMask, match=message):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, use_cache=use_cache)

    def documents(b, h, q, kv):  # two documents, 0..3 and 6..11, the padding between them
        return (kv <= q) & ((q < 4) == (kv < 4))

    padding = torch.ones(1, 12, dtype=torch.bool)
    padding[0, 4:6] = False
    info = fa4dist_mask(1, 12, 12, mask_function=documents, attention_mask=padding)
    assert [seg[1:3] for seg in info.segments] == [(0, 4), (6, 12)]


def test_large_masks_are_checked_by_probes():
    kw = dict(batch_size=1, q_length=4096, kv_length=4096)
    info = fa4dist_mask(**kw, mask_function=causal_mask_function)
    assert info.dense and info.checked == "probes"
    windowed = fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(1024), local_size=1024)
    assert windowed.window == (1023, 0) and windowed.checked == "probes"
    with pytest.raises(UnsupportedMask, match="differs"):
        fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(1024))
    with pytest.raises(UnsupportedMask, match="differs"):  # one token off: the window's edge probes see it
        fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(1023), local_size=1024)


# ---- windows, soft-capping, sinks: Gemma 2/3, Mistral, GPT-OSS against their own eager attention in fp64 --------

WINDOWED = ["gemma2", "gemma3", "mistral", "gpt_oss", "llama4"]
REL = 1e-9


def _packed_loss_and_grads(model, impl, ids, pos, lengths_per_row, per_document: bool):
    """Logits of the packed rows (or of each document alone), the next-token loss over each whole row, and the
    gradients of that loss."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    if per_document:
        rows = []
        for row, lengths in zip(ids, lengths_per_row):
            bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
            rows.append(torch.cat([model(input_ids=row[None, a:b], use_cache=False).logits[0]
                                   for a, b in zip(bounds, bounds[1:])]))
        logits = torch.stack(rows)
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_models_match_their_eager_attention_in_fp64(family):
    """Packed documents longer than the window against each document alone through the model's eager attention
    (GPT-OSS does not hand position_ids to its mask: its own attentions let packed documents see each other),
    then a padded batch against the eager attention of the same batch."""
    model = hf_tiny.tiny_model(family, seed=7)
    lengths = [[9, 14, 5], [28]]
    ids, pos = _packed(lengths, seed=8)
    want_logits, want_grads = _packed_loss_and_grads(model, hf_tiny.EAGER_FP64, ids, pos, lengths, True)
    got_logits, got_grads = _packed_loss_and_grads(model, NAME, ids, pos, lengths, False)
    hf_tiny.assert_close_rel(got_logits, want_logits, REL, "logits")
    assert got_grads.keys() == want_grads.keys()
    if family == "gpt_oss":
        assert {f"model.layers.{i}.self_attn.sinks" for i in range(2)} <= got_grads.keys()
    for name, want in want_grads.items():
        hf_tiny.assert_close_rel(got_grads[name], want, REL, name)

    # padding (left and right) with the window inside each row's real tokens
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, 13:] = 0
    batch = dict(input_ids=torch.randint(0, hf_tiny.VOCAB, (3, 20), generator=torch.Generator().manual_seed(9)),
                 attention_mask=mask, use_cache=False)
    want = logits_with(model, hf_tiny.EAGER_FP64, **batch)
    got = logits_with(model, NAME, **batch)
    hf_tiny.assert_close_rel(got[mask.bool()], want[mask.bool()], REL, "padded logits")


def test_chunked_attention_with_flash_style_cu_seq_lens_matches_eager_fp64():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) on Llama 4: its chunked layers' mask has the
    documents of cu_seq_lens cut further at the chunks (transformers refuses flash-attention there).  The mask's
    finer segments were refused as 'cu_seq_lens_q disagrees with the documents found from position_ids'; they are
    what the model computes.  cu_seq_lens that do disagree with the documents are still refused."""
    model = hf_tiny.tiny_model("llama4", seed=7)
    ids, pos = _packed([[9, 14, 5]], seed=8)
    cu = torch.tensor([0, 9, 23, 28], dtype=torch.int32)
    want = logits_with(model, hf_tiny.EAGER_FP64, input_ids=ids, position_ids=pos, use_cache=False)
    got = logits_with(model, NAME, input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu,
                      cu_seq_lens_k=cu, max_length_q=14, max_length_k=14)
    hf_tiny.assert_close_rel(got, want, REL, "logits")
    bad = torch.tensor([0, 9, 20, 28], dtype=torch.int32)
    with pytest.raises(UnsupportedMask, match="cu_seq_lens_q disagrees"):
        logits_with(model, NAME, input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=bad,
                    cu_seq_lens_k=bad)


@pytest.mark.parametrize("family, cache", [("gemma2", "dynamic"), ("gpt_oss", "dynamic"), ("llama4", "dynamic"),
                                           ("llama4", "static")])
def test_cached_generation_past_the_window_matches_eager_fp64(family, cache):
    """The sliding layers' cache keeps the last window of keys (a key offset); left padding in the prompt.  Llama
    4's chunked layers: generation past several chunks (transformers counts them from each row's first real
    token), with a dynamic cache and a static one (whose mask is prepared up front and passed back in)."""
    model = hf_tiny.tiny_model(family, seed=10).eval()
    ids = torch.randint(1, hf_tiny.VOCAB, (2, 8), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    hf_tiny.assert_generation_matches(model, NAME, ids, mask, 3 * hf_tiny.WINDOW, REL, cache_implementation=cache)


def test_the_attention_call_refuses_what_it_cannot_compute():
    model = hf_tiny.tiny_model("gpt_oss")
    module = model.model.layers[0].self_attn  # a sliding layer
    q = torch.randn(1, 4, 10, 16, dtype=torch.float64)
    kv = torch.randn(1, 2, 10, 16, dtype=torch.float64)
    full = fa4dist_mask(1, 10, 10, mask_function=causal_mask_function)
    windowed = fa4dist_mask(1, 10, 10, mask_function=sliding_window_causal_mask_function(6), local_size=6)
    out, _ = fa4dist_attention_forward(module, q, kv, kv, windowed, sliding_window=6, s_aux=module.sinks)
    assert out.shape == (1, 10, 4, 16)
    with pytest.raises(UnsupportedMask, match="a sliding window of 6 tokens but the layer's mask has no sliding"):
        fa4dist_attention_forward(module, q, kv, kv, full, sliding_window=6)
    with pytest.raises(UnsupportedMask, match="per-token"):
        fa4dist_attention_forward(module, q, kv, kv, windowed, sinks=torch.zeros(1, 4, 10, 1))
    with pytest.raises(UnsupportedMask, match=r"shape \(4,\)"):
        fa4dist_attention_forward(module, q, kv, kv, windowed, s_aux=torch.zeros(2))
    module.train()
    with pytest.raises(UnsupportedMask, match="dropout"):
        fa4dist_attention_forward(module, q, kv, kv, windowed, dropout=0.1)


@pytest.mark.parametrize("sliding_window", [True, 4.5, 6.0, 0, -3, "6"])
def test_a_sliding_window_that_is_not_a_positive_integer_is_refused(sliding_window):
    """It was converted with int() first: True became a 1-token window and 4.5 a 4-token one (transformers' own
    ``kv_idx > q_idx - 4.5`` keeps 5), silently, where no mask was built to check it against."""
    import numpy as np

    model = hf_tiny.tiny_model("mistral")
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 10, 16, dtype=torch.float64)
    kv = torch.randn(1, 2, 10, 16, dtype=torch.float64)
    with pytest.raises(UnsupportedMask, match="a sliding window must be a positive number of tokens"):
        fa4dist_attention_forward(module, q, kv, kv, None, sliding_window=sliding_window)
    with pytest.raises(UnsupportedMask, match="a sliding window must be a positive number of tokens"):
        fa4dist_mask(1, 10, 10, mask_function=causal_mask_function, local_size=sliding_window)
    want, _ = fa4dist_attention_forward(module, q, kv, kv, None, sliding_window=6)
    for integral in (np.int64(6), torch.tensor(6)):  # integers of other types are the same window
        got, _ = fa4dist_attention_forward(module, q, kv, kv, None, sliding_window=integral)
        assert torch.equal(got, want)


def test_fa4dist_model_converts_to_hf_llama():
    cfg = get_config("tiny")
    torch.manual_seed(5)
    ours = FA4Llama(cfg).eval()
    hf = to_hf_llama(ours).eval()
    lengths = [9, 30, 25]
    ids, pos = _packed([lengths], seed=6)
    cu = torch.tensor([0, 9, 39, 64], dtype=torch.int32)
    with torch.no_grad():
        mine = ours(ids[0], pos[0], SingleRankPlan(cu))
        theirs = hf(input_ids=ids, position_ids=pos).logits[0]
        hf.set_attn_implementation("sdpa")
        stock = hf(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)


def test_to_hf_llama_copies_the_weights_exactly_where_they_are():
    """An fp64 model's weights went through the HF model's fp32 parameters (rounded, then cast back), and the HF
    model was built on the default device, not the source's (a CUDA model gave a CPU one)."""
    torch.manual_seed(5)
    ours = FA4Llama(get_config("tiny")).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 1e-9)  # below fp32's resolution at these magnitudes
    with torch.device("meta"):  # a default device other than the model's
        hf = to_hf_llama(ours)
    theirs = dict(hf.named_parameters())
    assert len(theirs) == len(dict(ours.named_parameters()))
    for name, p in ours.named_parameters():
        q = theirs.get(name if name == "lm_head.weight" else f"model.{name}")
        assert q is not None and q.device == p.device and q.dtype == p.dtype and torch.equal(q, p), name



def test_to_hf_llama_keeps_the_rotary_frequencies_of_a_bf16_model_in_fp32():
    """hf.to(bfloat16) cast the rotary inv_freq buffers with the weights: the bf16 model's HF copy turned positions
    with bf16-rounded frequencies (cos/sin off by up to 2 at a few thousand positions; its logits over 4k tokens
    ~30% off the fp64 model's where ours are ~2%), unlike from_pretrained(torch_dtype=torch.bfloat16), which keeps
    them fp32. The copy's rotary tables must be ours."""
    from fa4dist.models import rotary_tables

    cfg = get_config("tiny", rope_theta=500000.0)
    torch.manual_seed(5)
    hf = to_hf_llama(FA4Llama(cfg).to(torch.bfloat16))
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in hf.buffers() if b.is_floating_point())
    pos = torch.arange(0, 8192, 7)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos[None])
    want_cos, want_sin = rotary_tables(pos, cfg.resolved_head_dim, cfg.rope_theta)
    tol = 4 * torch.finfo(torch.float32).eps * 8192  # a few ulps of the largest angle (~1e4)
    torch.testing.assert_close(cos[0], want_cos, rtol=0, atol=tol)
    torch.testing.assert_close(sin[0], want_sin, rtol=0, atol=tol)


def test_output_attentions_warns_that_no_weights_come_back(model):
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation(NAME)
    with pytest.warns(UserWarning, match="fa4dist attention does not return attention weights"):
        with torch.no_grad():
            model(input_ids=ids, output_attentions=True)


@pytest.mark.parametrize("chunk_tokens, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_tiled_loss_refuses_a_chunk_size_it_cannot_use(chunk_tokens, error):
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    hidden, weight, labels = torch.randn(6, 4), torch.randn(10, 4), torch.randint(0, 10, (6,))
    with pytest.raises(error, match="chunk_tokens must be"):
        tiled_cp_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("labels, error, message", [
    (torch.zeros(6), TypeError, "labels must have an integer dtype"),
    (torch.tensor([0, 1, 2, 3, 4, 10]), ValueError, r"labels hold 1 id\(s\) outside the vocabulary \[0, 10\)"),
    (torch.zeros(5, dtype=torch.long), ValueError, "hidden holds 6 tokens but labels 5"),
    # any shape of six elements was flattened and taken (handle.loss refused the same labels)
    (torch.zeros(6, 1, dtype=torch.long), ValueError, r"labels must be \(tokens,\) or \(1, tokens\), got \(6, 1\)"),
    (torch.zeros(2, 3, dtype=torch.long), ValueError, r"labels must be \(tokens,\) or \(1, tokens\), got \(2, 3\)"),
])
def test_tiled_loss_refuses_labels_it_cannot_use(labels, error, message):
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    with pytest.raises(error, match=message):
        tiled_cp_cross_entropy(torch.randn(6, 4), torch.randn(10, 4), labels)
    with pytest.raises(ValueError, match=r"hidden must be \(tokens, dim\) or \(1, tokens, dim\), got \(2, 3, 4\)"):
        tiled_cp_cross_entropy(torch.randn(2, 3, 4), torch.randn(10, 4), torch.zeros(6, dtype=torch.long))


@pytest.mark.parametrize("change, error, message", [
    # the LM head's operands: each failed in the first tile, after the label counts' exchange (on a cp group the
    # other ranks went on without this one)
    (dict(weight=torch.randn(10, 4, dtype=torch.bfloat16)), TypeError,
     "weight must have the dtype of hidden, torch.float32, got torch.bfloat16"),
    (dict(hidden=torch.randn(6, 4, dtype=torch.float64)), TypeError,
     "weight must have the dtype of hidden, torch.float64, got torch.float32"),
    (dict(hidden=torch.zeros(6, 4, dtype=torch.long), weight=torch.zeros(10, 4, dtype=torch.long)), TypeError,
     "hidden must have a floating-point dtype, got torch.int64"),
    (dict(bias=torch.zeros(5)), ValueError, r"bias must have shape \(10,\): one per vocabulary entry, got \(5,\)"),
    (dict(bias=[0.0] * 10), TypeError, "bias must be a torch.Tensor or None, got list"),
    (dict(bias=torch.zeros(10, dtype=torch.float64)), TypeError,
     "bias must have the dtype of hidden, torch.float32, got torch.float64"),
    # an infinite cap made every logit inf * tanh(0) = NaN, silently; True capped them at 1
    (dict(logit_softcap=float("inf")), ValueError, "logit_softcap must be finite and > 0, or None"),
    (dict(logit_softcap=True), TypeError, "logit_softcap must be a float > 0 or None, got bool"),
    (dict(logit_softcap="30"), TypeError, "logit_softcap must be a float > 0 or None, got str"),
])
def test_tiled_loss_refuses_a_head_it_cannot_use(change, error, message):
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy

    args = {**dict(hidden=torch.randn(6, 4), weight=torch.randn(10, 4), labels=torch.randint(0, 10, (6,))), **change}
    with pytest.raises(error, match=message):
        tiled_cp_cross_entropy(**args)


def test_tiled_loss_of_a_shard_without_tokens_has_the_gradients_of_the_full_logits_loss():
    """A rank whose shard holds no tokens (a plan of fewer chunks than ranks): cp_cross_entropy's loss is a 0 in the
    graph, the tiled loss was a constant (no tile ran), so that rank's backward raised while the others went on."""
    from fa4dist.integrations.hf_loss import tiled_cp_cross_entropy
    from fa4dist.models import cp_cross_entropy

    for tiled in (True, False):
        hidden = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
        labels = torch.zeros(0, dtype=torch.long)
        if tiled:
            loss = tiled_cp_cross_entropy(hidden, weight, labels, chunk_tokens=3)
        else:
            loss = cp_cross_entropy(hidden @ weight.t(), labels).loss
        loss.backward()
        assert float(loss) == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight)), tiled
        assert hidden.grad is not None and hidden.grad.shape == (0, 4), tiled


@pytest.mark.gpu
def test_to_hf_llama_keeps_a_cuda_model_on_its_device():
    """The HF model of a CUDA bf16 FA4Llama is built on that device in that dtype, with the same weights."""
    ours = FA4Llama(get_config("tiny")).to("cuda", torch.bfloat16)
    hf = to_hf_llama(ours)
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs.get(name if name == "lm_head.weight" else f"model.{name}")
        assert q is not None and q.device == p.device and q.dtype == p.dtype and torch.equal(q, p), name


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "llama4"])
def test_autocast_bf16_runs_the_attention_in_the_autocast_dtype(family):
    """Under torch.autocast(bf16) the projections give bf16 query, key and value, and the rotary embedding (fp32
    cos/sin) turns query and key back to fp32: the call got fp32 q/k with a bf16 v and fa4dist.attention refused
    them ('q, k and v must share a dtype'), where eager, sdpa and flash-attention run it in the autocast dtype.  Now
    the fp32 operands are cast to it too: logits and gradients as the eager attention's under the same autocast."""
    model = hf_tiny.tiny_model(family, seed=12).float()
    ids = torch.randint(0, hf_tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(13))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: no padding row predicts a real token (their outputs differ: ours are zeros)
    labels = ids.masked_fill(mask == 0, -100)
    results = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        results[impl] = out.logits.float()[mask.bool()], {n: p.grad for n, p in model.named_parameters()}
    (got, got_grads), (want, want_grads) = results[NAME], results["eager"]
    # both compute in bf16 (scores and probabilities rounded differently): a few bf16 ulps of the largest value
    rel = 8 * torch.finfo(torch.bfloat16).eps
    hf_tiny.assert_close_rel(got, want, rel, "logits")
    for name, g in want_grads.items():
        if g is not None:
            hf_tiny.assert_close_rel(got_grads[name], g, rel, name)


def test_padding_in_the_middle_of_a_large_row_is_refused_by_the_probes():
    """Above EXHAUSTIVE_CHECK_PAIRS the mask is checked by probes, which missed a row padded in the middle: its
    tokens after the padding, which transformers' mask lets see the ones before it, became a document of their own
    (0.46 off eager, a review found). Each query's probes hold the last real key before its segment now."""
    from fa4dist.integrations.hf import EXHAUSTIVE_CHECK_PAIRS

    length = 760
    assert 2 * length * length > EXHAUSTIVE_CHECK_PAIRS
    padding = torch.ones(2, length, dtype=torch.bool)
    padding[1, :341] = False  # left padding, one real token, a two-token hole, then real tokens
    padding[1, 342:344] = False
    with pytest.raises(UnsupportedMask, match=r"the attention_mask pads row 1 in the middle \(its real tokens are "
                                              r"\[\(341, 342\), \(344, 760\)\]"):
        fa4dist_mask(2, length, length, mask_function=causal_mask_function, attention_mask=padding)
    padding[1, :344] = False  # left padding only: accepted, by probes
    assert fa4dist_mask(2, length, length, mask_function=causal_mask_function, attention_mask=padding).checked == \
        "probes"
