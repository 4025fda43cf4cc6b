"""Context parallelism for Hugging Face causal LMs: ``enable_context_parallel(model, ...)``.

```python
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

from fa4dist.integrations.hf import enable_context_parallel

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(config)
batch = DataCollatorWithFlattening()([{"input_ids": list(range(1, 40))}, {"input_ids": list(range(5, 30))}])
with enable_context_parallel(model) as handle:  # group=None: the whole world, or one process without torch.distributed
    local = handle.shard_batch(batch)             # this rank's tokens, positions and shifted labels
    out = model(**local)                          # every attention layer runs FA4ContextParallelAttention
    loss = handle.loss(out.logits, local)         # this rank's share: the shares add up to the global mean loss
    loss.backward()
```

How it works:

- The handle registers an attention function (and a mask function) with transformers under a name of its own
  and switches the model to it (``model.set_attn_implementation``); ``disable()`` (or leaving the ``with``) puts
  back the model's previous attention (a hook left on the decoder refuses a sharded batch from then on: the
  model's own attention would attend within the shard).  The switch is on the config object, so a second model
  built on the same config (``Model(model.config)``) is switched too: a sharded batch runs through the handle, an
  unsharded one is refused naming the shared config (build each model from its own ``copy.deepcopy(config)``).
- ``shard_batch`` takes what ``DataCollatorWithFlattening`` makes (``input_ids``, ``labels``, ``position_ids`` of
  shape (1, T); documents start where ``position_ids`` do not continue the one before by one, a gap included:
  transformers' own rule, and the single-process attention's, :func:`fa4dist.integrations.hf.document_starts`; or at
  ``cu_seq_lens_q`` when the collator gives them, which must then agree with the positions), builds the LPT plan
  of the documents (:func:`fa4dist.context_parallel.make_plan`) and returns this rank's ``input_ids`` and
  ``position_ids`` (the global positions, for RoPE), ``shift_labels`` (the labels shifted by one token *before*
  sharding, so no target is lost at a shard edge; a batch's own ``shift_labels``, already shifted, are taken as they
  are, as transformers' losses take them: they can hold the last token's target, the next window's first token),
  ``use_cache=False`` and the plan (under :data:`PLAN_KEY`), which
  transformers hands to every attention call.  The cp ranks must hold the same batch; a checksum exchange makes a
  disagreement an error.
- The attention function runs :class:`fa4dist.modules.FA4ContextParallelAttention` on the local query, key and
  value (GQA kept), with the layer's softmax scale, sliding window (Mistral, Gemma 2/3, GPT-OSS: on global
  positions within each document, so windows cross shard edges) and logit soft-capping (Gemma 2), one module per
  distinct (scale, window, softcap); learned per-head attention sinks (GPT-OSS's ``s_aux``) go with each call, and
  each rank's sinks gradient is its rows' share (summed over the cp ranks it is the whole gradient, as a dp x cp
  gradient reduction does; with ``cp_invariant`` one rank per head holds the whole gradient, the others zeros).
  Chunked attention (Llama 4's ``attention_chunk_size``) runs on a second plan with the same shards, whose
  documents are also cut where transformers starts a chunk (:func:`chunk_starts`; ``ShardPlan.split_documents``,
  under :data:`CHUNK_PLAN_KEY`), so most of its ring steps are skipped; Llama 4's temperature tuning of its NoPE
  layers' queries (a scale from each token's index in the row) is applied here, from the token's index in the
  whole row, which the model itself would take from its index in the shard.
  What it cannot compute exactly is refused with :class:`UnsupportedMask` naming it: bidirectional
  attention, per-token sinks, attention dropout in training, padding masks, KV caches (a
  call with the plan that asks for one: each rank's cache would hold its shard alone), a batch of more than one row.
  The mask transformers builds for the local shard is checked to be causal (with the layer's sliding window) within
  the local runs of positions, what plain causal LM masking gives, so a model that overlays its own mask pattern
  fails instead of being silently wrong.
- ``loss(logits, local)``: :func:`fa4dist.models.cp_cross_entropy` of the local logits and shifted labels: the
  rank's summed token losses over the global count of target tokens.  Gradients summed over the cp ranks are the
  single-process gradients (a wrapper that averages over dp x cp ranks needs the loss multiplied by cp).
  :mod:`fa4dist.integrations.hf_loss` computes the same loss from hidden states in tiles, never holding the logits
  of the whole shard.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from fa4dist.context_parallel import ShardPlan, make_plan
from fa4dist.context_parallel.comm import Transport, exclusive
from fa4dist.data.packing import IGNORE
from fa4dist.kernels.problem import check_bool, check_integer_dtype
from fa4dist.models.llama import check_token_ids
from fa4dist.models.loss import cp_cross_entropy_of
from fa4dist.modules import FA4ContextParallelAttention

from .hf import (NO_WINDOW, UnsupportedMask, attention_sinks, autocast_operands, decoder_of, document_starts,
                 fa4dist_mask, layer_chunk, layer_window, text_config, warn_no_attention_weights, window_of)

PLAN_KEY = "fa4dist_cp_plan"  # the local batch's key holding the ShardPlan (transformers passes it to attention)
CHUNK_PLAN_KEY = "fa4dist_cp_chunk_plan"  # the plan of chunked attention layers (the same shards, finer documents)
LABELS_KEY = "shift_labels"  # transformers' own name for labels that are already shifted
CACHE_KEY = "fa4dist_cp_cache"  # set by the handle's model hook when a forward with a plan asks for a KV cache
NO_POSITIONS_KEY = "fa4dist_cp_no_positions"  # set by the same hook when such a forward got no position_ids
_HANDLES: dict[str, "ContextParallelHandle"] = {}
_PREVIOUS: dict[str, Optional[str]] = {}  # each handle's name -> the attention it replaced (kept after disable)
# why a model's layers can reach a handle that is not theirs: transformers picks the attention by the config
_NOT_THIS_MODEL = ("transformers picks attention through the model's config, and this model shares that config object "
                   "with the enabled model (or was copied from it while enabled), so it was switched too; give each "
                   "model its own config (build it from copy.deepcopy(config)) and enable context parallelism on "
                   "the model that should run it (a batch from handle.shard_batch does run through the handle)")
_NAMES = itertools.count()
# a model's attention name, used again when it is enabled again: transformers keeps every registration, and the
# names stay registered after disable() (a copy made while enabled then gets this module's error, not transformers'),
# so a new name per enable grew its registries by two entries a cycle
_MODEL_NAMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CHECKSUM_SEED = 0x9E3779B1


# ---------------------------------------------------------------------------------------------------------------
# what a model asks of its attention


def _plan_window(config) -> tuple[int, int]:
    """The window the plan's cost model assumes: the model's, when every layer has it (Mistral, or ``layer_types``
    all ``sliding_attention``); else none (a plan costed for causal attention balances the global layers, and any
    plan is exact for every layer)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and set(layer_types) != {"sliding_attention"}):
        return NO_WINDOW
    return window_of(window)


