"""fa4dist's own Hopper (sm_90a) attention forward kernel in CuTe DSL.

Nothing here imports cutlass at import time; the kernel module is loaded on first use.

    from fa4dist.kernels import cute as fa4cute
    fa4cute.is_available()                 # cutlass importable and an sm90 GPU present
    fa4cute.supports(q, k, v, causal)      # -> (ok, reason)
    fa4cute.forward(q, k, v, out, lse, softmax_scale=..., causal=..., q_offset=0, k_offset=0,
                    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    accumulate=False)
"""

from .interface import (  # noqa: F401
    SUPPORTED_HEAD_DIMS,
    KernelConfig,
    cache_info,
    compile_variant,
    cutlass_importable,
    forward,
    get_compiled,
    is_available,
    make_config,
    supports,
)
from .backend import CuteSm90Backend, register  # noqa: F401,E402
