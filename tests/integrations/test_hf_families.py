"""More transformers families through fa4dist attention, in one process and under context parallelism: Qwen 3,
Phi-3, Cohere 2, OLMo 3, SmolLM 3 and DeepSeek-V3 (``hf_tiny``), each against its own eager attention in fp64 (a
padded batch, cached generation, and at cp = 2 a packed batch against the packed row in one process).  Their
attention is causal masking (windows included) of what the model computes around it: q/k norms, layers without
RoPE, multi-head latent attention's narrower value heads; nothing in it is fa4dist-specific, so these guard the
integration against what a family does differently."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from cp_harness import GROUPS, shared_pool  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

from fa4dist.integrations.hf import enable_context_parallel, register  # noqa: E402

NAME = register()
FAMILIES = ["qwen3", "phi3", "cohere2", "olmo3", "smollm3", "deepseek_v3"]
REL = 1e-9
# Cohere 2's layer norm and DeepSeek-V3's router compute in fp32 whatever the model's dtype: a token's share of
# their weights' gradients then rounds at fp32 differently in a packed row than in a shard (~1e-7)
GRAD_REL = {"cohere2": 1e-6, "deepseek_v3": 1e-6}


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_and_cached_generation_equal_eager_fp64(family):
    model = hf_tiny.tiny_model(family, seed=3).eval()
    ids = torch.randint(1, hf_tiny.VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    logits = {}
    for impl in (hf_tiny.EAGER_FP64, NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
    hf_tiny.assert_close_rel(logits[NAME], logits[hf_tiny.EAGER_FP64], REL, "padded logits")
    hf_tiny.assert_generation_matches(model, NAME, ids[:, :9], mask[:, :9], 2 * hf_tiny.WINDOW, REL)


def packed_batch() -> dict:
    gen = torch.Generator().manual_seed(5)
    return DataCollatorWithFlattening()([{"input_ids": torch.randint(1, hf_tiny.VOCAB, (n,), generator=gen).tolist()}
                                         for n in (23, 41, 17)])


def packed_row_oracle(family: str):
    """(mean loss, {name: grad}) of the packed row through the model's own eager attention in fp64."""
    model = hf_tiny.tiny_model(family, seed=6)
    batch = packed_batch()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], ignore_index=-100)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _cp2(rank, world, family, strategy):
    import torch.distributed as dist

    if rank >= 2:
        return None
    model = hf_tiny.tiny_model(family, seed=6)
    with enable_context_parallel(model, group=GROUPS[2], strategy=strategy) as handle:
        local = handle.shard_batch(packed_batch())
        loss = handle.loss(model(**local).logits, local)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=GROUPS[2])
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
            dist.all_reduce(grads[name], group=GROUPS[2])
    return float(total), grads


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_equals_the_packed_row_in_one_process(pool, family, strategy):
    want_loss, want = packed_row_oracle(family)
    loss, grads = pool.run(_cp2, family=family, strategy=strategy)[0]
    assert abs(loss - want_loss) <= REL * abs(want_loss), (loss, want_loss)
    assert grads.keys() == want.keys()
    for name, g in want.items():
        hf_tiny.assert_close_rel(grads[name], g, GRAD_REL.get(family, REL), name)
