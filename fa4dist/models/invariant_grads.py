"""Parameter gradients with the same bits at every cp size: the rest of a cp_invariant training step.

Every parameter gradient is a sum over tokens, and a context-parallel rank sums only its own: its fp32 partial sum
and the all-reduce over ranks round differently at every cp size (about 1e-7 relative in fp32).  Here every
contribution is added in int64 fixed point, as the attention's dq is (:mod:`fa4dist.kernels.fixed_point`):

- a matrix (:class:`~fa4dist.models.llama.Linear`): one product ``dy_b^T x_b`` per canonical block of ``ROW_BLOCK``
  tokens of the stream (a fixed shape, the last block zero-padded), each truncated to int64;
- a norm weight: each token's ``dy_t * x_t``; an embedding row: each token's ``dy_t``.

One power of two per contribution site and backward, 2^(61 - e) with ``T * max|dy| * max|x| < 2^e`` (T the tokens,
maxima and T all-reduced over the group: exact), keeps every sum below 2^62.  :meth:`FixedPointGrads.finish` then
all-reduces the int64 sums (exact in any order), converts each site once and adds a parameter's sites (a tied
embedding has two) in a fixed order.  Blocks are canonical when every rank's tokens are whole blocks of the stream:
plans whose chunks are multiples of ``ROW_BLOCK`` (``FA4Llama.make_plan`` asks for that in this mode).  The input
gradients of these ops stay per token (fixed row blocks for the matrices), so nothing else changes.

Slower than autograd's own (one small product per block, int64 sums): a reproducibility mode.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..kernels import fixed_point
from .llama import row_block_products, row_blocks


class _Site:
    """One parameter's contributions from one module: the int64 sum and its scale (per backward)."""

    def __init__(self, param: torch.nn.Parameter, grads: "FixedPointGrads"):
        self.param, self.grads = param, grads
        self.total: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None

    def start(self, tokens: int, *maxima: torch.Tensor) -> torch.Tensor:
        """The power of two for this backward's contributions (all-reducing the token count and the maxima)."""
        if self.total is not None:
            raise RuntimeError("a cp_invariant parameter got two backward passes before FixedPointGrads.finish() "
                               "(call finish() after each backward)")
        device = self.param.device
        peak = torch.stack([m.reshape(()) for m in maxima]).to(device)
        count = torch.tensor([tokens], dtype=torch.int64, device=device)
        group = self.grads.group
        if self.grads.distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(count, group=group)
        bound = count.double().reshape(()) * torch.prod(peak)  # on the device: no host sync
        self.scale = fixed_point.power_of_two_scale(bound)
        self.total = torch.zeros(self.param.shape, dtype=torch.int64, device=device)
        return self.scale


class _FixedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, site, rows):
        ctx.save_for_backward(x, weight)
        ctx.site, ctx.rows = site, rows
        return row_block_products(x, weight, rows)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        site, rows, n = ctx.site, ctx.rows, x.shape[0]
        scale = site.start(n, fixed_point.absmax(dy), fixed_point.absmax(x))
        dx = row_block_products(dy, weight.t(), rows)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        for dy_b, x_b in zip(row_blocks(dy, rows), row_blocks(x, rows)):  # one fixed-shape product per canonical block
            site.total += fixed_point.to_fixed(dy_b.t().to(acc) @ x_b.to(acc), scale)
        return dx, None, None, None


class _FixedScale(torch.autograd.Function):
    """weight * x (a norm's gain): per-token contributions to the weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, site):
        ctx.save_for_backward(x, weight)
        ctx.site = site
        return weight * x

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        site = ctx.site
        flat_dy, flat_x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        scale = site.start(flat_dy.shape[0], fixed_point.absmax(dy), fixed_point.absmax(x))
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        site.total += fixed_point.to_fixed(flat_dy.to(acc) * flat_x.to(acc), scale).sum(0)
        return (dy * weight).to(x.dtype), None, None


class _FixedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, site):
        ctx.save_for_backward(tokens)
        ctx.site = site
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, dy):
        (tokens,) = ctx.saved_tensors
        site = ctx.site
        flat = dy.reshape(-1, dy.shape[-1])
        scale = site.start(flat.shape[0], fixed_point.absmax(dy))
        acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
        site.total.index_add_(0, tokens.reshape(-1), fixed_point.to_fixed(flat.to(acc), scale))
        return None, None, None


class FixedPointGrads:
    """The fixed-point gradients of a model's Linear (weight only), RMSNorm and Embedding parameters; install with
    ``FA4Llama.set_invariant_grads`` and call :meth:`finish` after each backward (it sets ``p.grad``, summed over
    ``group``, the default group when distributed: no other gradient all-reduce for these parameters)."""

    def __init__(self, group=None):
        self.group = group
        self.sites: list[_Site] = []

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def site(self, param: torch.nn.Parameter) -> _Site:
        s = _Site(param, self)
        self.sites.append(s)
        return s

    def linear(self, x, weight, site, rows):
        return _FixedLinear.apply(x, weight, site, rows)

    def scale(self, x, weight, site):
        return _FixedScale.apply(x, weight, site)

    def embedding(self, tokens, weight, site):
        return _FixedEmbedding.apply(tokens, weight, site)

    @torch.no_grad()
    def finish(self) -> None:
        """Sums every site over the group (int64: exact), converts it once and sets each parameter's gradient
        (sites of one parameter added in installation order); sites without a backward this step add nothing."""
        live = [s for s in self.sites if s.total is not None]
        if self.distributed and live:
            flat = torch.cat([s.total.flatten() for s in live])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for s in live:
                s.total.copy_(flat[offset:offset + s.total.numel()].view_as(s.total))
                offset += s.total.numel()
        grads: dict[int, torch.Tensor] = {}
        for s in live:
            acc = torch.float64 if s.param.dtype == torch.float64 else torch.float32
            value = s.total.to(acc) * (1.0 / s.scale.double()).to(acc)  # a power of two: exact
            key = id(s.param)
            grads[key] = value if key not in grads else grads[key] + value
            s.total = s.scale = None
        for s in self.sites:
            g = grads.pop(id(s.param), None)
            if g is not None:
                g = g.to(s.param.dtype)
                s.param.grad = g if s.param.grad is None else s.param.grad + g
