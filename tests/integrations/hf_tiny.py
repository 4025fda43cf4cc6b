"""Tiny randomly initialized transformers causal LMs (fp64) and the fp64 eager attention the HF integration tests
compare against.

Families: ``llama``, ``qwen2`` (plain causal), ``mistral`` (a sliding window on every layer), ``gemma2`` (sliding
and global layers interleaved, logit soft-capping, ``query_pre_attn_scalar``), ``gemma3`` (sliding and global
layers, ``query_pre_attn_scalar``), ``gpt_oss`` (sliding and global layers, learned attention sinks), ``llama4``
(chunked attention layers and a global one without RoPE, mixture-of-experts).  Windows and chunks are
:data:`WINDOW` tokens, shorter than the test documents, so they bind.

:data:`EAGER_FP64` is the models' own eager attention with its softmax in the inputs' dtype: transformers builds its
usual eager mask for it (causal, sliding window, padding, packed documents: the model's own predicate), and it
applies the call's scaling, soft-capping and sinks as the models' eager functions do.  Stock ``eager`` computes the
softmax in fp32 (Gemma 2/3, Mistral, Llama; GPT-OSS keeps the dtype), which alone moves fp64 results by ~1e-7.

Gemma's RMSNorm computes in fp32 whatever the dtype (its weight gradient is summed in fp32, so the same batch run
packed or one document at a time differs by ~1e-7); :func:`tiny_model` runs those norms in the model's dtype, the
same formula, so that fp64 comparisons see only the attention.  Llama 4's MoE router rounds its sigmoid to fp32
too, an ulp apart with the number of tokens in the call; it runs in the model's dtype here as well.
"""

from __future__ import annotations

import types

import torch
from transformers import (
    AttentionInterface, AutoModelForCausalLM, Cohere2Config, DeepseekV3Config, Gemma2Config, Gemma3TextConfig,
    GptOssConfig, Llama4TextConfig, LlamaConfig, MistralConfig, Olmo3Config, Phi3Config, Qwen2Config, Qwen3Config,
    SmolLM3Config,
)
from transformers.masking_utils import AttentionMaskInterface, eager_mask

VOCAB = 97
WINDOW = 6
SOFTCAP = 0.5
SIZE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
INTERLEAVED = ["sliding_attention", "full_attention"]
NO_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=None, eos_token_id=None)  # (their defaults lie past VOCAB)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZE),
    "qwen2": lambda: Qwen2Config(**SIZE),
    "mistral": lambda: MistralConfig(**SIZE, sliding_window=WINDOW),
    # a large init puts the scores where the cap bends them (the models' 0.02 gives scores of ~0.02)
    "gemma2": lambda: Gemma2Config(**SIZE, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP,
                                   query_pre_attn_scalar=24, layer_types=INTERLEAVED, initializer_range=0.2),
    "gemma3": lambda: Gemma3TextConfig(**SIZE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                       layer_types=INTERLEAVED),
    "gpt_oss": lambda: GptOssConfig(**{**SIZE, "intermediate_size": 32}, head_dim=16, sliding_window=WINDOW,
                                    layer_types=INTERLEAVED, num_local_experts=4, num_experts_per_tok=2),
    # more families whose attention is plain causal or windowed, with what else they bring to the attention call:
    # q/k norms (Qwen 3, OLMo 3), layers without RoPE (SmolLM 3, Cohere 2's global layers), a sliding window on
    # every layer (Phi-3) or interleaved (Cohere 2, OLMo 3), multi-head latent attention (DeepSeek-V3: value heads
    # narrower than query / key heads, MoE)
    "qwen3": lambda: Qwen3Config(**SIZE, head_dim=16),
    "phi3": lambda: Phi3Config(**SIZE, sliding_window=WINDOW, **NO_SPECIAL_TOKENS),
    "cohere2": lambda: Cohere2Config(**SIZE, sliding_window=WINDOW, layer_types=INTERLEAVED),
    "olmo3": lambda: Olmo3Config(**SIZE, sliding_window=WINDOW, layer_types=INTERLEAVED, **NO_SPECIAL_TOKENS),
    "smollm3": lambda: SmolLM3Config(**SIZE, no_rope_layers=[1, 0], **NO_SPECIAL_TOKENS),
    "deepseek_v3": lambda: DeepseekV3Config(**SIZE, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                            qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                            n_group=1, topk_group=1),
    # three chunked layers and a global one without RoPE (Llama 4's pattern), experts on every second layer
    "llama4": lambda: Llama4TextConfig(**{**SIZE, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=96,
                                       attention_chunk_size=WINDOW, no_rope_layers=[1, 1, 1, 0],
                                       num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2),
}
EAGER_FP64 = "eager_fp64"


def eager_fp64_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                         s_aux=None, **kwargs):
    """softmax(cap(q k^T * scale) + mask [, sinks]) v with the softmax in the inputs' dtype (fp64 here)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., :key.shape[-2]]
    if s_aux is not None:  # the sink: one more logit per row, whose value is zero
        sink = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return (probs.to(value.dtype) @ value).transpose(1, 2).contiguous(), probs


AttentionInterface.register(EAGER_FP64, eager_fp64_attention)
AttentionMaskInterface.register(EAGER_FP64, eager_mask)


def _gemma_rms_norm_in_dtype(self, x):
    """Gemma's RMSNorm, ``x / rms(x) * (1 + weight)``, in x's dtype (the stock one casts to fp32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(x.dtype))


def _llama4_router_in_dtype(self, hidden_states):
    """Llama 4's router (top-k of the logits, then their sigmoid) with the sigmoid in the logits' dtype (the stock
    one rounds it in fp32, whose vectorized and scalar loops differ by an ulp: the same token's score then depends
    on how many tokens the call holds, ~1e-8 in fp64 logits between a packed row and its shards)."""
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, index = torch.topk(logits, self.top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
    return torch.sigmoid(scores), logits


def tiny_model(family: str, seed: int = 0, attn_implementation: str = EAGER_FP64, **overrides):
    """A tiny fp64 model of ``family`` with the config's overrides, weights from ``seed``."""
    config = CONFIGS[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).double()
    if hasattr(model, "set_experts_implementation"):  # GPT-OSS: the grouped-GEMM experts have no fp64
        model.set_experts_implementation("eager")
    for module in model.modules():
        if type(module).__name__ in ("Gemma2RMSNorm", "Gemma3RMSNorm"):
            module.forward = types.MethodType(_gemma_rms_norm_in_dtype, module)
        if type(module).__name__ == "Llama4Router":
            module.forward = types.MethodType(_llama4_router_in_dtype, module)
    return model


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float, what: str):
    """max |got - want| <= rel * max |want| (and no NaN)."""
    err = float((got - want).detach().abs().max())
    scale = float(want.detach().abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3e}, max |value| {scale:.3e}"


def assert_generation_matches(model, impl: str, ids, mask, max_new_tokens: int, rel: float, **generate_kwargs):
    """Greedy generation through attention ``impl`` gives the tokens of :data:`EAGER_FP64`'s, and the logits of
    every step within ``rel``."""
    outs = {}
    for name in (EAGER_FP64, impl):
        model.set_attn_implementation(name)
        with torch.no_grad():
            outs[name] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=0, output_logits=True,
                                        return_dict_in_generate=True, **generate_kwargs)
    assert torch.equal(outs[impl].sequences, outs[EAGER_FP64].sequences)
    for step, (got, want) in enumerate(zip(outs[impl].logits, outs[EAGER_FP64].logits)):
        assert_close_rel(got, want, rel, f"logits of generated token {step}")
