"""A Llama-style decoder whose attention is fa4dist's context-parallel attention.

RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention, no biases; parameter names follow Hugging Face's
``LlamaForCausalLM`` so weights map one to one (``fa4dist.integrations.hf.to_hf_llama``).

The model works on one packed stream of documents per call: ``tokens`` and ``positions`` are this rank's shard
``(local_tokens,)``; ``positions`` are the *global* positions of the local tokens within their documents (the
plan's ``positions(rank)``), so rotary embeddings are exactly those of the unsplit sequence; the plan goes to
every attention layer, which knows from it which keys each local query may see.
"""

from __future__ import annotations

import numbers
from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.mask import Mask, visible_pairs
from ..kernels.problem import check_bool, check_integer_dtype, check_timeout, comparable_integers, type_name
from .attention import make_attention
from .config import ModelConfig


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types (norms, rotary), the tensor's own dtype for fp32/fp64."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class Linear(nn.Linear):
    """``nn.Linear`` whose output rows can be made independent of how many rows a call has (``row_invariant``).

    BLAS libraries pick their kernels, and with them the order of a row's sums, by matrix shape (on a CPU, a 1- to
    5-row product rounds differently from a 300-row one): the same token gets different bits in a one-document
    prefill and in a context-parallel shard.  Row-invariant calls run in fixed blocks of ``ROW_BLOCK`` rows (the
    last zero-padded), so every product has one shape.  One launch per block: slower, meant for the cp_invariant
    mode's log-prob checks, not for throughput."""

    ROW_BLOCK = 64
    row_invariant = False
    fixed_grads = None  # (FixedPointGrads, site): the cp_invariant step's weight gradient (invariant_grads.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_grads is not None and x.dim() == 2:
            grads, site = self.fixed_grads
            return grads.linear(x, self.weight, site, self.ROW_BLOCK)
        if not self.row_invariant or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        return _RowBlockLinear.apply(x, self.weight, self.bias, self.ROW_BLOCK)

    @property
    def rows_invariant(self) -> bool:
        """Whether this layer's rows are computed independently of the call's row count (``row_invariant``, or
        the invariant gradients' fixed-block products)."""
        return self.row_invariant or self.fixed_grads is not None


def check_token_ids(name: str, tokens: torch.Tensor, vocab_size: int) -> None:
    """Integer ids in [0, vocab_size): an id outside it was an IndexError deep in the embedding (a device-side
    assert on CUDA, or a silently wrong index_add in the invariant-gradient embedding). One host read."""
    check_integer_dtype(name, tokens)
    if tokens.numel():
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(comparable_integers(tokens))).tolist())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must be ids in [0, vocab_size={vocab_size}), got ids from {lo} to {hi}")