def _plan_heads(config) -> Optional[tuple[int, int]]:
    """(query heads, key/value heads) of the model's attention, for the Ulysses degree ``strategy="auto"`` runs and
    the plan balances for; None where the config does not say (the plan is then balanced for a ring: exact all the
    same, a hybrid's ring part less balanced).  Tensor parallelism over heads makes the calls' counts smaller: auto
    then runs the plan's degree only if those counts allow it, as for any plan."""
    hq = getattr(config, "num_attention_heads", None)
    hkv = getattr(config, "num_key_value_heads", None) or hq
    if isinstance(hq, int) and isinstance(hkv, int) and hq > 0 and hkv > 0 and hq % hkv == 0:
        return hq, hkv
    return None


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def chunk_starts(position_ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Where the chunked attention of a packed row of ``position_ids`` (T,) starts a chunk, as transformers computes
    it in one process (``masking_utils.chunked_overlay``, without a cache or padding): on the positions when the row
    holds several documents (it remaps its indices to ``position_ids`` for packed sequences: a chunk starts where a
    position is a multiple of ``chunk``), else on the row's token index (every ``chunk`` tokens).  Document starts
    are not included (the plan has them)."""
    pos = position_ids.reshape(-1).long()
    if bool(document_starts(pos)[1:].any()):
        return torch.nonzero(pos % chunk == 0).flatten()
    return torch.arange(0, pos.numel(), chunk)


def temperature_tuned(model) -> list:
    """Llama 4's NoPE attention modules that scale their queries by a function of each token's index in the row
    (``attn_temperature_tuning``): under context parallelism that index is the token's in the shard, so the handle
    turns it off there and applies the scale itself (:func:`_tune_temperature`)."""
    return [m for m in model.modules()
            if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)
            and hasattr(m, "floor_scale") and hasattr(m, "attn_scale")]  # (use_rope is the config's 0 or 1)


def _global_temperature(module) -> bool:
    """Whether this call applies Llama 4's temperature tuning itself (a NoPE layer of a model whose config tunes):
    the handle turned the module's own off.  A module that still tunes (a copy of the model made before
    enable_context_parallel, or its flag set back) has scaled its queries by their index in the shard: refused."""
    config = getattr(module, "config", None)
    if getattr(module, "use_rope", True) or not getattr(config, "attn_temperature_tuning", False) or not hasattr(
            module, "floor_scale"):
        return False
    if module.attn_temperature_tuning:
        raise UnsupportedMask("this Llama 4 NoPE layer tuned its queries' temperature itself, by their index in the "
                              "shard, not in the row (attn_temperature_tuning is on: a copy of the model made "
                              "before enable_context_parallel, or the flag set back); run the model the handle "
                              "was enabled on")
    return True


def _tune_temperature(module, query: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    """Llama 4's query temperature (``Llama4TextAttention``'s own formula and dtypes) from each local token's index
    in the whole packed row, which is what the model computes without context parallelism."""
    index = plan.global_indices(rank, device=query.device)  # (made there: no host-to-device copy per call)
    scales = torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)  # query (1, heads, L, D)


def unsupported_features(model) -> list[str]:
    """What in ``model`` (its config) context-parallel attention cannot compute exactly."""
    config = text_config(model.config)
    problems = []
    if not getattr(model, "_supports_attention_backend", False):
        problems.append(f"{type(model).__name__} does not call transformers' AttentionInterface (it would run its "
                        "own attention on the local shard)")
    if getattr(config, "attention_chunk_size", None) and getattr(config, "sliding_window", None):
        problems.append(f"chunked attention (attention_chunk_size={config.attention_chunk_size}) and a sliding "
                        f"window (sliding_window={config.sliding_window}) in one model (transformers names both in "
                        "local_size)")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        problems.append("bidirectional attention")
    other = sorted({t for t in getattr(config, "layer_types", None) or () if t not in LAYER_TYPES})
    if other:
        problems.append(f"layer types {other} (only {', '.join(LAYER_TYPES)} layers)")
    return problems


def _refuse_unsupported(module, dropout):
    """The per-call checks of what no option of the attention computes."""
    if dropout and module.training:
        raise UnsupportedMask(f"fa4dist context-parallel attention has no attention dropout (got {dropout}); set "
                              "config.attention_dropout = 0")
    if not getattr(module, "is_causal", True):
        raise UnsupportedMask("fa4dist context-parallel attention is causal only; this module is bidirectional")


# ---------------------------------------------------------------------------------------------------------------
# what transformers calls


class CheckedCausalMask:
    """What the handle's mask function returns: transformers' mask was verified to be plain causal masking of the
    local shard, with ``window`` (the kernels' ``(left, right)``) on a sliding-window layer (the plan decides which
    documents each query really sees)."""

    def __init__(self, checked: str, window: tuple[int, int] = NO_WINDOW, chunk: Optional[int] = None,
                 refusal: Optional[Exception] = None):
        self.checked, self.window, self.chunk = checked, window, chunk
        # the mask function's refusal of this rank's call: raised by the attention, inside its agreement check, so
        # that every cp rank raises at once naming it (raised in the mask function, this rank alone failed and
        # the others waited in the attention's first exchange until the timeout)
        self.refusal = refusal

    # Only the handle's attention reads this mask.  Another attention implementation gets it when the config was
    # switched back while a call with it was still to run: most often a gradient-checkpointed layer recomputed by a
    # backward after the handle's `with` block.  Used as a tensor (torch ops, indexing, tensor attributes), it
    # raises saying so, where transformers' own attention would fail on a TypeError naming neither.
    _MISUSED = ("fa4dist's context-parallel mask reached another attention implementation ({what}): the model's "
                "context-parallel attention was switched off (handle.disable(), or the end of its with block) "
                "before a call of the sharded batch ran, e.g. a gradient-checkpointed layer recomputed by a "
                "backward after the with block; run the backward (the whole step) while the handle is enabled")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(cls._MISUSED.format(what=getattr(func, "__name__", str(func))))

    def __getitem__(self, index):
        raise RuntimeError(self._MISUSED.format(what="indexing"))

    def __getattr__(self, name: str):
        if name.startswith("__"):  # (copy, pickle and hasattr probes of protocols)
            raise AttributeError(name)
        raise AttributeError(self._MISUSED.format(what=f"attribute {name!r}"))


def _cp_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, local_size=None, device="cpu", **kwargs) -> CheckedCausalMask:
    chunk = layer_chunk(kwargs.get("config"), local_size)
    try:
        info = _check_local_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                                 local_size, chunk, device, kwargs.get("config"))
    except UnsupportedMask as err:  # (raised by the attention: CheckedCausalMask.refusal)
        return CheckedCausalMask("refused", refusal=err)
    return CheckedCausalMask(info.checked, info.window, chunk)


def _check_local_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                      local_size, chunk, device, config):
    """The local shard's verified mask (hf.FA4MaskInfo).  Raises UnsupportedMask unless transformers asks this
    rank's shard for what the plan computes: one packed row, no cache, no padding, and a predicate that is causal
    (with the layer's window, which transformers names in local_size) within the local runs of positions; the plan
    holds the documents, which the attention call follows.  A chunked layer's (local_size its chunk size) must be
    causal within runs of at most that many tokens: transformers counts the chunks of a shard from the shard's own
    indices or positions, the chunk plan from the whole row's."""
    if batch_size != 1:
        raise UnsupportedMask(f"context parallelism takes one packed row (batch size 1), got batch size {batch_size}")
    if int(q_offset) or int(kv_offset) or q_length != kv_length:
        raise UnsupportedMask("context parallelism does not run with a KV cache (use_cache=False, no past_key_values)")
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        raise UnsupportedMask("context parallelism takes packed documents without padding (no attention_mask zeros)")
    try:
        info = fa4dist_mask(batch_size, q_length, kv_length, 0, 0, mask_function=mask_function, attention_mask=None,
                            local_size=None if chunk else local_size, device=device, config=config)
        longest = max((qe - qs for _, qs, qe, _, _ in info.segments), default=0)
        if chunk and longest > chunk:
            raise UnsupportedMask(f"a chunked layer's mask (chunks of {chunk} tokens) lets a run of {longest} tokens "
                                  "see each other")
    except UnsupportedMask as err:
        raise UnsupportedMask(f"the mask the model asks for on its local shard is not causal masking (with a "
                              f"sliding window, or in chunks); fa4dist context parallelism computes nothing else: "
                              f"{err}") from err
    return info


def _cp_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  scaling: Optional[float] = None, dropout: float = 0.0, sliding_window: Optional[int] = None,
                  softcap: Optional[float] = None, **kwargs):
    """transformers' attention interface entry: query (1, Hq, L, D), key/value (1, Hkv, L, D), L this rank's
    tokens -> (out (1, L, Hq, D), None)."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    handle = _HANDLES.get(name)
    if handle is None:
        raise RuntimeError(f"the context-parallel attention {name!r} was disabled; set the model's attention back "
                           f"(handle.disable() does for the model it was enabled on; a copy made while enabled: "
                           f"model.set_attn_implementation({_PREVIOUS.get(name)!r})) or enable_context_parallel "
                           "again")
    plan = kwargs.get(PLAN_KEY)
    warn_no_attention_weights(kwargs, "fa4dist context-parallel attention")
    window, sinks, refused, tune = NO_WINDOW, None, None, False
    try:  # this call's own checks: a refusal goes through the attention's agreement check (below)
        if not isinstance(plan, ShardPlan) and module not in handle.layers:
            raise ValueError(f"a model context parallelism was not enabled on ran {name!r} on a batch that was not "
                             f"sharded: {_NOT_THIS_MODEL}")
        if not isinstance(plan, ShardPlan):
            raise ValueError(f"context-parallel attention needs the batch from handle.shard_batch(batch) (its "
                             f"{PLAN_KEY!r} entry); call model(**handle.shard_batch(batch))")
        if attention_mask is not None and not isinstance(attention_mask, CheckedCausalMask):
            raise UnsupportedMask(f"context-parallel attention got a precomputed {type(attention_mask).__name__} "
                                  "mask; it computes causal attention within the batch's documents only")
        if attention_mask is not None and attention_mask.refusal is not None:
            raise attention_mask.refusal
        if kwargs.get(NO_POSITIONS_KEY):
            raise ValueError("the model ran a sharded batch without position_ids, so it numbered each rank's tokens "
                             "from 0 instead of by their place in the sequence: pass the position_ids of "
                             "handle.shard_batch(batch) (model(**handle.shard_batch(batch)) does)")
        _refuse_unsupported(module, dropout)
        if kwargs.get(CACHE_KEY):
            raise UnsupportedMask("context parallelism does not run with a KV cache: each rank's cache would hold "
                                  "its shard's keys alone (pass use_cache=False and no past_key_values / cache)")
        if query.shape[0] != 1:
            raise UnsupportedMask(f"context parallelism takes one packed row (batch size 1), got {query.shape[0]}")
        window = layer_window(attention_mask.window if attention_mask is not None else None, sliding_window)
        sinks = attention_sinks(kwargs, query.shape[1])
        tune = _global_temperature(module)
        if attention_mask is not None and attention_mask.chunk:
            plan = kwargs.get(CHUNK_PLAN_KEY)
            if not isinstance(plan, ShardPlan):
                raise ValueError(f"a chunked attention layer needs the batch from handle.shard_batch(batch) (its "
                                 f"{CHUNK_PLAN_KEY!r} entry); call model(**handle.shard_batch(batch))")
    except Exception as err:
        if handle.cp_size == 1:
            raise
        refused = err
    attention = handle.attention(scaling, window, softcap or None)
    if refused is not None:
        # refused inside the attention's agreement check, so that the other cp ranks fail with this one at once
        # (naming it) instead of waiting for it; its own error comes back on this rank
        try:
            attention.cp.refuse(refused)
        except Exception as err:
            if err is refused:
                raise
            raise refused from err
    if tune:
        query = _tune_temperature(module, query, plan, handle.cp_rank)
    query, key, value = autocast_operands(query, key, value)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (L, heads, D)
    out = attention(q, k, v, plan, sinks=sinks)
    return out.unsqueeze(0), None


def _forward_hook(module, args, kwargs):
    """The decoder stack's forward pre-hook: a call with a plan that asks for a KV cache (use_cache=True, or a cache
    passed), or that has no position_ids where the decoder takes them, is marked for the attention to refuse
    (through its agreement check, so every cp rank raises at once); use_cache left out (the config's default, often
    True) becomes False, as no cache of a shard is ever right."""
    if PLAN_KEY not in kwargs:
        return None
    if kwargs.get("position_ids") is None and _takes_positions(type(module)):
        kwargs[NO_POSITIONS_KEY] = True
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if kwargs.get("use_cache") is None and cache is None:
        kwargs["use_cache"] = False
    elif kwargs.get("use_cache") or cache is not None:
        kwargs[CACHE_KEY] = True
    return args, kwargs


def _sharded_batch_guard(module, args, kwargs):
    """The decoder stack's forward pre-hook that outlives the handle (installed once per model): a local batch
    (its plan among the kwargs) run while the model's config names no enabled handle (after
    ``disable()``, say, outside the ``with`` block) is refused; the model's own attention would ignore the plan
    and attend within this rank's shard only, and ``model(**local)`` would return shard-local logits and loss."""
    if PLAN_KEY not in kwargs:
        return None
    if _HANDLES.get(getattr(getattr(module, "config", None), "_attn_implementation", None)) is None:
        raise RuntimeError("this batch was sharded by a context-parallel handle (shard_batch), but the model is not "
                           "running context-parallel attention now (the handle was disabled, e.g. the forward ran "
                           "after its with block): its own attention would attend within this rank's shard only; "
                           "run a sharded batch while the handle is enabled")
    return None


