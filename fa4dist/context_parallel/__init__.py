"""Context parallelism: one sequence's attention spread over a process group, exactly.

- :func:`make_plan` / :class:`ShardPlan`: which tokens each rank holds (``contiguous``, ``zigzag``, ``lpt``
  balancers; any length; packed documents), ``shard`` / ``unshard``, RoPE ``positions``, ``balance_report``.
- :func:`context_parallel_attention` / :class:`ContextParallel`: ring, Ulysses or 2-D (Ulysses x ring)
  attention of the local shards, differentiable, with causal masks, sliding windows, softcap and sinks; the module
  form is :class:`fa4dist.modules.FA4ContextParallelAttention`.
- :class:`Schedule`: what each ring step computes and sends (point to point, only the key rows a member reads;
  steps the mask leaves empty are skipped).

Everything runs on the kernel contract (:mod:`fa4dist.kernels`), so every backend works unchanged.
"""

from .comm import CommError, GroupBroken, Transport
from .core import STRATEGIES, ContextParallel, context_parallel_attention
from .plan import BALANCERS, BalanceReport, ShardPlan, make_plan
from .schedule import Schedule
from .ulysses import HeadSplit

__all__ = [
    "make_plan",
    "ShardPlan",
    "BalanceReport",
    "BALANCERS",
    "STRATEGIES",
    "ContextParallel",
    "context_parallel_attention",
    "CommError",
    "GroupBroken",
    "Transport",
    "Schedule",
    "HeadSplit",
]
