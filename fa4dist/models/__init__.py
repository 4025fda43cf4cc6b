"""A small Llama-style decoder (RMSNorm, RoPE on global positions, SwiGLU, GQA) whose attention is
``FA4ContextParallelAttention``, sized by a config from tiny (CPU tests) to ~1B parameters."""

from .attention import LocalPackedAttention, group_size, make_attention
from .config import PRESETS, ModelConfig, get_config
from .llama import FA4Llama, RMSNorm, apply_rotary, causal_training_flops, rotary_tables
from .loss import CPLoss, cp_cross_entropy, invariant_sum, reduce_value

__all__ = [
    "ModelConfig", "PRESETS", "get_config", "FA4Llama", "RMSNorm", "apply_rotary", "rotary_tables",
    "causal_training_flops", "LocalPackedAttention", "make_attention", "group_size", "CPLoss", "cp_cross_entropy",
    "invariant_sum", "reduce_value",
]