@functools.lru_cache(maxsize=None)
def _takes_positions(module_class) -> bool:
    """Whether a decoder stack's forward takes ``position_ids`` (it then numbers the tokens 0, 1, ... without them)."""
    try:
        return "position_ids" in inspect.signature(module_class.forward).parameters
    except (TypeError, ValueError):
        return False


def _forward_hook_owner(model):
    """The module whose forward every call of ``model`` with a local batch goes through: the decoder stack
    (:func:`~fa4dist.integrations.hf.decoder_of`, also what :class:`~fa4dist.integrations.hf_loss.TiledCausalLMLoss`
    calls), else the base model."""
    try:
        return decoder_of(model)
    except TypeError:
        return getattr(model, "base_model", model)


def _set_attn_implementation(model, name: str):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name


# ---------------------------------------------------------------------------------------------------------------


def _launched_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by it, or when it is not a number)."""
    value = os.environ.get("WORLD_SIZE", "1").strip()
    return int(value) if value.isascii() and value.isdigit() else 1


class ContextParallelHandle:
    """The model's context-parallel state: its attention modules, plans for batches, the loss.  Made by
    :func:`enable_context_parallel`; undo with :meth:`disable` or a ``with`` block."""

    def __init__(self, model, group=None, mesh=None, strategy: str = "auto", balancer: str = "lpt", *,
                 backend: str = "auto", deterministic: Optional[bool] = None, num_chunks: Optional[int] = None,
                 timeout: float = 300.0, check_batch: bool = True, cp_invariant: Optional[bool] = None):
        if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
            raise TypeError("enable_context_parallel takes a transformers model (a torch.nn.Module with a transformers "
                            f"config, e.g. AutoModelForCausalLM.from_config(...)), got {type(model).__name__}; for "
                            "a model of your own use fa4dist.modules.FA4ContextParallelAttention")
        problems = unsupported_features(model)
        if problems:
            raise UnsupportedMask(f"{type(model).__name__} cannot run with fa4dist context parallelism: "
                                  + "; ".join(problems))
        owner = _HANDLES.get(getattr(model.config, "_attn_implementation", None))
        if owner is not None and owner.model is model:
            raise ValueError("context parallelism is already enabled on this model; disable() that handle first")
        if owner is not None:
            raise ValueError(f"context parallelism is enabled on another model ({owner.name!r}), not on this one: "
                             f"{_NOT_THIS_MODEL}")
        if group is not None and mesh is not None:
            raise ValueError("pass either group (a process group) or mesh (a DeviceMesh), not both")
        check_bool("check_batch", check_batch)  # "no" would be truthy
        if group is None and mesh is None:
            if dist.is_available() and dist.is_initialized():
                group = dist.group.WORLD
            elif _launched_world_size() > 1:  # each process would run alone on the whole batch, silently
                raise RuntimeError(
                    f"enable_context_parallel(group=None): this process is one of WORLD_SIZE="
                    f"{_launched_world_size()} (torchrun) but torch.distributed is not initialized, so each process "
                    "would run alone; call torch.distributed.init_process_group() first (the cp group is then the "
                    "whole world), or pass group= or mesh=")
        self.model, self.balancer, self.num_chunks, self.check_batch = model, balancer, num_chunks, check_batch
        self.layers = weakref.WeakSet(model.modules())  # the layers this handle's attention serves
        self._options = dict(group=group, mesh=mesh, strategy=strategy, backend=backend,
                             deterministic=deterministic, timeout=timeout, cp_invariant=cp_invariant)
        self._cores: dict = {}
        self._planner = self.attention(None)  # every core shares the group: one answers cp size, rank, plans
        if strategy == "hybrid" and self.cp_size > 1 and not self._planner.cp.grid:
            # the handle has no ulysses_degree: on one group every call would fail asking for it
            raise ValueError("enable_context_parallel(strategy='hybrid') takes its Ulysses and ring groups from a "
                             "2-D mesh (mesh=, mesh_dim_names=('ring', 'ulysses')); with one process group use "
                             "strategy='auto', 'ring' or 'ulysses'")
        self.plan_window = _plan_window(text_config(model.config))
        self.plan_heads = _plan_heads(text_config(model.config))
        self.chunk = getattr(text_config(model.config), "attention_chunk_size", None) or None
        self.make_plan([0, 1])  # balancer and num_chunks, checked as every batch's plan checks them: before the switch
        self.loss_group = _loss_group(group, mesh)
        self._agree_on_options()
        self.previous = getattr(model.config, "_attn_implementation", None)
        # a copy made while another handle was enabled carries that handle's name: put back what it replaced
        self.previous = _PREVIOUS.get(self.previous, self.previous)
        name = _MODEL_NAMES.get(model)
        if name is None or name in _HANDLES:  # (in use: another handle still enabled under it)
            name = _MODEL_NAMES[model] = f"fa4dist_cp_{next(_NAMES)}"
        self.name = name
        _PREVIOUS[self.name] = self.previous
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(self.name, _cp_attention)
        AttentionMaskInterface.register(self.name, _cp_mask)
        _HANDLES[self.name] = self
        _set_attn_implementation(model, self.name)
        # on the decoder stack, which the task heads call with the batch's kwargs (the plan among them), and which
        # TiledCausalLMLoss calls itself; for Llama 4 it is not the base model (that is the task head itself)
        owner = _forward_hook_owner(model)
        if _sharded_batch_guard not in owner._forward_pre_hooks.values():  # once per model: it stays after disable()
            owner.register_forward_pre_hook(_sharded_batch_guard, with_kwargs=True)
        self._forward_hook = owner.register_forward_pre_hook(_forward_hook, with_kwargs=True)
        self.temperature_tuned = tuple(temperature_tuned(model))  # applied by the attention (global indices)
        self._tuning = [module.attn_temperature_tuning for module in self.temperature_tuned]
        for module in self.temperature_tuned:
            module.attn_temperature_tuning = False
        self.enabled = True

    def _agree_on_options(self) -> None:
        """One exchange over the cp group when the handle is made: every rank must enable context parallelism
        alike (options, the model's class and attention shape). A rank that differs makes every rank raise now,
        naming the fields and ranks, where it would otherwise surface later: a ``check_batch`` that only some ranks
        run, or another layer count, leaves the others waiting until the handle's ``timeout``."""
        if self.cp_size == 1:
            return
        from fa4dist.models.loss import agreed_call

        text = text_config(self.model.config)
        sig = {key: repr(value) for key, value in self._options.items() if key not in ("group", "mesh")}
        sig.update(model=type(self.model).__name__, balancer=repr(self.balancer), num_chunks=repr(self.num_chunks),
                   check_batch=self.check_batch, plan_window=list(self.plan_window), cp_size=self.cp_size,
                   **{key: repr(getattr(text, key, None)) for key in (
                       "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "hidden_size", "sliding_window", "layer_types", "attention_chunk_size")})
        transport = Transport(self.loss_group, self.timeout, "fa4dist enable_context_parallel")
        with agreed_call("enable_context_parallel", self.loss_group, transport, sig, None):
            pass

    # ---- groups -------------------------------------------------------------------------------------------------

    @property
    def cp_size(self) -> int:
        return self._planner.cp_size

    @property
    def timeout(self) -> float:
        """Seconds a cp rank waits for the others in the attention's and the loss's exchanges."""
        return self._options["timeout"]

    @property
    def cp_rank(self) -> int:
        """This process's rank in plans (``ring_index * ulysses_degree + ulysses_index`` on a 2-D mesh)."""
        return self._planner.cp_rank

    def attention(self, scaling: Optional[float], window: tuple[int, int] = NO_WINDOW,
                  softcap: Optional[float] = None) -> FA4ContextParallelAttention:
        """The context-parallel attention module for a softmax scale, a window (the kernels' ``(left, right)``) and
        a softcap: one per combination the model's layers use (every rank's layers ask for the same ones)."""
        key = (None if scaling is None else float(scaling), tuple(window), None if softcap is None else float(softcap))
        core = self._cores.get(key)
        if core is None:
            opts = dict(self._options)
            group, mesh = opts.pop("group"), opts.pop("mesh")
            core = FA4ContextParallelAttention(group, mesh=mesh, causal=True, softmax_scale=key[0], window=key[1],
                                               softcap=key[2], **opts)
            self._cores[key] = core
        return core

    # ---- batches ------------------------------------------------------------------------------------------------

    def document_boundaries(self, batch) -> torch.Tensor:
        """cu_seqlens (int64) of a packed batch: ``cu_seq_lens_q`` if given, else where ``position_ids`` do not
        continue by one (transformers' own rule, as in one process: :func:`~fa4dist.integrations.hf.document_starts`),
        else one document.  Given both, positions that restart must do so
        at the same documents (as the single-process attention requires); positions that run on through the row
        (``torch.arange``) leave the documents to ``cu_seq_lens_q``."""
        ids = batch["input_ids"]
        total = ids.shape[-1]
        def integers(key):  # (a float tensor would be truncated by .long(), silently)
            t = torch.as_tensor(batch[key]).flatten()
            check_integer_dtype(f"batch[{key!r}]", t)
            return t.long().cpu()

        from_positions = None
        if batch.get("position_ids") is not None:
            pos = torch.as_tensor(batch["position_ids"]).reshape(-1).cpu()
            starts = torch.nonzero(document_starts(pos)).flatten()
            from_positions = torch.cat([starts, torch.tensor([total])])
        cu = batch.get("cu_seq_lens_q")
        if cu is not None:
            cu = integers("cu_seq_lens_q")
            if batch.get("cu_seq_lens_k") is not None and not torch.equal(integers("cu_seq_lens_k"), cu):
                raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; a packed batch has one set of documents")
            if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"cu_seq_lens_q must rise from 0 to the {total} tokens, got {cu.tolist()[:8]}...")
            if from_positions is not None and from_positions.numel() > 2 and not torch.equal(from_positions, cu):
                raise ValueError(f"cu_seq_lens_q {cu.tolist()[:8]}... disagrees with the documents of position_ids "
                                 f"(they start where a position does not continue the one before by one: "
                                 f"{from_positions.tolist()[:8]}...); a packed batch has one set of documents")
            return cu
        return from_positions if from_positions is not None else torch.tensor([0, total])

    def make_plan(self, cu_seqlens) -> ShardPlan:
        """The plan for a packed stream of documents (cu_seqlens) over this handle's cp group (costed with the
        model's window when every layer has it, and balanced for the Ulysses degree its head counts give)."""
        core = self._planner
        return make_plan(cu_seqlens, self.cp_size, self.balancer, self.num_chunks, causal=True,
                         window=self.plan_window, ulysses_degree=core.cp.plan_ulysses_degree(self.plan_heads))

    def _check_enabled(self, what: str) -> None:
        """Refuses ``what`` on a disabled handle: the model attends with its own attention again, which ignores a
        local batch's plan, so each rank would attend within its shard only (a loss about 2e-3 off, no error)."""
        if not self.enabled:
            raise RuntimeError(f"{what}: this context-parallel handle was disabled (the model attends with its own "
                               "attention again, within each rank's shard only); run the forward and the loss of a "
                               "sharded batch while the handle is enabled")

    def shard_batch(self, batch) -> dict:
        """This rank's part of a packed batch (``input_ids``, optional ``labels`` and ``position_ids``, (1, T)):
        a dict ``model(**local)`` accepts.  See the module docstring."""
        self._check_enabled("shard_batch")
        checked = self.check_batch and self.cp_size > 1
        try:
            ids, positions, shifted, plan = self._checked_batch(batch)
        except Exception:
            if checked:  # the other ranks wait in the checksum exchange: they learn of it there, then this raises
                self._check_same_batch(None, None, None, rejected=True)
            raise
        if checked:
            self._check_same_batch(ids, positions, shifted)
        rank = self.cp_rank
        local = {"input_ids": plan.shard(ids, seq_dim=1, rank=rank),
                 "position_ids": plan.shard(positions, seq_dim=1, rank=rank), "use_cache": False, PLAN_KEY: plan}
        if shifted is not None:
            local[LABELS_KEY] = plan.shard(shifted, seq_dim=1, rank=rank)
        if self.chunk:
            local[CHUNK_PLAN_KEY] = plan.split_documents(chunk_starts(positions, self.chunk))
        return local

    def _checked_batch(self, batch) -> tuple:
        """(input_ids, position_ids, shifted labels or None, plan) of a packed batch, or a clear error."""
        if not hasattr(batch, "get"):
            raise TypeError(f"batch must be a mapping (a dict or BatchEncoding, as DataCollatorWithFlattening makes) "
                            f"holding 'input_ids', got {type(batch).__name__}")
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            kind = ValueError if isinstance(ids, torch.Tensor) else TypeError
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise kind(f"batch['input_ids'] must be a (1, T) torch.Tensor: one packed row, as "
                       f"DataCollatorWithFlattening makes (return_tensors='pt'); got {got}")
        # (float ids or ids outside the embedding failed deep in it: a device-side assert on CUDA, on that rank alone)
        embedding = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        vocab = getattr(embedding, "num_embeddings", None)
        if vocab is None:
            check_integer_dtype("batch['input_ids']", ids)
        else:
            check_token_ids("batch['input_ids']", ids, vocab)
        total = ids.shape[1]
        for key in ("labels", LABELS_KEY, "position_ids", "attention_mask"):
            t = batch.get(key)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):  # (a list or an array failed on a missing attribute)
                raise TypeError(f"batch[{key!r}] must be a torch.Tensor (1, {total}) like input_ids, got "
                                f"{type(t).__name__}")
            if tuple(t.shape) != (1, total):
                raise ValueError(f"batch[{key!r}] must have the shape of input_ids (1, {total}), got {tuple(t.shape)}")
            if t.device != ids.device:
                raise ValueError(f"batch[{key!r}] is on {t.device} but batch['input_ids'] on {ids.device}")
            if key != "attention_mask":  # float positions went into RoPE as they were, bool labels lost IGNORE
                check_integer_dtype(f"batch[{key!r}]", t)
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise UnsupportedMask("context parallelism takes packed documents without padding (attention_mask has "
                                  "zeros); use DataCollatorWithFlattening")
        if batch.get("inputs_embeds") is not None or batch.get("past_key_values") is not None:
            raise ValueError("shard_batch takes input_ids (no inputs_embeds) and no past_key_values")
        cu = self.document_boundaries(batch)
        positions = batch.get("position_ids")
        if positions is None:
            from fa4dist.data import positions_from_cu_seqlens

            positions = positions_from_cu_seqlens(cu)[None].to(ids.device)
        labels, shifted = batch.get("labels"), batch.get(LABELS_KEY)
        if shifted is None and labels is not None:  # the target of token i is labels[i + 1]; the last token has none
            shifted = torch.cat([labels[:, 1:], labels.new_full((1, 1), IGNORE)], dim=1)
        # (shift_labels, transformers' name for targets already shifted, takes precedence as in its losses: the
        # target of a window's last token, the next window's first, has no place in unshifted labels)
        plan = self.make_plan(cu)
        empty = [r for r in range(self.cp_size) if plan.local_len(r) == 0]
        if empty:
            raise ValueError(f"a batch of {total} tokens leaves cp ranks {empty} of {self.cp_size} without tokens; "
                             "pack more tokens per batch (or pass fewer num_chunks)")
        return ids, positions, shifted, plan

    def _check_same_batch(self, ids, positions, shifted, rejected: bool = False):
        """Every cp rank must shard the same batch: compare a checksum over the cp group (fails loudly, no hang).
        A rank that rejected its batch takes part too (``rejected=True``: it returns, to raise its own error), so
        that every rank fails at once: the others with an error that names it."""
        if rejected:
            mine = torch.tensor([1, 0, 0, 0, 0], dtype=torch.int64)
        else:
            mine = torch.tensor([0, ids.shape[1], _checksum(ids), _checksum(positions),
                                 _checksum(shifted) if shifted is not None else 0], dtype=torch.int64)
        # within the handle's timeout (a rank whose data ran out never joins: CommError, not the group's own
        # timeout), and one thread at a time on the group, as the attention and the loss take it: a batch prepared
        # on another thread while this one runs the model would pair its exchange with another call's on some ranks
        what = "the check that every cp rank has the same batch"
        transport = Transport(self.loss_group, self.timeout, "fa4dist shard_batch")
        with exclusive([self.loss_group], what, "fa4dist shard_batch"):
            rows = transport.all_gather_ints(mine.tolist(), what)
        if rejected:
            return
        rejected = [r for r, row in enumerate(rows) if row[0]]
        if rejected:
            raise ValueError(f"rank(s) {rejected} of the cp group rejected the batch given to shard_batch (see the "
                             "error on those ranks); every rank of a cp group must shard the same packed batch")
        rows = [row[1:] for row in rows]
        if any(r != rows[0] for r in rows):
            raise ValueError("the cp ranks were given different batches (tokens, positions or labels differ; "
                             f"[length, checksums] per cp rank: {rows}); every rank of a cp group must shard the "
                             "same packed batch")

    # ---- loss ---------------------------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, local: dict) -> torch.Tensor:
        """This rank's share of the batch's mean next-token loss (the shares of the cp ranks add up to it; a batch
        without targets gives 0, not the model's own NaN: :func:`fa4dist.models.cp_cross_entropy`).  Its
        arguments are checked inside the loss's exchange: a rank that refuses them makes every cp rank raise (the
        others naming it), within the handle's ``timeout``."""
        def operands():
            self._check_enabled("handle.loss")
            labels = local_labels(local)
            flat = logits
            if isinstance(flat, torch.Tensor) and flat.dim() == 3:
                if flat.shape[0] != 1:
                    raise ValueError(f"logits must be (1, local_tokens, vocab) or (local_tokens, vocab): one packed "
                                     f"row, got shape {tuple(flat.shape)}")
                flat = flat[0]
            if isinstance(flat, torch.Tensor) and flat.dim() >= 1 and flat.shape[0] != labels.shape[-1]:
                raise ValueError(f"logits hold {flat.shape[0]} tokens but the local batch {labels.shape[-1]}")
            return flat, labels.reshape(-1)

        group = self.loss_group if self.cp_size > 1 else None
        return cp_cross_entropy_of(operands, group, timeout=self.timeout).loss

    # ---- undo ---------------------------------------------------------------------------------------------------

    def disable(self):
        """Puts back the model's previous attention implementation (idempotent)."""
        if not self.enabled:
            return
        _HANDLES.pop(self.name, None)
        self._forward_hook.remove()
        for module, tuning in zip(self.temperature_tuned, self._tuning):
            module.attn_temperature_tuning = tuning
        if self.previous is not None:
            _set_attn_implementation(self.model, self.previous)
        self.enabled = False

    def __enter__(self) -> "ContextParallelHandle":
        return self

    def __exit__(self, *exc):
        self.disable()
        return False

    def __repr__(self) -> str:
        return (f"ContextParallelHandle(cp_size={self.cp_size}, cp_rank={self.cp_rank}, balancer={self.balancer!r}, "
                f"attention={self.name!r}, previous={self.previous!r}, enabled={self.enabled})")


def local_labels(local) -> torch.Tensor:
    """The (shifted) labels of a local batch from :meth:`ContextParallelHandle.shard_batch`; the losses call it
    inside their exchange, so that a rank whose batch has none makes every cp rank raise."""
    labels = local.get(LABELS_KEY) if hasattr(local, "get") else None
    if labels is None:
        raise ValueError("the local batch has no labels (shard_batch was given a batch without 'labels')")
    return labels


def _checksum(t: torch.Tensor) -> int:
    """An order-sensitive int64 checksum (wrapping arithmetic: the same bytes on every rank)."""
    x = t.reshape(-1).to("cpu", torch.int64)
    weights = (torch.arange(1, x.numel() + 1, dtype=torch.int64) * _CHECKSUM_SEED) % 1_000_003 + 1
    return int((x * weights).sum())


def _loss_group(group, mesh):
    """The process group spanning every cp rank (the loss's token count is summed over it)."""
    if mesh is None:
        return group
    from fa4dist.context_parallel.core import mesh_group

    return mesh_group(mesh, "enable_context_parallel(mesh=)")


def enable_context_parallel(model, group=None, mesh=None, strategy: str = "auto", balancer: str = "lpt", *,
                            backend: str = "auto", deterministic: Optional[bool] = None,
                            num_chunks: Optional[int] = None, timeout: float = 300.0,
                            check_batch: bool = True, cp_invariant: Optional[bool] = None) -> ContextParallelHandle:
    """Runs ``model``'s attention layers with fa4dist context parallelism; returns the handle
    (``shard_batch``, ``loss``, ``disable``; a context manager).

    - ``group``: the cp process group (default: the whole world when torch.distributed is initialized, else one
      process; one of several processes torchrun started, with no process group yet, is refused); or ``mesh``: a
      1-D DeviceMesh, or 2-D ``("ring", "ulysses")`` for the hybrid strategy.
    - ``strategy``: ``"auto"``, ``"ring"``, ``"ulysses"``, ``"hybrid"`` (:class:`FA4ContextParallelAttention`).
    - ``balancer``: the plan's balancer, ``"lpt"`` (default), ``"zigzag"`` or ``"contiguous"``; ``num_chunks`` its
      chunk count (default 8 per rank).
    - ``backend``, ``deterministic``, ``timeout``, ``cp_invariant``: passed to the attention
      (:class:`FA4ContextParallelAttention`; ``cp_invariant`` makes the attention's results the same bits at every
      cp size, not the rest of the transformers model); ``timeout`` bounds the wait of ``loss`` (and of
      ``TiledCausalLMLoss``) for the other ranks too.
    - ``check_batch``: compare a checksum of the batch over the cp ranks in every ``shard_batch``.

    Raises :class:`~fa4dist.integrations.hf.UnsupportedMask` naming what the model needs that the attention does
    not compute (chunked or bidirectional attention, other layer types, no AttentionInterface)."""
    return ContextParallelHandle(model, group, mesh, strategy, balancer, backend=backend,
                                 deterministic=deterministic, num_chunks=num_chunks, timeout=timeout,
                                 check_batch=check_batch, cp_invariant=cp_invariant)