def silu(x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
    """``F.silu``; ``row_invariant`` on a CPU: ``x / (1 + exp(-x))`` (in fp32 for 16-bit inputs, rounded once),
    whose every op (and derivative) rounds an element from its own value alone.  torch's CPU SiLU and its derivative
    compute the elements of a vector-width tail (the tensor's last ones, and each thread's share's last ones) with
    a scalar formula that rounds differently from the vector one (~4% of values, 1 ulp, torch 2.13 AVX512), so a
    token's activation depended on its place in the call and on ``torch.get_num_threads()``.  CUDA's kernel computes
    every element alike: no change there."""
    if not row_invariant or x.device.type != "cpu":
        return F.silu(x)
    return _ElementwiseSiLU.apply(x)


class _ElementwiseSiLU(torch.autograd.Function):
    """:func:`silu`'s row-invariant form with its derivative written out: autograd through ``x / (1 + exp(-x))``
    gave ``inf / inf`` = NaN where ``exp(-x)`` overflows (x below about -88 in fp32 and bf16, -709 in fp64), where
    F.silu's derivative is ~0; ``s (1 + x (1 - s))``, s = 1 / (1 + exp(-x)), stays finite there, elementwise too."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        xf = x.to(_compute_dtype(x.dtype))
        return (xf / (1 + torch.exp(-xf))).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        xf = x.to(_compute_dtype(x.dtype))
        s = 1 / (1 + torch.exp(-xf))
        return (dy.to(xf.dtype) * (s * (1 + xf * (1 - s)))).to(x.dtype)


def row_blocks(t: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """``t``'s rows in blocks of ``rows`` (the last zero-padded): every product then has one shape."""
    pad = (-t.shape[0]) % rows
    return list((F.pad(t, (0, 0, 0, pad)) if pad else t).split(rows))


def row_block_products(x: torch.Tensor, weight: torch.Tensor, rows: int, bias=None) -> torch.Tensor:
    """F.linear(x, weight, bias), one product per block of ``rows`` rows: a row's result does not depend on how many
    rows the call has."""
    n = x.shape[0]
    if n == 0:
        return F.linear(x, weight, bias)
    products = [F.linear(b, weight, bias) for b in row_blocks(x, rows)]
    products[-1] = products[-1][:n - rows * (len(products) - 1)]  # the padding's rows dropped before the cat: the
    return torch.cat(products)  # result is a tensor of its own, not a view (FSDP2 warns of a module returning one)


class _RowBlockLinear(torch.autograd.Function):
    """x W^T (+ b) in fixed blocks of rows, and dx = dy W in the same blocks; dW = dy^T x as one product (autograd
    through the blocks would add one 16-bit rounded block gradient per block: ~1e-2 relative error in bf16)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows):
        ctx.save_for_backward(x, weight)
        ctx.rows, ctx.has_bias = rows, bias is not None
        return row_block_products(x, weight, rows, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = row_block_products(dy, weight.t(), ctx.rows)
        return dx, dy.t() @ x, dy.sum(0) if ctx.has_bias else None, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fixed_grads = None  # as Linear.fixed_grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fixed_grads is not None:
            grads, site = self.fixed_grads
            return grads.scale(xf.to(x.dtype), self.weight, site)
        return self.weight * xf.to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (tokens, head_dim) for integer positions (Hugging Face's rotate-half convention), fp32 (fp64 for
    fp64 models)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim))
    freqs = positions.to(dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (tokens, heads, head_dim); cos/sin (tokens, head_dim)."""
    xf = x.to(cos.dtype)
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, core: nn.Module):
        super().__init__()
        hd = config.resolved_head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.q_proj = Linear(config.dim, config.n_heads * hd, bias=False)
        self.k_proj = Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.v_proj = Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.o_proj = Linear(config.n_heads * hd, config.dim, bias=False)
        self.core = core

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, plan=plan)
        return self.o_proj(out.reshape(t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        ffn = config.resolved_ffn_dim
        self.gate_proj = Linear(config.dim, ffn, bias=False)
        self.up_proj = Linear(config.dim, ffn, bias=False)
        self.down_proj = Linear(ffn, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x), self.gate_proj.rows_invariant) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, core: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, core)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)
        self.activation_checkpointing = False

    def _forward(self, x, cos, sin, plan):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, plan):
        # Checkpointing inside the layer: with FSDP2 around the layer, the recompute runs while its parameters are
        # still gathered for the backward.
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, plan, use_reentrant=False)
        return self._forward(x, cos, sin, plan)


def causal_training_flops(matmul_params: int, layers: int, heads: int, head_dim: int, cu_seqlens_list, *,
                          layer_masks: Optional[Sequence[tuple]] = None) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute) of a causal decoder over packed samples.

    ``6 * N * T + 12 * H * D * sum over layers of P``: N the matmul parameters (every Linear, LM head included,
    embedding lookup excluded), T the tokens, H query heads, D head dim, P the (query, key) pairs a layer's mask
    leaves visible: causal within documents, l(l+1)/2 for a document of length l (``12 * L * H * D * P`` when
    every layer is such).  ``layer_masks``: one ``(window, chunk)`` per layer for models whose layers see less
    (None: every layer full causal): ``window`` W tokens (the query and the W - 1 before it; None: unbounded),
    ``chunk`` C tokens (a query sees the keys of its own C-token chunk of its document, counted from the document's
    first token; None: none).  The backward counts twice the forward; activation-checkpoint recompute is not
    counted (MFU, not HFU).  ``cu_seqlens_list``: one cu_seqlens per sample, each as
    :func:`fa4dist.context_parallel.make_plan` takes it (a tensor or a list of boundaries) and checked as it checks
    them; a list of ints alone is one sample's boundaries, refused (wrap it: ``[cu_seqlens]``).  The one formula of
    :meth:`FA4Llama.training_flops` and the recipes' MFU (recipes/common.FLOP_FORMULA)."""
    from fa4dist.context_parallel.plan import _documents

    # a list of boundaries was a TypeError from list subtraction, one sample's tensor an IndexError from its 0-d
    # elements, and decreasing boundaries counted negative tokens silently
    if isinstance(cu_seqlens_list, (torch.Tensor, str)) or not isinstance(cu_seqlens_list, Iterable) or (
            isinstance(cu_seqlens_list, (list, tuple)) and cu_seqlens_list
            and all(isinstance(x, int) for x in cu_seqlens_list)):
        raise TypeError("cu_seqlens_list must be a list of samples' cu_seqlens (wrap one sample's in a list: "
                        f"[cu_seqlens]), got {type(cu_seqlens_list).__name__}"
                        + (f" {list(cu_seqlens_list)[:8]}" if isinstance(cu_seqlens_list, (list, tuple)) else ""))
    masks = [(None, None)] * layers if layer_masks is None else [tuple(m) for m in layer_masks]
    if len(masks) != layers or any(len(m) != 2 for m in masks):
        raise ValueError(f"layer_masks must hold one (window, chunk) per layer ({layers}), got {layer_masks!r}")
    for window, chunk in masks:
        for name, value in (("window", window), ("chunk", chunk)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                      or value < 1):
                raise ValueError(f"layer_masks: a {name} must be a positive number of tokens or None, got {value!r}")
    lengths: Counter = Counter()  # document length -> how many (a step's documents repeat few lengths)
    for cu in cu_seqlens_list:
        total, bounds = _documents(cu)  # (bounds None: an int, one sequence)
        bounds = bounds or (0, total)
        lengths.update(b - a for a, b in zip(bounds, bounds[1:]))
    tokens = sum(n * count for n, count in lengths.items())
    pairs = sum(layers * _visible_pairs_per_layer(lengths, *mask) for mask, layers in Counter(masks).items())
    return 6.0 * matmul_params * tokens + 12.0 * heads * head_dim * pairs


