"""Supervised fine-tuning of a Hugging Face causal LM with FSDP2 and fa4dist context parallelism.

    torchrun --nproc-per-node 2 recipes/hf_sft.py --arch llama --model tiny --cp 2 --steps 10
    torchrun --nproc-per-node 2 recipes/hf_sft.py --checkpoint /path/to/local/hf/model --cp 2 --seqlen 65536

The model is a transformers class (``--arch llama|qwen2|qwen3|mistral|gemma2|gemma3|gpt_oss|llama4``) built from a
config (``--sliding-window N``: the window of Mistral's layers and of Gemma's and GPT-OSS's local layers; Gemma 2
also soft-caps its attention and final logits; GPT-OSS has per-head attention sinks; GPT-OSS and Llama 4 have
``--experts`` experts per MoE layer, ``--experts-per-token`` of them active, their router aux loss off; Llama 4's
chunked layers see chunks of ``--attention-chunk`` tokens, and every fourth layer is a global one without RoPE):
fa4dist's size
presets (``--model tiny|small|base|1b``, byte vocabulary) or Llama-3 shapes (``llama3.2-1b``, ``llama3-8b``,
vocabulary 128256), randomly initialized; or a local checkpoint directory (``--checkpoint``, nothing is
downloaded), whose config defines the model: the options that shape or initialize one (``--arch``, ``--model``,
``--layers``, ``--sliding-window``, ``--experts``, ``--experts-per-token``, ``--attention-chunk``, ``--init``) are
refused with it, as
are ``--experts`` / ``--experts-per-token`` with an ``--arch`` without MoE layers and ``--loss-chunk`` with
``--loss logits``.  Data are packed windows of documents from :mod:`fa4dist.data` (this repository's text, byte tokens),
turned into what transformers' ``DataCollatorWithFlattening`` makes.  Each window goes through
``enable_context_parallel``'s ``shard_batch`` (LPT plan of its documents, labels shifted globally, global
positions) and the model's attention layers run ``FA4ContextParallelAttention`` over the cp group.

Ranks form a (dp, cp) mesh, cp innermost; decoder layers and the root are ``fully_shard``-ed over all dp x cp ranks
(bf16 compute, fp32 master weights and reductions on GPUs).  FSDP averages gradients over dp x cp, so the loss
that goes into the backward is multiplied by cp (the cp shares of a sequence add up).  The loss is computed from
the final hidden states in tiles of ``--loss-chunk`` tokens (``--loss tiled``, default: the logits of the whole
shard never exist) or from the model's logits (``--loss logits``).  ``--activation-checkpointing`` uses
transformers' own per-layer checkpointing; ``--tile-mlp N`` also runs each MLP over N tokens at a time under
checkpointing (the MLP intermediates of a long shard are the largest activations).  ``--init sharded`` (default
for models over 2B parameters) builds the model on the meta device and initializes each rank's shard on its
device: normal(0, initializer_range) matrices, zero biases -- not bitwise transformers' init --, and the model's own
init for its norms (ones, zeros for Gemma's 1 + weight) and buffers (rotary frequencies, Gemma's embedding scale).

Rank 0 prints a progress bar and a ``SUMMARY {...}`` JSON line (tokens/s, MFU, peak memory) like the other
recipes; ``--memory-report`` adds a ``MEMORY {...}`` line (measured phases and estimated components).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from fa4dist.data.tokenizer import VOCAB_SIZE  # noqa: E402
from fa4dist.models import causal_training_flops, get_config  # noqa: E402

ARCHS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
         "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "gpt_oss": "GptOssConfig",
         "llama4": "Llama4TextConfig"}
WINDOWED_ARCHS = ("mistral", "gemma2", "gemma3", "gpt_oss")
MOE_ARCHS = ("gpt_oss", "llama4")
LLAMA3_PRESETS = {
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
}
SHARDED_INIT_ABOVE = 2e9  # parameters: --init auto builds larger models on the meta device
# what --checkpoint makes unused (the checkpoint defines the model and holds its weights): refused by name when given
CHECKPOINT_DEFINES = "the checkpoint's config defines the model (the run reports its model_type as arch)"
UNUSED_WITH_CHECKPOINT = {
    "arch": CHECKPOINT_DEFINES, "model": CHECKPOINT_DEFINES, "layers": CHECKPOINT_DEFINES,
    "sliding_window": CHECKPOINT_DEFINES, "experts": CHECKPOINT_DEFINES, "experts_per_token": CHECKPOINT_DEFINES,
    "attention_chunk": CHECKPOINT_DEFINES,
    "init": "the checkpoint's weights are loaded whole on every rank (from_pretrained), then sharded",
}
# the shared --strategy / --ulysses-degree offer the hybrid strategy, which this recipe refuses (its help says so)
NO_HYBRID = ("enable_context_parallel takes the hybrid strategy from a 2-D mesh, which this recipe does not build "
             "(auto picks the largest Ulysses degree the heads allow)")
MOE_ONLY = {"experts": "only gpt_oss and llama4 have MoE layers",
            "experts_per_token": "only gpt_oss and llama4 have MoE layers"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(p, unused={"ulysses_degree": NO_HYBRID}, models=LLAMA3_PRESETS)
    strategy = next(a for a in p._actions if a.dest == "strategy")
    strategy.help = ("context-parallel strategy: auto (the largest Ulysses degree the heads allow, ring over the "
                     "rest), ring or ulysses; hybrid is refused (enable_context_parallel takes it from a 2-D mesh, "
                     "which this recipe does not build)")
    g = p.add_argument_group("Hugging Face model")
    g.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="transformers model family")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="tokens in the sliding window of Mistral's layers and of Gemma's and GPT-OSS's local "
                        "layers (default: Mistral none, the others the config class's)")
    g.add_argument("--experts", type=common.positive_int, default=8,
                   help="gpt_oss, llama4: experts per MoE layer")
    g.add_argument("--experts-per-token", type=common.positive_int, default=2,
                   help="gpt_oss, llama4: experts each token runs")
    g.add_argument("--attention-chunk", type=common.positive_int, default=None,
                   help="llama4: tokens per chunk of its chunked attention layers (default: the config class's)")
    g.add_argument("--checkpoint", default=None,
                   help="a local checkpoint directory (from_pretrained, offline); it defines the model, so "
                        + ", ".join(map(common.option_name, UNUSED_WITH_CHECKPOINT)) + " are refused with it")
    g.add_argument("--tokenizer", default=None,
                   help="a local transformers tokenizer directory (a checkpoint's own) to tokenize --data with "
                        "(default: fa4dist.data's byte tokens); without --checkpoint the model's vocabulary is its")
    g.add_argument("--init", choices=["auto", "full", "sharded"], default="auto",
                   help="full: every rank builds the whole model (seeded, transformers' init); sharded: meta "
                        "device, then each rank initializes its shard; auto: sharded above 2B parameters")
    g.add_argument("--loss", choices=["tiled", "logits"], default="tiled",
                   help="tiled: LM head + cross entropy over --loss-chunk tokens at a time; logits: the model's")
    g.add_argument("--loss-chunk", type=common.positive_int, default=None,
                   help="tokens per loss tile of --loss tiled (default: 2**29 / vocab)")
    g.add_argument("--tile-mlp", type=common.non_negative_int, default=0,
                   help="run each MLP over this many tokens at a time (0: off)")
    g.add_argument("--offload-checkpoints", action="store_true",
                   help="activation checkpointing with the checkpoints in pinned host memory (transformers >= 5.2x; "
                        "on CPUs, where they are in host memory already, plain activation checkpointing)")
    g.add_argument("--memory-report", action="store_true", help="print a MEMORY {...} line after the first step")
    args, given = common.parse_given(p, argv)
    if args.checkpoint is not None:
        common.refuse_unused(p, given, UNUSED_WITH_CHECKPOINT, "with --checkpoint")
    # before the shared checks, whose hint for a bare --strategy hybrid (add --ulysses-degree) this recipe refuses too
    if args.strategy == "hybrid" or args.ulysses_degree is not None:
        p.error(f"--strategy hybrid / --ulysses-degree: {NO_HYBRID}")
    common.check_common_args(p, args, models=LLAMA3_PRESETS)
    if args.checkpoint is None and args.model in LLAMA3_PRESETS and args.arch != "llama":
        p.error(f"--model {args.model} is a Llama shape; use --arch llama (got --arch {args.arch})")
    if args.arch not in MOE_ARCHS and args.checkpoint is None:
        common.refuse_unused(p, given, MOE_ONLY, f"by --arch {args.arch}")
    if args.arch != "llama4" and args.checkpoint is None:
        common.refuse_unused(p, given, {"attention_chunk": "only llama4 has chunked attention layers"},
                             f"by --arch {args.arch}")
    if args.loss == "logits":
        common.refuse_unused(p, given, {"loss_chunk": "the model's logits are computed whole (--loss tiled tiles "
                                                      "them)"}, "by --loss logits")
    if args.seqlen < args.cp:  # (shard_batch refused it on every rank in the first step, the model built)
        p.error(f"--seqlen {args.seqlen} is shorter than --cp {args.cp}: enable_context_parallel gives every cp rank "
                f"at least one token of each sequence")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint must be a local checkpoint directory, {args.checkpoint!r} is not one")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        p.error(f"--tokenizer must be a local tokenizer directory, {args.tokenizer!r} is not one")
    if args.sliding_window is not None and (args.arch not in WINDOWED_ARCHS or args.sliding_window < 1):
        p.error(f"--sliding-window takes a positive number of tokens and --arch {' or '.join(WINDOWED_ARCHS)}")
    if args.arch in MOE_ARCHS and args.tile_mlp:
        p.error(f"--tile-mlp runs dense MLPs; the MoE layers of --arch {args.arch} return router scores too (not "
                "tiled)")
    if args.checkpoint is None and args.model in LLAMA3_PRESETS:  # (a checkpoint's heads: checked in main)
        shape = LLAMA3_PRESETS[args.model]
        problem = common.ulysses_heads_problem(args, shape["num_attention_heads"], shape["num_key_value_heads"],
                                               f"--model {args.model}")
        if problem:
            p.error(problem)
    if args.offload_checkpoints:  # (it checkpoints: the SUMMARY said activation_checkpointing false)
        args.activation_checkpointing = True
    if not 1 <= args.experts_per_token <= args.experts:
        p.error(f"--experts-per-token must be in [1, --experts], got {args.experts_per_token} of {args.experts}")
    return args


# ---------------------------------------------------------------------------------------------------------------
# the model


def hf_config(args):
    """The transformers config of ``--arch`` at the ``--model`` size."""
    import transformers

    if args.model in LLAMA3_PRESETS:
        if args.arch != "llama":
            raise SystemExit(f"--model {args.model} is a Llama shape; use --arch llama")
        size = dict(LLAMA3_PRESETS[args.model])
    else:
        c = get_config(args.model)
        size = dict(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.resolved_ffn_dim,
                    num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                    head_dim=c.resolved_head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
                    tie_word_embeddings=c.tie_embeddings)
    if args.layers:
        size["num_hidden_layers"] = args.layers
    if args.tokenizer and args.model not in LLAMA3_PRESETS:  # the tokenizer's vocabulary, a multiple of 64
        size["vocab_size"] = -(-data_vocab(args) // 64) * 64
    extra = dict(attention_dropout=0.0, max_position_embeddings=max(args.seqlen, 8192))
    if args.arch == "mistral":
        extra["sliding_window"] = args.sliding_window  # None: full attention
    if args.arch.startswith("gemma"):
        extra["query_pre_attn_scalar"] = size["head_dim"] or size["hidden_size"] // size["num_attention_heads"]
        if args.sliding_window is not None:
            extra["sliding_window"] = args.sliding_window
    if args.arch == "gpt_oss":
        extra.update(num_local_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                     output_router_logits=False,
                     # its YaRN scaling (factor 32 over 4096 positions) expects this context length
                     max_position_embeddings=max(args.seqlen, 131072))
        if args.sliding_window is not None:
            extra["sliding_window"] = args.sliding_window
    if args.arch == "llama4":  # every layer MoE, dense MLPs (none then) of the preset's width
        extra.update(num_local_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                     output_router_logits=False, intermediate_size_mlp=size["intermediate_size"])
        if args.attention_chunk is not None:
            extra["attention_chunk_size"] = args.attention_chunk
    rope_theta = size.pop("rope_theta")
    config = getattr(transformers, ARCHS[args.arch])(**size, **extra)
    if args.arch != "gemma3":  # Gemma 3 keeps its two thetas (local and global layers)
        _set_rope_theta(config, rope_theta)
    return config


def _set_rope_theta(config, theta: float):
    """transformers 5 keeps rope_theta in ``rope_parameters``; older versions as an attribute."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        params["rope_theta"] = theta
    else:
        config.rope_theta = theta


