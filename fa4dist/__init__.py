"""fa4dist: FlashAttention-4-style attention kernels and exact context-parallel attention for long-context training.

`fa4dist.attention` is single-GPU differentiable attention; `fa4dist.kernels` holds the kernel contract that every
strategy calls; `fa4dist.context_parallel` spreads one sequence over a process group; `fa4dist.modules` has the
`FA4ContextParallelAttention` module.
"""

__version__ = "0.1.0"

from .kernels.autograd import attention  # noqa: E402

__all__ = ["attention", "__version__"]