def _visible_pairs_per_layer(lengths: Counter, window: Optional[int], chunk: Optional[int]) -> int:
    """Visible (query, key) pairs of documents (``lengths``: length -> count) under causal masking, a window of
    ``window`` tokens and chunks of ``chunk`` tokens (either None: none), counted by the contract's mask
    (:func:`fa4dist.kernels.mask.visible_pairs`)."""
    mask = Mask.canonical(True, (-1, -1) if window is None else (window - 1, 0))

    def run(n):  # the pairs of a causal run of n tokens
        return visible_pairs(n, n, 0, 0, mask)

    if chunk is None:
        return sum(count * run(n) for n, count in lengths.items())
    return sum(count * ((n // chunk) * run(chunk) + run(n % chunk)) for n, count in lengths.items())


class FA4Llama(nn.Module):
    """Llama-style causal LM.  ``forward(tokens, positions, plan) -> logits (local_tokens, vocab)``.

    ``cp_group``: the context-parallel group (ProcessGroup, 1-D DeviceMesh or None); ``attention_factory``
    replaces the attention core (a parameter-free module ``core(q, k, v, plan=...)``; one instance is shared by all
    layers, so per-plan state such as the CP schedule is built once per forward, not once per layer).
    """

    def __init__(self, config: ModelConfig, cp_group=None, *, strategy: str = "auto",
                 deterministic: Optional[bool] = None, backend: str = "auto", cp_invariant: Optional[bool] = None,
                 ulysses_degree: Optional[int] = None, attention_factory: Optional[Callable[[], nn.Module]] = None):
        super().__init__()
        if not isinstance(config, ModelConfig):  # a preset name or a dict was an AttributeError ('vocab_size')
            raise TypeError("config must be a fa4dist.models.ModelConfig (get_config('tiny') for a preset), got "
                            f"{type_name(config)}")
        self.config = config
        if attention_factory is None:
            options = {} if ulysses_degree is None else dict(ulysses_degree=ulysses_degree)

            def attention_factory():
                return make_attention(cp_group, strategy=strategy, causal=True, deterministic=deterministic,
                                      backend=backend, cp_invariant=cp_invariant, **options)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        core = attention_factory()
        self.__dict__["_core"] = core  # unregistered (the layers hold it): attention_core of a model with no layers
        self.layers = nn.ModuleList(DecoderLayer(config, core) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.invariant_grads = None  # FixedPointGrads (set_invariant_grads)
        self._embed_site = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None):
        """Normal(0, init_std) for matrices (output projections scaled by 1/sqrt(2 n_layers)), ones for norms."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                scale = std / (2 * self.config.n_layers) ** 0.5 if residual_out else std
                p.normal_(0.0, scale, generator=generator)

    @property
    def attention_core(self) -> nn.Module:
        # a model of n_layers=0 has no layer to ask (cp_size, make_plan were an IndexError)
        return self.layers[0].self_attn.core if len(self.layers) else self._core

    @property
    def cp_size(self) -> int:
        return getattr(self.attention_core, "cp_size", 1)

    @property
    def cp_rank(self) -> int:
        return getattr(self.attention_core, "cp_rank", 0)

    def make_plan(self, cu_seqlens: torch.Tensor, balancer: str = "lpt", num_chunks: Optional[int] = None):
        """The sharding plan of one packed stream (its document boundaries, or a token count: one document) for this
        model's cp group: the attention module's own ``make_plan`` (right cp size and Ulysses degree), or the
        identity at cp size 1."""
        from fa4dist.context_parallel.plan import _documents

        if isinstance(cu_seqlens, numbers.Integral) or getattr(cu_seqlens, "ndim", None) == 0:
            # a token count: one document, as at cp 1 (the context-parallel make_plan's single-sequence plan is for a
            # (batch, seqlen, ...) layout, which the model's packed stream is not: its attention refused it)
            cu_seqlens = [0, _documents(cu_seqlens)[0]]  # (checked as make_plan checks it: a bool refused)
        core = self.attention_core
        if getattr(core, "cp_size", 1) > 1:
            # invariant gradients: every rank's tokens are whole ROW_BLOCK blocks of the stream
            align = Linear.ROW_BLOCK if self.invariant_grads is not None else 1
            return core.make_plan(cu_seqlens, balancer=balancer, num_chunks=num_chunks, align=align)
        from fa4dist.context_parallel import make_plan
        from fa4dist.data.sharding import SingleRankPlan

        make_plan(cu_seqlens, 1, balancer=balancer, num_chunks=num_chunks)  # the arguments checked as at cp > 1
        return SingleRankPlan(cu_seqlens)

    def set_row_invariant(self, enabled: bool = True):
        """Every matrix product computes each token's row with the same arithmetic whatever the call's token count
        (:class:`Linear`); with cp_invariant attention, a token's logits are then the same bits in a prefill of
        the whole batch and in any context-parallel shard.  Invariant gradients (:meth:`set_invariant_grads`)
        imply it while they are on, whatever this says."""
        check_bool("enabled", enabled)
        for m in self.modules():
            if isinstance(m, Linear):
                m.row_invariant = enabled

    def set_invariant_grads(self, enabled: bool = True, group=None, zero_weight_grads: bool = False,
                            timeout: float = 300.0):
        """Parameter gradients in int64 fixed point (:mod:`fa4dist.models.invariant_grads`): with cp_invariant
        attention and row-invariant products (implied while on: the fixed-point Linear runs in row blocks) a
        training step's gradients are the same bits at every cp size.  Call ``model.invariant_grads.finish()`` after
        the step's backward passes: it sums the gradients over ``group`` (default: every rank) and sets ``p.grad``
        (a sharded parameter's shard: install it after FSDP2's ``fully_shard``; parameters replaced after
        installation are refused at the next forward), in place of the gradient all-reduce or reduce-scatter.
        Plans come from :meth:`make_plan` (chunks aligned to the canonical token blocks).  ``zero_weight_grads``:
        autograd still gives each weight a (zero) gradient, for a wrapper whose reduction runs from gradient hooks
        (DeepSpeed; the real gradients then go in through ``finish(assign=...)``).  ``timeout``: seconds its waits on
        another rank may take (FixedPointGrads).  Returns the FixedPointGrads, or None.

        Enabling again with the same ``group``, ``zero_weight_grads`` and ``timeout`` returns the installed object
        (its pending sums kept); otherwise, and on ``enabled=False``, the installed object is retired (its
        ``finish`` raises; sums not yet finished are dropped).  Turning it off leaves the products as
        :meth:`set_row_invariant` set them, so off is the state before it was turned on."""
        from .invariant_grads import FixedPointGrads

        check_bool("enabled", enabled)
        check_bool("zero_weight_grads", zero_weight_grads)
        timeout = check_timeout(timeout)
        current = self.invariant_grads
        if (enabled and current is not None and current.group is group
                and current.zero_weight_grads == zero_weight_grads and current.timeout == timeout
                and not current.replaced_params()):
            return current  # a handle the caller holds stays the live one
        if enabled:  # checked before anything changes: a refused call leaves the model as it was
            biased = [n for n, m in self.named_modules() if isinstance(m, Linear) and m.bias is not None]
            if biased:
                raise ValueError(f"invariant gradients cover bias-free Linear layers only; these have a bias: {biased}")
        grads = FixedPointGrads(group, zero_weight_grads, timeout) if enabled else None  # (refuses a group first)
        if current is not None:
            current.retire("a later set_invariant_grads(True)" if enabled else "set_invariant_grads(False)")
        self.invariant_grads = grads
        self._embed_site = grads.site(self.embed_tokens.weight, self.embed_tokens, "embed_tokens") if enabled else None
        for name, m in self.named_modules():
            if isinstance(m, (Linear, RMSNorm)):
                m.fixed_grads = (grads, grads.site(m.weight, m, name)) if enabled else None
        return grads

    def set_activation_checkpointing(self, enabled: bool = True):
        check_bool("enabled", enabled)
        for layer in self.layers:
            layer.activation_checkpointing = enabled

    def _check_token_ids(self, tokens: torch.Tensor) -> None:
        check_token_ids("tokens", tokens, self.config.vocab_size)

    def _check_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, plan) -> torch.Tensor:
        """The token ids (as the embedding takes them), or an error naming what is wrong with the arguments."""
        for name, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(f"tokens and positions must be 1-D of one length (one packed stream), got "
                             f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
        self._check_token_ids(tokens)
        if tokens.dtype not in (torch.int32, torch.int64):  # int8/uint8/int16 ids: the embedding takes int32/int64 only
            tokens = tokens.long()
        # rotary embeddings at fractional positions were taken silently (a dtype check: no device sync)
        check_integer_dtype("positions", positions)
        if getattr(plan, "packed", True) is False:  # (a ShardPlan of one (batch, seqlen) sequence)
            # the attention refused it naming q's shape ("q must be 4-D"), an argument the caller never gave
            raise ValueError("plan must be a packed-document plan (the model runs one packed stream), got a "
                             f"single-sequence plan of {plan.total_len} tokens (make_plan(int, ...)); make it with "
                             "model.make_plan(cu_seqlens), or model.make_plan(num_tokens) for one document")
        if self.invariant_grads is not None:
            self.invariant_grads.check_params()
            chunk = getattr(plan, "chunk_size", None)
            if chunk is not None and self.cp_size > 1 and chunk % Linear.ROW_BLOCK:
                raise ValueError(f"invariant gradients need plans whose chunks are multiples of {Linear.ROW_BLOCK} "
                                 f"tokens (model.make_plan makes them), got chunk_size={chunk}")
        expected = self._local_tokens(plan)
        if expected is not None and tokens.shape[0] != expected:  # (the attention named its own q: never passed)
            raise ValueError(f"tokens holds {tokens.shape[0]} tokens but the plan gives this rank {expected} (its "
                             "shard: plan.shard of the stream, or fa4dist.data.shard_sample)")
        return tokens

    def _local_tokens(self, plan):
        """The number of tokens ``plan`` gives this rank (None: not a plan the model knows; the attention checks)."""
        from fa4dist.context_parallel.plan import ShardPlan
        from fa4dist.data.sharding import SingleRankPlan

        if isinstance(plan, SingleRankPlan):
            return plan.total
        if isinstance(plan, ShardPlan) and plan.packed and plan.cp_size == self.cp_size:
            return plan.local_len(self.cp_rank) if plan.cp_size > 1 else plan.total_len
        return None

    def _refuse(self, error: Exception) -> None:
        """At cp > 1, raises ``error`` (this rank's refusal of its arguments) through the attention's agreement
        check, as a refused attention call would: the other cp ranks, already in their first layer's attention call,
        raise at once naming this rank instead of waiting out their timeout.  Returns otherwise (the caller raises)."""
        from fa4dist.context_parallel.core import ContextParallel

        cp = getattr(self.attention_core, "cp", None)
        if not isinstance(cp, ContextParallel) or cp.cp_size == 1:
            return
        try:
            cp.refuse(error)
        except Exception as raised:  # the agreement's error on this rank: this rank's own goes up, from it
            if raised is error:
                raise
            raise error from raised

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, plan=None) -> torch.Tensor:
        try:
            tokens = self._check_inputs(tokens, positions, plan)
        except Exception as err:
            self._refuse(err)
            raise
        if self.invariant_grads is not None:
            x = self.invariant_grads.embedding(tokens, self.embed_tokens.weight, self._embed_site)
        else:
            x = self.embed_tokens(tokens)
        cos, sin = rotary_tables(positions, self.config.resolved_head_dim, self.config.rope_theta,
                                 torch.float64 if x.dtype == torch.float64 else torch.float32)
        for layer in self.layers:
            x = layer(x, cos, sin, plan)
        return self.lm_head(self.norm(x))

    # -- accounting ------------------------------------------------------------------------------------------------
    def num_parameters(self, matmul_only: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}  # tied weights once
        if not matmul_only:
            return sum(p.numel() for p in params.values())
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    def training_flops(self, cu_seqlens_list) -> float:
        """Model FLOPs of one training step (forward + backward, no recompute) over packed samples:
        :func:`causal_training_flops` with this model's matmul parameters and attention shape."""
        c = self.config
        return causal_training_flops(self.num_parameters(matmul_only=True), c.n_layers, c.n_heads,
                                     c.resolved_head_dim, cu_seqlens_list)