def count_parameters(config) -> int:
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def own_attention(model_type: str) -> str:
    """The model's own attention (the reference run's; enable_context_parallel replaces it in the recipe): sdpa,
    or eager for Gemma and GPT-OSS, whose attention soft-capping and sinks sdpa cannot express."""
    return "eager" if model_type.startswith("gemma") or model_type == "gpt_oss" else "sdpa"


@functools.lru_cache(maxsize=None)
def _tokenizer(path: str):
    from fa4dist.data import PretrainedTokenizer

    try:
        return PretrainedTokenizer(path)
    except ValueError as err:
        raise SystemExit(f"--tokenizer: {err}") from None


def data_tokenizer(args):
    """The tokenizer of the data: ``--tokenizer``'s, or None (fa4dist.data's byte tokens)."""
    return _tokenizer(args.tokenizer) if args.tokenizer else None


def data_vocab(args) -> int:
    """Every token id of the data is below it."""
    return data_tokenizer(args).vocab_size if args.tokenizer else VOCAB_SIZE


def check_vocab(vocab: Optional[int], args, what: str) -> None:
    """Refuses a model whose vocabulary (``vocab``) the data's token ids can pass, by name."""
    if vocab is not None and vocab < data_vocab(args):
        source = f"--tokenizer {args.tokenizer}'s" if args.tokenizer else "the byte tokens of fa4dist.data"
        raise SystemExit(f"{what} vocabulary ({vocab}) is smaller than {source} ({data_vocab(args)})")


