"""enable_context_parallel on transformers models (gloo, CPU, fp64): tiny LlamaForCausalLM and Qwen2ForCausalLM,
a packed batch of 3 documents from DataCollatorWithFlattening, cp = 2 and 3.  The ranks' loss shares add up to,
and their all-reduced gradients equal, those of a single-process oracle that runs each document alone with eager
attention (1e-9 relative), with the loss from the logits and tiled from the hidden states alike.  Options the
attention cannot compute are refused; disable() gives back the model's own attention.

The oracle's attention is transformers' eager attention with its softmax in the model's dtype (``EAGER_FP64``):
the stock ``eager`` computes the softmax in fp32 whatever the dtype, which alone moves gradients by ~1e-7."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cp_harness import GROUPS, shared_pool  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface, AutoModelForCausalLM, DataCollatorWithFlattening, Gemma2Config, LlamaConfig, MistralConfig,
    Qwen2Config,
)

from fa4dist.integrations.hf import UnsupportedMask, enable_context_parallel  # noqa: E402
from fa4dist.integrations.hf_loss import TiledCausalLMLoss  # noqa: E402

VOCAB = 97
LENGTHS = (23, 41, 17)
SIZE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
REL = 1e-9
EAGER_FP64 = "eager_fp64"


def eager_fp64_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal softmax(q k^T * scale) v of one unpadded row, all in the inputs' dtype (fp64 here)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    n = query.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


AttentionInterface.register(EAGER_FP64, eager_fp64_attention)


def tiny_model(family: str, seed: int = 0, **overrides):
    config = CONFIGS[family](**{**SIZE, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()


def packed_batch(lengths=LENGTHS, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]
    return DataCollatorWithFlattening()(docs)


def per_document_logits(model, batch, lengths=LENGTHS) -> torch.Tensor:
    """(1, T, vocab): each document alone through EAGER_FP64 attention (the model's own is put back after)."""
    own = model.config._attn_implementation
    model.set_attn_implementation(EAGER_FP64)
    ids = batch["input_ids"][0]
    bounds = torch.tensor((0,) + LENGTHS).cumsum(0).tolist()
    logits = torch.cat([model(input_ids=ids[None, a:b], use_cache=False).logits[0]
                        for a, b in zip(bounds, bounds[1:])])
    model.set_attn_implementation(own)
    return logits[None]


def oracle(family: str, lengths=LENGTHS):
    """Each document alone through the model's eager attention: (mean loss, {name: grad})."""
    model = tiny_model(family)
    model.set_attn_implementation(EAGER_FP64)
    ids = packed_batch(lengths)["input_ids"][0]
    total, count, start = 0.0, 0, 0
    for n in lengths:
        doc = ids[start:start + n]
        logits = model(input_ids=doc[None], use_cache=False).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum")
        count += n - 1
        start += n
    loss = total / count
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _cp_run(rank, world, family, cp, tiled):
    """On ranks < cp: the loss share and gradients, summed over the cp group (rank 0 returns them)."""
    import torch.distributed as dist

    if rank >= cp:
        return None
    group = GROUPS[cp]
    model = tiny_model(family)
    handle = enable_context_parallel(model, group=group)
    assert handle.cp_size == cp and handle.cp_rank == rank
    local = handle.shard_batch(packed_batch())
    if tiled:
        loss = TiledCausalLMLoss(model, handle, chunk_tokens=5)(local)
    else:
        loss = handle.loss(model(**local).logits, local)
    loss.backward()
    handle.disable()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    tokens = torch.tensor([local["input_ids"].shape[1]])
    dist.all_reduce(tokens, group=group)
    return (float(total), grads, int(tokens)) if rank == 0 else None


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


@pytest.fixture(scope="module")
def oracles():
    return {family: oracle(family) for family in ("llama", "qwen2")}


def assert_rel_close(got: float, want: float, what: str):
    assert abs(got - want) <= REL * abs(want), f"{what}: {got!r} vs {want!r}"


@pytest.mark.parametrize("tiled", [False, True], ids=["logits", "tiled"])
@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cp_loss_and_gradients_equal_per_document_oracle(pool, oracles, family, cp, tiled):
    loss, grads, tokens = pool.run(_cp_run, family=family, cp=cp, tiled=tiled)[0]
    want_loss, want_grads = oracles[family]
    assert tokens == sum(LENGTHS)
    assert_rel_close(loss, want_loss, "summed loss shares")
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        err = float((grads[name] - want).abs().max())
        assert err <= REL * float(want.abs().max()), f"{name}: max error {err:.3e}, max |grad| {want.abs().max():.3e}"


def _different_batches(rank, world):
    if rank >= 2:
        return None
    handle = enable_context_parallel(tiny_model("llama"), group=GROUPS[2])
    try:
        handle.shard_batch(packed_batch(seed=1 + rank))
    except ValueError as err:
        return str(err)
    finally:
        handle.disable()
    return "no error"


def test_ranks_with_different_batches_fail_alike(pool):
    messages = pool.run(_different_batches)[:2]
    assert all("different batches" in m for m in messages), messages


# ---- single process: refusals and undo ------------------------------------------------------------------------


def test_disable_restores_the_models_own_attention():
    model = tiny_model("llama")
    batch = packed_batch()
    with torch.no_grad():
        before = model(**batch, use_cache=False).logits
        with enable_context_parallel(model) as handle:
            assert model.config._attn_implementation == handle.name
            local = handle.shard_batch(batch)
            ours = model(**local).logits
        assert model.config._attn_implementation == "eager"
        after = model(**batch, use_cache=False).logits
        want = per_document_logits(model, batch)
    assert torch.equal(before, after)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)  # cp = 1: the whole batch
    with pytest.raises(RuntimeError, match="disabled"):
        handle.shard_batch(batch)
    handle.disable()  # idempotent


