"""fa4dist: FlashAttention-4-style attention kernels and exact context-parallel attention."""
__version__ = "0.1.0"