def checkpoint_config(path: str, args=None):
    """The config of the local checkpoint ``--checkpoint`` names, checked (read alone, before the process group and
    the weights: the recipe calls it first): a directory without a transformers config, or whose vocabulary is
    smaller than the data's token ids (byte tokens, or ``--tokenizer``'s), is refused by name."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--checkpoint {path}: not a transformers checkpoint ({err})") from None
    check_vocab(getattr(config.get_text_config(), "vocab_size", None),
                args if args is not None else argparse.Namespace(tokenizer=None), "the checkpoint's")
    dropout = getattr(config.get_text_config(), "attention_dropout", 0.0) or 0.0
    if dropout > 0:  # (the integration refused it on every rank once the group was up and the weights loaded)
        raise SystemExit(f"--checkpoint {path}: its config has attention_dropout = {dropout}, which fa4dist's "
                         "attention does not compute; set it to 0 in the checkpoint's config.json to fine-tune "
                         "without it")
    return config


# the weight files from_pretrained reads (one file, or an index of shards)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_checkpoint_weights(path: str) -> None:
    """A checkpoint directory with a config but no weights is refused by name before the process group (every rank
    raised from_pretrained's OSError once the group was up)."""
    if not any((Path(path) / name).is_file() for name in WEIGHT_FILES):
        raise SystemExit(f"--checkpoint {path}: a config but no weights (none of {', '.join(WEIGHT_FILES)}); save the "
                         "model with save_pretrained, or train from a config with --arch")


def build_model(args, device):
    """(model with fp32 weights, sharded_init): on ``device``, or on the meta device for a sharded init."""
    from transformers import AutoModelForCausalLM

    if args.checkpoint:
        model_type = checkpoint_config(args.checkpoint, args).model_type
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, local_files_only=True, dtype=torch.float32,
                                                     attn_implementation=own_attention(model_type))
        return model.to(device), False
    config = hf_config(args)
    check_vocab(config.get_text_config().vocab_size, args, f"--model {args.model}'s")
    sharded = args.init == "sharded" or args.init == "auto" and count_parameters(config) > SHARDED_INIT_ABOVE
    torch.manual_seed(args.seed)
    with torch.device("meta" if sharded else device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=own_attention(config.model_type),
                                                 dtype=torch.float32)
    return model, sharded


