"""fa4dist attention inside transformers' LlamaForCausalLM (built offline from a config): logits and gradients equal
the stock attention ("sdpa" and "eager") for padded batches, packed documents (position_ids restarts and
flash-style cu_seq_lens), cached generation; masks the kernel cannot express are errors, never dropped."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    bidirectional_mask_function, causal_mask_function, sliding_window_causal_mask_function,
)

from fa4dist.data import SingleRankPlan  # noqa: E402
from fa4dist.integrations.hf import UnsupportedMask, fa4dist_mask, register, to_hf_llama  # noqa: E402
from fa4dist.models import FA4Llama, get_config  # noqa: E402

NAME = register()
VOCAB = 96


def tiny_llama(seed=0, **overrides) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **overrides)
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


def test_cached_generation_matches_sdpa(model):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generate expects
    outs = {}
    for impl in ("sdpa", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        pad_token_id=0)
    assert torch.equal(outs[NAME], outs["sdpa"])


def test_masks_we_cannot_express_are_errors(model):
    ids = torch.randint(0, VOCAB, (1, 12))
    model.set_attn_implementation(NAME)
    custom = torch.ones(1, 1, 12, 12, dtype=torch.bool)  # a 4-D mask: arbitrary, not expressible
    with pytest.raises(UnsupportedMask, match="precomputed"):
        model(input_ids=ids, attention_mask=custom)
    kw = dict(batch_size=1, q_length=12, kv_length=12)
    with pytest.raises(UnsupportedMask, match="sliding-window"):
        fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(4), local_size=4)
    # the predicate is checked too, not only the arguments: a window smuggled in without local_size, a
    # bidirectional mask
    with pytest.raises(UnsupportedMask, match="differs"):
        fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(4))
    with pytest.raises(UnsupportedMask, match="differs"):
        fa4dist_mask(**kw, mask_function=bidirectional_mask_function)
    assert fa4dist_mask(**kw, mask_function=causal_mask_function).dense


def test_large_masks_are_checked_by_probes():
    kw = dict(batch_size=1, q_length=4096, kv_length=4096)
    info = fa4dist_mask(**kw, mask_function=causal_mask_function)
    assert info.dense and info.checked == "probes"
    with pytest.raises(UnsupportedMask, match="differs"):
        fa4dist_mask(**kw, mask_function=sliding_window_causal_mask_function(1024))


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
