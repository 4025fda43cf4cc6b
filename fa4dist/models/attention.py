"""The attention the model calls: ``FA4ContextParallelAttention`` over the cp group, or the kernel contract
directly when the sequence is not split.

Both take this rank's packed q, k, v ``(local_tokens, heads, head_dim)`` (k, v at the KV head count: GQA is never
expanded), the sample's sharding plan and optionally the layer's attention sinks, and return the local output.  A
layer picks its mask with ``window=`` (a sliding-window layer) and ``softcap=``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fa4dist
from fa4dist.context_parallel.core import check_single_rank_plan


def group_size(group) -> int:
    """Size of a process group, a 1-D DeviceMesh, or 1 for None."""
    if group is None:
        return 1
    if hasattr(group, "size") and hasattr(group, "get_group"):  # DeviceMesh
        return group.size()
    from fa4dist.context_parallel.comm import member_size_rank

    return member_size_rank(group, "cp_group")[0]  # (refuses what is not a process group, or one without this rank)


class LocalPackedAttention(nn.Module):
    """cp size 1: causal attention within each document of the plan, through the kernel contract.

    The plan is a cp-size-1 ``ShardPlan`` or a ``SingleRankPlan``, checked with its inputs as a cp group's attention
    checks them at cp size 1 (``check_single_rank_plan``); a packed plan's device copy of cu_seqlens is kept for as
    long as the same plan comes back on the same device (every layer of one forward)."""

    def __init__(self, causal: bool = True, softmax_scale: Optional[float] = None,
                 deterministic: Optional[bool] = None, backend: str = "auto", window: tuple[int, int] = (-1, -1),
                 softcap: Optional[float] = None, cp_invariant: Optional[bool] = None):
        super().__init__()
        self.causal, self.softmax_scale, self.window, self.softcap = causal, softmax_scale, window, softcap
        self.deterministic, self.backend, self.cp_invariant = deterministic, backend, cp_invariant
        self._cu_cache: tuple = (None, None)

    def _cu_seqlens(self, plan, device) -> torch.Tensor:
        """The packed plan's local segments on `device` (the plan already checked)."""
        # keyed by the device too: the same plan after the model or its inputs moved gave the old device's copy
        device = torch.device(device)
        cached_plan, cached = self._cu_cache
        if cached_plan is plan and cached.device == device:
            return cached
        cu = plan.local_cu_seqlens(0).to(device=device, dtype=torch.int32)
        self._cu_cache = (plan, cu)
        return cu

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan=None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if plan is not None:
            # checked as a cp group's attention checks it at cp size 1: a one-sequence plan's 3-D input was run here
            # as one document
            packed = check_single_rank_plan(q, k, v, plan)
            cu = self._cu_seqlens(plan, q.device) if packed else None
        elif q.dim() == 3:  # one packed sequence without a plan
            cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        else:
            cu = None
        return fa4dist.attention(
            q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, window=self.window, softcap=self.softcap,
            sinks=sinks, cu_seqlens_q=cu, cu_seqlens_k=cu, deterministic=self.deterministic, backend=self.backend,
            cp_invariant=self.cp_invariant,
        )


def make_attention(group=None, *, strategy: str = "auto", causal: bool = True,
                   softmax_scale: Optional[float] = None, deterministic: Optional[bool] = None,
                   backend: str = "auto", window: tuple[int, int] = (-1, -1), softcap: Optional[float] = None,
                   cp_invariant: Optional[bool] = None, **options) -> nn.Module:
    """The attention module for a cp group (a ProcessGroup, a DeviceMesh, or None for no context parallelism);
    ``window``/``softcap`` as in :func:`fa4dist.attention` (a sliding-window layer passes its window)."""
    from fa4dist.modules import FA4ContextParallelAttention

    common = dict(causal=causal, softmax_scale=softmax_scale, deterministic=deterministic, backend=backend,
                  window=window, softcap=softcap, cp_invariant=cp_invariant)
    if group_size(group) == 1:
        # the options checked as a cp group's module checks them (a group of its own, of one rank): a misspelt
        # strategy or option was taken here silently, and failed only once the same code ran on a cp group
        FA4ContextParallelAttention(strategy=strategy, **common, **options)
        return LocalPackedAttention(**common)

    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        return FA4ContextParallelAttention(mesh=group, strategy=strategy, **common, **options)
    return FA4ContextParallelAttention(group, strategy=strategy, **common, **options)