@torch.no_grad()
def init_shards(model, seed: int, rank: int, device):
    """After ``to_empty``: normal(0, initializer_range) matrices, zero biases and ones for the other 1-D weights
    (GPT-OSS's sinks), each rank its own shard; then the model's own init (transformers' ``_init_weights``) for
    the rest: the norms' identity (ones, or zeros for Gemma's ``x * (1 + weight)``) and the buffers lost on the
    meta device (rotary frequencies, Gemma's embedding scale).  The parameters set here carry transformers'
    ``_is_hf_initialized`` flag, which its init functions skip."""
    std = getattr(model.config, "initializer_range", 0.02)
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__ for p in m.parameters(recurse=False)}
    ours = []
    for name, p in model.named_parameters():
        if id(p) in norms:  # the model's own init: its norms' identity
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        if name.endswith("bias"):
            local.zero_()
        elif p.dim() == 1:
            local.fill_(1.0)
        else:
            local.normal_(0.0, std, generator=gen)
        ours.append(p)
    for p in ours:
        p._is_hf_initialized = True
    try:
        for module in model.modules():
            model._init_weights(module)
    finally:
        for p in ours:
            del p._is_hf_initialized


def active_expert_params(model) -> float:
    """Expert matmul parameters one token runs (MoE layers whose experts are 3-D parameter banks, not nn.Linear:
    top-k of E experts), for the FLOP count."""
    total = 0.0
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if experts and type(module).__name__.endswith("Experts"):
            k = model.config.num_experts_per_tok
            bank = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 3)
            total += bank * k / experts
    return total


