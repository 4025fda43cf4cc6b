"""The context-parallel next-token loss of a Hugging Face causal LM computed from hidden states in tiles.

The logits of a long shard do not fit: 64k tokens x a 128k vocabulary are 32 GB in fp32, more than the rest of
the step.  :func:`tiled_cp_cross_entropy` runs the LM head and the cross entropy over ``chunk_tokens`` tokens at a
time, each tile under activation checkpointing, so one tile's logits (and in the backward their gradient) are all
that ever exist; the value and the gradients are those of :func:`fa4dist.models.cp_cross_entropy` on the full
logits (the rank's summed token losses over the global count of target tokens).

:class:`TiledCausalLMLoss` wraps a model whose logits are ``lm_head(final hidden states)`` (Llama, Mistral,
Qwen2/Qwen3, GPT-OSS without its router aux loss), soft-capped where the config says so (Gemma 2/3:
``c * tanh(logits / c)`` with ``final_logit_softcapping``): ``forward(local)`` returns the rank's loss share.  Its
own parameters are the model's, so FSDP2's root unit (``fully_shard(wrapper)``) keeps the LM head gathered while
the tiles run.

```python
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

from fa4dist.integrations.hf import enable_context_parallel
from fa4dist.integrations.hf_loss import TiledCausalLMLoss

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(config)
handle = enable_context_parallel(model)
step = TiledCausalLMLoss(model, handle, chunk_tokens=16)
local = handle.shard_batch(DataCollatorWithFlattening()([{"input_ids": list(range(1, 50))}]))
step(local).backward()
handle.disable()
```
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fa4dist.context_parallel.comm import post_refusal
from fa4dist.data.packing import IGNORE
from fa4dist.kernels.problem import check_int, check_softcap
from fa4dist.models.loss import label_counts

from .hf import decoder_of
from .hf_context_parallel import LABELS_KEY, ContextParallelHandle, local_labels

# Models whose logits are exactly lm_head(final hidden states) (no soft-capping or logit scale) ...
PLAIN_LM_HEAD_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gpt_oss", "llama4_text")
# ... and those whose logits are that, soft-capped by config.final_logit_softcapping when it is set.
CAPPED_LM_HEAD_MODELS = ("gemma2", "gemma3_text")
LOGITS_BUDGET_ELEMENTS = 1 << 29  # default tile: this many logits (2 GiB in fp32)


def default_chunk_tokens(vocab_size: int) -> int:
    return max(256, LOGITS_BUDGET_ELEMENTS // max(1, vocab_size))


def _check_head(hidden: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """The LM head's operands as the tiles' product takes them (checked with the arguments, on every rank: in the
    first tile a rank's error came after the label counts' exchange, the other ranks going on without it)."""
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must have a floating-point dtype, got {hidden.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name} must have the dtype of hidden, {hidden.dtype}, got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden on {hidden.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},): one per vocabulary entry, got "
                         f"{tuple(bias.shape)}")


def _tile_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   labels: torch.Tensor, logit_softcap: Optional[float] = None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if logits.dtype in (torch.float16, torch.bfloat16):  # as cp_cross_entropy: the softmax in fp32 (fp64 stays)
        logits = logits.float()
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


def tiled_cp_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cp_group=None, *,
                           bias: Optional[torch.Tensor] = None, chunk_tokens: Optional[int] = None,
                           logit_softcap: Optional[float] = None, timeout: float = 300.0) -> torch.Tensor:
    """This rank's share of the mean next-token loss: ``sum_i CE(hidden[i] @ weight.T + bias, labels[i])`` over
    the local tokens, divided by the number of target tokens (labels != -100) of all ranks in ``cp_group`` (at
    least 1: a sequence without targets gives 0 with zero gradients, not torch's NaN, at every cp size, as
    :func:`fa4dist.models.cp_cross_entropy` does and says why).
    ``logit_softcap`` c: the logits are ``c * tanh(logits / c)`` first (Gemma 2's final soft-capping).

    ``hidden`` (tokens, dim) or (1, tokens, dim); ``labels`` (tokens,) already shifted, integer ids.  Tiles of
    ``chunk_tokens`` tokens (default: 2**29 logits per tile) are recomputed in the backward.  Every rank of
    ``cp_group`` must call it alike: checked as :func:`fa4dist.models.cp_cross_entropy` checks, in the one exchange
    of the label counts (:func:`fa4dist.models.loss.label_counts`), which waits at most ``timeout`` seconds for the
    other ranks."""
    return tiled_cp_cross_entropy_of(lambda: (hidden, weight, labels), cp_group, bias=bias, chunk_tokens=chunk_tokens,
                                     logit_softcap=logit_softcap, timeout=timeout)


def tiled_cp_cross_entropy_of(operands: Callable[[], tuple], cp_group=None, *, bias: Optional[torch.Tensor] = None,
                              chunk_tokens: Optional[int] = None, logit_softcap: Optional[float] = None,
                              timeout: float = 300.0) -> torch.Tensor:
    """:func:`tiled_cp_cross_entropy` of the ``(hidden, weight, labels)`` that ``operands()`` returns.  It is called
    inside the check of the arguments that every rank joins, so a caller's own checks of what it makes them from
    (:class:`TiledCausalLMLoss`'s) raise on every rank alike too, instead of leaving the others waiting."""
    got = {}

    def inputs():
        hidden, weight, labels = operands()
        for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"weight must be (vocab, dim) for hidden states (..., dim), got weight "
                             f"{tuple(weight.shape)} and hidden {tuple(hidden.shape)}")
        _check_head(hidden, weight, bias)
        # (any shape of the right element count was flattened: a (tokens, 1) or (2, tokens / 2) mix-up went through)
        if not (hidden.dim() == 2 or (hidden.dim() == 3 and hidden.shape[0] == 1)):
            raise ValueError(f"hidden must be (tokens, dim) or (1, tokens, dim), got {tuple(hidden.shape)}")
        if not (labels.dim() == 1 or (labels.dim() == 2 and labels.shape[0] == 1)):
            raise ValueError(f"labels must be (tokens,) or (1, tokens), got {tuple(labels.shape)}")
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1)
        if hidden.shape[0] != labels.shape[0]:
            raise ValueError(f"hidden holds {hidden.shape[0]} tokens but labels {labels.shape[0]}")
        if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
            raise TypeError(f"labels must have an integer dtype (token ids, {IGNORE} for no target), got "
                            f"{labels.dtype}")
        if labels.device != hidden.device:
            raise ValueError(f"labels are on {labels.device} but hidden on {hidden.device}")
        chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else check_int("chunk_tokens",
                                                                                              chunk_tokens, 1)
        # (an infinite cap made every logit inf * tanh(0) = NaN, silently; True capped them at 1)
        cap = check_softcap(logit_softcap, hidden.dtype, name="logit_softcap")
        got.update(hidden=hidden, weight=weight, labels=labels, chunk=chunk, cap=cap)
        return labels, weight.shape[0], dict(vocab=int(weight.shape[0]), dtype=str(hidden.dtype),
                                             device=hidden.device.type, softcap=cap,
                                             grad=bool(torch.is_grad_enabled() and hidden.requires_grad))

    _, count = label_counts("tiled_cp_cross_entropy", cp_group, inputs, timeout)
    hidden, weight, labels, chunk, cap = got["hidden"], got["weight"], got["labels"].long(), got["chunk"], got["cap"]
    total = hidden.new_zeros((), dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64)
    # at least one tile: a shard without tokens gets its 0 through the graph (as cp_cross_entropy's), not a constant
    # whose backward raised on that rank alone
    for start in range(0, max(hidden.shape[0], 1), chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        if torch.is_grad_enabled():
            part = checkpoint(_tile_loss_sum, h, weight, bias, y, cap, use_reentrant=False)
        else:
            part = _tile_loss_sum(h, weight, bias, y, cap)
        total = total + part.to(total.dtype)
    return total / torch.tensor(count, dtype=total.dtype, device=total.device).clamp(min=1.0)


def tiled_loss_problem(config) -> Optional[str]:
    """Why :class:`TiledCausalLMLoss` cannot compute the loss of a model with this transformers ``config`` (the
    model's own ``config``, as ``from_pretrained`` / ``AutoConfig`` give it), or None.  It only needs the config, so
    a recipe can ask before it builds the model."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_LM_HEAD_MODELS + CAPPED_LM_HEAD_MODELS:
        return (f"TiledCausalLMLoss computes logits as lm_head(hidden states) (soft-capped for "
                f"{CAPPED_LM_HEAD_MODELS}), which is known to be the model's own computation for "
                f"{PLAIN_LM_HEAD_MODELS + CAPPED_LM_HEAD_MODELS}, not {model_type!r}")
    if getattr(config, "output_router_logits", False):
        return ("the model adds a router aux loss (config.output_router_logits); TiledCausalLMLoss computes the "
                "next-token loss only")
    return None


class TiledCausalLMLoss(nn.Module):
    """``forward(local)`` -> this rank's loss share of a local batch from ``handle.shard_batch``, with the LM head
    and cross entropy in tiles (:func:`tiled_cp_cross_entropy`); the full logits never exist."""

    def __init__(self, model: nn.Module, handle: ContextParallelHandle, chunk_tokens: Optional[int] = None):
        super().__init__()
        problem = tiled_loss_problem(model.config)
        if problem:
            raise ValueError(f"{problem}; use handle.loss(model(**local).logits, local)")
        model_type = model.config.model_type
        self.logit_softcap = None
        if model_type in CAPPED_LM_HEAD_MODELS:
            self.logit_softcap = getattr(model.config, "final_logit_softcapping", None)
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"the model's output embedding must be an nn.Linear, got {type(head).__name__}")
        self.model, self.handle = model, handle
        self.chunk_tokens = (default_chunk_tokens(head.out_features) if chunk_tokens is None
                             else check_int("chunk_tokens", chunk_tokens, 1))

    def forward(self, local: dict) -> torch.Tensor:
        """The rank's loss share.  The labels are checked inside the loss's exchange (its timeout: the handle's), so
        a rank whose batch has none makes every cp rank raise, the others naming it; a rank whose batch has no plan
        fails in its first attention call, whose agreement check makes the others fail with it."""
        try:
            self.handle._check_enabled("TiledCausalLMLoss")
        except RuntimeError as err:  # (before the forward: a rank alone here leaves the others to their timeout)
            post_refusal(f"RuntimeError: {err}")
            raise
        inputs = {k: v for k, v in local.items() if k != LABELS_KEY}
        hidden = decoder_of(self.model)(**inputs).last_hidden_state
        head = self.model.get_output_embeddings()
        group = self.handle.loss_group if self.handle.cp_size > 1 else None
        return tiled_cp_cross_entropy_of(lambda: (hidden, head.weight, local_labels(local)), group, bias=head.bias,
                                         chunk_tokens=self.chunk_tokens, logit_softcap=self.logit_softcap,
                                         timeout=self.handle.timeout)
