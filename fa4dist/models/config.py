"""Configuration of the Llama-style decoder and its size presets."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from fa4dist.data.tokenizer import VOCAB_SIZE
from fa4dist.kernels.problem import check_bool, check_int, type_name


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: Optional[int] = None  # default dim // n_heads
    ffn_dim: Optional[int] = None  # default: 8/3 * dim rounded up to a multiple of 64 (SwiGLU)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        for name, minimum in (("vocab_size", 1), ("dim", 1), ("n_layers", 0), ("n_heads", 1), ("n_kv_heads", 1)):
            check_int(name, getattr(self, name), minimum)
        for name in ("head_dim", "ffn_dim"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        for name, minimum in (("rope_theta", None), ("norm_eps", 0.0), ("init_std", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
            if not math.isfinite(value) or (value <= 0 if minimum is None else value < minimum):
                raise ValueError(f"{name} must be finite and {'> 0' if minimum is None else f'>= {minimum}'}, "
                                 f"got {value}")
        check_bool("tie_embeddings", self.tie_embeddings)  # "no" or 1 tied the LM head to the embedding silently
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) (GQA)")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads}), or give head_dim")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.resolved_head_dim}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return -(-int(8 * self.dim / 3) // 64) * 64

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


# Sizes: tiny for CPU tests; the others for GPUs (head_dim 128, GQA 2:1 to 4:1).  Parameter counts exclude nothing
# (embeddings are small with the byte vocabulary).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "small": ModelConfig(dim=768, n_layers=12, n_heads=6, n_kv_heads=2, head_dim=128, ffn_dim=3072,
                         rope_theta=500000.0),  # ~104M
    "base": ModelConfig(dim=1024, n_layers=24, n_heads=8, n_kv_heads=4, head_dim=128, ffn_dim=4096,
                        rope_theta=500000.0),  # ~377M
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=8192,
                      rope_theta=500000.0),  # ~1.0B
}


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with ``overrides`` (ModelConfig fields) replaced.  An override of None means not given
    (the preset's value stays), as the recipes pass their unset options."""
    if not isinstance(name, str):  # a list was an unhashable-type TypeError from the dict lookup
        raise TypeError(f"model size must be a preset name (one of {sorted(PRESETS)}), got {type_name(name)}")
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"model size must be one of {sorted(PRESETS)}, got {name!r}") from None
    return cfg.with_(**{k: v for k, v in overrides.items() if v is not None})