def tile_mlps(model, tokens: int):
    """Runs every decoder layer's MLP over ``tokens`` tokens at a time, each tile under checkpointing: the MLP's
    intermediates (the widest activations) exist for one tile at a time.  Same result, more recompute."""
    from fa4dist.integrations.hf import decoder_of

    decoder = decoder_of(model)
    for layer in decoder.layers:
        mlp = layer.mlp
        mlp.forward = functools.partial(_tiled_mlp_forward, type(mlp).forward.__get__(mlp), tokens)


def _tiled_mlp_forward(forward, tokens: int, x: torch.Tensor) -> torch.Tensor:
    if x.shape[-2] <= tokens:
        return forward(x)
    parts = [checkpoint(forward, part, use_reentrant=False) if torch.is_grad_enabled() else forward(part)
             for part in x.split(tokens, dim=-2)]
    return torch.cat(parts, dim=-2)


def enable_activation_checkpointing(model, offload: bool, device: torch.device):
    """transformers' per-layer checkpointing (``activation_checkpointing_enable`` from 5.2x, before it
    ``gradient_checkpointing_enable``); ``offload`` keeps the checkpoints in pinned host memory.  On a CPU device
    the checkpoints are in host memory already: there is nothing to offload, and transformers' offload would pin
    memory, which needs an accelerator, so it is plain checkpointing there."""
    import inspect

    offload = offload and torch.device(device).type != "cpu"

    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        kwargs = dict(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable = model.gradient_checkpointing_enable
        kwargs = dict(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        if "offload" not in inspect.signature(enable).parameters:
            raise SystemExit("--offload-checkpoints needs a transformers whose checkpointing takes offload=")
        kwargs["offload"] = True
    enable(**kwargs)


class LogitsLoss(nn.Module):
    """The loss share from the model's own logits (``--loss logits``)."""

    def __init__(self, model, handle):
        super().__init__()
        self.model, self.handle = model, handle

    def forward(self, local):
        inputs = {k: v for k, v in local.items() if k != "shift_labels"}
        return self.handle.loss(self.model(**inputs).logits, local)


def prepare(args, layout, device, dtype):
    """The model under CP and FSDP2: (loss module (the FSDP root), handle, model, facts for the FLOP count)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fa4dist.integrations.hf import decoder_of, enable_context_parallel
    from fa4dist.integrations.hf_loss import TiledCausalLMLoss

    model, sharded = build_model(args, device)
    cfg = model.config
    facts = dict(
        params=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        matmul_params=sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        + active_expert_params(model),
        layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        hidden=cfg.hidden_size, ffn=cfg.intermediate_size, vocab=cfg.vocab_size, kv_heads=cfg.num_key_value_heads,
        layer_masks=layer_masks(cfg),
    )
    handle = enable_context_parallel(model, mesh=layout.mesh["cp"], strategy=args.strategy, balancer=args.balancer,
                                     backend=args.backend, deterministic=args.deterministic or None,
                                     cp_invariant=True if args.cp_invariant else None)
    if args.activation_checkpointing:  # (--offload-checkpoints sets it)
        enable_activation_checkpointing(model, args.offload_checkpoints, device)
    if args.tile_mlp:
        tile_mlps(model, args.tile_mlp)
    model.train()
    if args.loss == "tiled":
        step = TiledCausalLMLoss(model, handle, chunk_tokens=args.loss_chunk)
    else:
        step = LogitsLoss(model, handle)
    mesh = layout.mesh
    fsdp_mesh = mesh._flatten("dp_cp") if mesh.ndim > 1 else mesh
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_of(model).layers:
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(step, mesh=fsdp_mesh, mp_policy=mp)
    if sharded:
        step.to_empty(device=device)
        init_shards(model, args.seed, layout.rank, device)
    return step, handle, model, facts


# ---------------------------------------------------------------------------------------------------------------
# data and the step


def hf_batch(sample) -> dict:
    """A packed window as transformers' DataCollatorWithFlattening makes it (one row of documents, positions
    restarting per document, labels -100 at each document's first token), with the window's own targets as
    ``shift_labels`` (already shifted, as transformers' losses take them): the last token's target is the next
    window's first token, which the unshifted labels cannot hold (a target lost per window, as the other recipes
    train on it)."""
    from transformers import DataCollatorWithFlattening

    cu = sample.cu_seqlens.tolist()
    tokens = sample.tokens.tolist()
    batch = DataCollatorWithFlattening()([{"input_ids": tokens[a:b]} for a, b in zip(cu, cu[1:])])
    batch["shift_labels"] = sample.labels[None].clone()
    return batch


def to_device(local: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in local.items()}


def layer_masks(config) -> list[tuple]:
    """Each layer's (window, chunk) in tokens (None: none), for the FLOP count: sliding layers see their window,
    Llama 4's chunked layers their chunk, full layers every earlier token of their document."""
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * (
        config.num_hidden_layers)
    return [(window if kind == "sliding_attention" else None, chunk if kind == "chunked_attention" else None)
            for kind in kinds]


def training_flops(facts: dict, cu_seqlens_list) -> float:
    """6·N·T + 12·H·D·(P summed over layers, each under its mask) (the recipes' MFU formula, common.FLOP_FORMULA:
    fa4dist.models.causal_training_flops)."""
    return causal_training_flops(facts["matmul_params"], facts["layers"], facts["heads"], facts["head_dim"],
                                 cu_seqlens_list, layer_masks=facts["layer_masks"])


def forward_backward(step, handle, samples, layout, device, phases: Optional[dict] = None):
    """This rank's sequences of one step; returns the summed sequence losses of this dp replica (over cp)."""
    n = len(samples)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, sample in enumerate(samples):
        local = to_device(handle.shard_batch(hf_batch(sample)), device)
        if n > 1:
            step.set_requires_gradient_sync(i == n - 1)
        loss = step(local)
        if phases is not None and i == 0:
            phases.update(after_forward=_mem(device), peak_forward=_peak(device))
        (loss * layout.cp / n).backward()  # FSDP averages over dp x cp: the cp shares must add
        loss_sum += loss.detach().double()
    if layout.cp > 1:
        dist.all_reduce(loss_sum, group=layout.cp_group)
    return loss_sum


def _mem(device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _peak(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def preallocate_adam_state(optimizer):
    """AdamW's state as its first step would create it, so the first step's peak memory is the steady state's."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def memory_estimates(facts: dict, local_tokens: int, world: int, args, dtype) -> dict:
    """GiB per rank of the main components (analytical, beside the measured phases): fp32 weights, gradients and
    Adam states sharded over the world; the layer-boundary checkpoints; the activations one layer's recompute
    holds in the forward (its backward adds about as much again in gradients); the loss tile (bf16 logits, their
    fp32 copy and gradient); the attention's own buffers (q, k, v copies, fp32 output and LSE)."""
    gib = 2**30
    act = torch.finfo(dtype).bits // 8
    params = facts["params"]
    hd, h, kv, ffn = facts["head_dim"], facts["heads"], facts["kv_heads"], facts["ffn"]
    chunk = min(local_tokens, args.loss_chunk or max(256, (1 << 29) // facts["vocab"]))
    mlp_tokens = min(local_tokens, args.tile_mlp) if args.tile_mlp else local_tokens
    return dict(
        weights_fp32=params * 4 / world / gib, grads_fp32=params * 4 / world / gib,
        adam_states_fp32=2 * params * 4 / world / gib,
        checkpoints=facts["layers"] * local_tokens * facts["hidden"] * act / gib
        if args.activation_checkpointing and not args.offload_checkpoints else None,  # (offloaded: host memory)
        layer_recompute_forward=(local_tokens * (6 * facts["hidden"] + (h + 2 * kv) * hd) * act
                                 + mlp_tokens * 4 * ffn * act) / gib,
        logits_tile=chunk * facts["vocab"] * (act + 4 + 4) / gib if args.loss == "tiled"
        else local_tokens * facts["vocab"] * (act + 4 + 4) / gib,
        attention_buffers=local_tokens * ((h + 2 * kv) * hd * act * 2 + h * hd * 4 + h * 4) / gib,
    )


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    common.require("transformers", "hf", "recipes/hf_sft.py")
    # refused before the process group and the model exist (every rank alike)
    common.check_layout(common.launched_world(), args.cp, args.batch_size)
    if args.checkpoint:
        config = checkpoint_config(args.checkpoint, args)
        text = config.get_text_config()
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads  # (None or absent: as many as the queries)
        problem = heads and common.ulysses_heads_problem(args, heads, kv_heads, f"--checkpoint {args.checkpoint}")
        if problem:
            raise SystemExit(problem)
        if args.loss == "tiled":  # (TiledCausalLMLoss refused it once the group was up and the model loaded)
            from fa4dist.integrations.hf_loss import tiled_loss_problem

            problem = tiled_loss_problem(config)
            if problem:
                raise SystemExit(f"--loss tiled (the default) with --checkpoint {args.checkpoint}: {problem}; pass "
                                 "--loss logits")
        check_checkpoint_weights(args.checkpoint)
    rank, world, device = common.init_distributed(args=args)
    common.set_determinism(args)
    layout = common.make_layout(rank, world, args.cp, args.batch_size, device)
    dtype = common.compute_dtype(args, device)
    step, handle, model, facts = prepare(args, layout, device, dtype)
    arch = model.config.model_type if args.checkpoint else args.arch  # --arch does not apply to a checkpoint
    optimizer = common.make_optimizer(step, args)
    if args.memory_report:
        preallocate_adam_state(optimizer)
    stream = common.build_stream(args, data_tokenizer(args))
    per_rank = layout.sequences_per_rank
    if rank == 0:
        print(f"hf_sft: world={world} dp={layout.dp} cp={layout.cp} arch={arch} model="
              f"{args.checkpoint or args.model} params={facts['params'] / 1e6:.1f}M seqlen={args.seqlen} "
              f"batch={args.batch_size} dtype={dtype} packing={args.packing} loss={args.loss} device={device} "
              f"attention={handle.name} (cp_size={handle.cp_size})", flush=True)
        if args.cp_invariant:
            print(common.cp_invariant_scope(
                "the attention's outputs and gradients",
                "the transformers model's matrix products over each rank's rows and FSDP2's gradient reduce-scatter"),
                flush=True)
    progress = common.Progress(args.steps, rank, args.metrics_out, args.log_every)
    meter = common.Throughput.for_run(args, device, 0, args.steps)
    peak = common.peak_flops(args, device)
    phases: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        phases["static"] = _mem(device)

    for i in range(args.steps):
        lr = common.set_lr(optimizer, i, args)
        samples = stream.batch(i, args.batch_size, first=layout.dp_rank * per_rank, count=per_rank)
        common.sync(device)
        t0 = common.now()
        loss_sum = forward_backward(step, handle, samples, layout, device, phases if i == 0 else None)
        grad_norm = common.clip_and_step(step.parameters(), optimizer, args)
        loss = common.step_loss(loss_sum, layout)
        common.sync(device)
        seconds = common.now() - t0
        if i == 0:
            phases["peak_step"] = _peak(device)
        tokens = args.batch_size * args.seqlen
        meter.add(i, seconds, tokens, training_flops(facts, [s.cu_seqlens for s in
                                                             stream.batch(i, args.batch_size)]))
        progress.update(i, loss=loss, lr=lr,
                        grad_norm=float(grad_norm) if grad_norm is not None else None,
                        tokens_per_s=tokens / seconds, step_s=seconds, peak_mem_gib=common.peak_memory_gib(device))
    progress.close()

    mem = common.max_peak_memory_gib(device)
    if rank == 0:
        print(common.summary_line(
            recipe="hf_sft", arch=arch, model=args.checkpoint or args.model, params=facts["params"],
            world=world, dp=layout.dp, cp=layout.cp, seqlen=args.seqlen, batch_size=args.batch_size,
            packing=args.packing, dtype=str(dtype).split(".")[-1], loss=args.loss, tile_mlp=args.tile_mlp,
            activation_checkpointing=args.activation_checkpointing, offload_checkpoints=args.offload_checkpoints,
            **meter.summary(peak, world), peak_mem_gib=mem, flop_formula=common.FLOP_FORMULA,
            attention_backend=args.backend, cp_invariant=args.cp_invariant,
        ), flush=True)
        if args.memory_report:
            local = -(-args.seqlen // layout.cp)
            print("MEMORY " + json.dumps(dict(
                measured_gib={k: round(v, 3) for k, v in phases.items()}, local_tokens=local,
                estimated_gib={k: (round(v, 3) if v is not None else None)
                               for k, v in memory_estimates(facts, local, world, args, dtype).items()},
            ), sort_keys=True), flush=True)
    handle.disable()
    common.finish_distributed()


# ---------------------------------------------------------------------------------------------------------------
# the single-process reference


def per_document_loss(model, sample) -> torch.Tensor:
    """The packed sample's mean next-token loss over its own targets (``sample.labels``: the next token within a
    document, the next window's first token for the last one) computed one document at a time (each a batch of its
    own, positions from 0), the cross entropy of the model's fp32 logits as its own loss takes it: what the packed
    call means, without trusting the model's packed-sequence masks (transformers 5.24's eager GPT-OSS
    sliding-window layers let a document's first tokens see the previous document in a packed row: a document run
    alone and the same document packed differ by ~4e-2 there).  A window without targets gives 0, as the cp loss
    does.  A model that scales its queries by their token's index in the row (Llama 4's temperature-tuned NoPE
    layers, from floor_scale tokens on) computes something else for a document alone (from index 0) than packed:
    it runs the packed row (positions restarting per document, no cache: transformers' packed-sequence mask), as
    the recipe's run computes it."""
    from fa4dist.data.packing import IGNORE
    from fa4dist.integrations.hf_context_parallel import temperature_tuned

    cu = sample.cu_seqlens.tolist()
    labels = sample.labels
    count = int((labels != IGNORE).sum())
    if temperature_tuned(model) or not count:
        # (no target: 0 with zero gradients through the graph, as the cp loss gives (cp_cross_entropy says why),
        # not a NaN mean over no labels)
        batch = hf_batch(sample)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        return _target_loss(logits, labels) / max(count, 1)
    total = None
    for a, b in zip(cu, cu[1:]):
        if not bool((labels[a:b] != IGNORE).any()):
            continue
        ids = sample.tokens[a:b].unsqueeze(0)
        logits = model(input_ids=ids, position_ids=torch.arange(b - a).unsqueeze(0), use_cache=False).logits[0]
        term = _target_loss(logits, labels[a:b])
        total = term if total is None else total + term
    return total / count


def _target_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of (tokens, vocab) logits in fp32 against shifted targets (IGNORE: none)."""
    from fa4dist.data.packing import IGNORE

    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def reference_run(args, device=torch.device("cpu")) -> dict:
    """``{"loss": [...], "grad_norm": [...]}`` of common.reference_loop over the same data with the model's own
    attention (``own_attention``: sdpa, or eager for Gemma and GPT-OSS) and the cross entropy of its logits against
    the windows' own targets, one document at a time (the packed row for Llama 4: :func:`per_document_loss`).  What
    the distributed recipe must reproduce."""
    common.set_determinism(args)
    model, sharded = build_model(args, device)
    if sharded:
        raise SystemExit("the reference needs --init full")
    model.train()
    return common.reference_loop(model, lambda sample: per_document_loss(model, sample), args, data_tokenizer(args))


if __name__ == "__main__":
    common.run_main(main)