def test_sliding_window_exact_when_documents_fit_and_refused_otherwise():
    model = tiny_model("mistral", sliding_window=max(LENGTHS))  # Mistral: one window for every layer
    with torch.no_grad(), enable_context_parallel(model) as handle:
        ours = model(**handle.shard_batch(packed_batch())).logits  # every document fits: the window is moot
    with torch.no_grad():
        want = per_document_logits(model, packed_batch())
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)

    narrow = tiny_model("mistral", sliding_window=max(LENGTHS) - 1)
    with enable_context_parallel(narrow) as handle:
        with pytest.raises(UnsupportedMask, match=f"sliding window of {max(LENGTHS) - 1} tokens"):
            handle.shard_batch(packed_batch())
        handle.window = None  # past shard_batch's check, the model's forward refuses the window itself
        with pytest.raises(UnsupportedMask, match=f"sliding window of {max(LENGTHS) - 1} tokens"):
            narrow(**handle.shard_batch(packed_batch()))


def test_unsupported_models_and_options_are_refused():
    gemma = Gemma2Config(**SIZE, head_dim=16, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedMask, match="soft-capping"):
        enable_context_parallel(AutoModelForCausalLM.from_config(gemma))
    dropout = tiny_model("llama", attention_dropout=0.1).train()
    with enable_context_parallel(dropout) as handle, pytest.raises(UnsupportedMask, match="dropout"):
        dropout(**handle.shard_batch(packed_batch()))
    model = tiny_model("llama")
    with enable_context_parallel(model) as handle:
        with pytest.raises(ValueError, match="already enabled"):
            enable_context_parallel(model)
        with pytest.raises(ValueError, match="shard_batch"):
            model(**packed_batch(), use_cache=False)  # a batch that was not sharded
        two_rows = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
        with pytest.raises(ValueError, match=r"\(1, T\)"):
            handle.shard_batch(two_rows)
        padded = dict(packed_batch(), attention_mask=torch.ones(1, sum(LENGTHS), dtype=torch.long))
        padded["attention_mask"][0, -3:] = 0
        with pytest.raises(UnsupportedMask, match="padding"):
            handle.shard_batch(padded)


def test_the_attention_call_refuses_options_it_cannot_compute():
    from fa4dist.integrations.hf_context_parallel import PLAN_KEY, _cp_attention

    model = tiny_model("llama")
    with enable_context_parallel(model) as handle:
        plan = handle.shard_batch(packed_batch())[PLAN_KEY]
        module = model.model.layers[0].self_attn
        q = torch.zeros(1, 4, sum(LENGTHS), 16, dtype=torch.float64)
        kv = torch.zeros(1, 2, sum(LENGTHS), 16, dtype=torch.float64)
        for option, message in ((dict(sliding_window=16), "sliding window of 16 tokens"),
                                (dict(softcap=30.0), "soft-capping"), (dict(s_aux=torch.zeros(4)), "sinks")):
            with pytest.raises(UnsupportedMask, match=message):
                _cp_attention(module, q, kv, kv, None, **option, **{PLAN_KEY: plan})
        out, _ = _cp_attention(module, q, kv, kv, None, sliding_window=max(LENGTHS), **{PLAN_KEY: plan})
        assert out.shape == (1, sum(LENGTHS), 4, 16)


def test_documents_from_flash_kwargs_or_position_ids_agree():
    gen = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in LENGTHS]
    flash = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs)
    model = tiny_model("llama")
    with enable_context_parallel(model) as handle:
        want = torch.tensor((0,) + LENGTHS).cumsum(0)
        assert torch.equal(handle.document_boundaries(flash), want)
        assert torch.equal(handle.document_boundaries(packed_batch()), want)
        local = handle.shard_batch(flash)
        assert "cu_seq_lens_q" not in local and local["input_ids"].shape == (1, sum(LENGTHS))
        bad = dict(flash, cu_seq_lens_k=flash["cu_seq_lens_k"].flip(0))
        with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
            handle.shard_batch(bad)
