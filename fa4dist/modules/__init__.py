"""Modules: :class:`FA4ContextParallelAttention`."""

from .attention import FA4ContextParallelAttention

__all__ = ["FA4ContextParallelAttention"]
