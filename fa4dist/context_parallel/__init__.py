"""Context parallelism: one sequence's attention spread over a process group, exactly.

- :func:`make_plan` / :class:`ShardPlan`: which tokens each rank holds (``contiguous``, ``zigzag``, ``lpt``
  balancers; any length; packed documents), ``shard`` / ``unshard``, RoPE ``positions``, ``balance_report``.
- :func:`context_parallel_attention` / :class:`ContextParallel`: ring, Ulysses or 2-D (Ulysses x ring)
  attention of the local shards, differentiable; the module form is
  :class:`fa4dist.modules.FA4ContextParallelAttention`.

Everything runs on the kernel contract (:mod:`fa4dist.kernels`), so every backend works unchanged.
"""

from .comm import CommError, Transport
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
    "Transport",
    "Schedule",
    "HeadSplit",
]
