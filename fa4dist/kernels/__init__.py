"""Single-GPU attention behind one contract.

Layout follows flash-attn: q, k, v are (batch, seqlen, heads, head_dim); packed variable-length input is
(total_tokens, heads, head_dim) with int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` (segment b of q attends to segment b
of k).  k and v may have fewer heads than q (GQA/MQA: query head h uses kv head h // (heads_q // heads_kv)).

- ``attention_forward(q, k, v, ...) -> (out, lse)``: lse is fp32 (fp64 for fp64 inputs) natural log, (batch, heads,
  seqlen_q) or packed (heads, total_q).  A block is placed by global offsets: with ``causal``, key j is visible to
  query i iff ``k_offset + j <= q_offset + i`` (offsets may be per sequence/segment); ``window=(left, right)``
  (flash-attn's window_size, -1 unbounded) keeps the keys within [p - left, p + right] of the query's position p,
  intersected with causal (:mod:`fa4dist.kernels.mask`, one :class:`Mask` value).  A query that sees no key gets
  out = 0, lse = -inf (with sinks: lse = its head's sink).  ``accumulate=True`` merges the block into a running
  fp32 (out, lse) in place.  ``softcap`` caps the scaled scores (``softcap * tanh(s / softcap)``); ``sinks`` (one
  logit per query head) join every row's softmax once: split keys pass them to one call per row
  (:mod:`fa4dist.kernels.merge` holds the rule).
- ``attention_backward(dout, q, k, v, out, lse, ...) -> (dq, dk, dv[, dsinks])`` takes the *global* out and lse
  and can add into fp32 gradient buffers (``accumulate=True``).
- ``attention_forward_items`` / ``attention_backward_items``: a work list of many such blocks in one call, merged
  (or added) in list order (:mod:`fa4dist.kernels.worklist`).
- Backends: ``reference`` (pure PyTorch, anywhere, the test oracle), ``sdpa`` (torch's fused flash / cuDNN ops,
  GPU; ``sdpa_flash`` and ``sdpa_cudnn`` name one), ``cute`` (our CuTe DSL kernels, Hopper) when installed;
  ``auto`` takes the fastest that supports the call.
"""

import logging as _logging

from .api import attention_backward, attention_forward
from .mask import Mask, Visibility, block_visibility, causal_decomposition, visible_pairs
from .merge import merge_into_, merge_partials, merge_sink_, sink_grad
from .problem import AttentionProblem, validate_inputs
from .reference import ReferenceBackend
from .registry import Unsupported, available_backends, get_backend, register_backend, select_backend
from .sdpa import SdpaBackend, SdpaCudnnBackend, SdpaFlashBackend
from .worklist import WorkItem, attention_backward_items, attention_forward_items

register_backend(ReferenceBackend())
_flash, _cudnn = SdpaFlashBackend(), SdpaCudnnBackend()
register_backend(_flash)
register_backend(_cudnn)
register_backend(SdpaBackend(_cudnn, _flash))

try:  # our CuTe DSL kernels; the package imports cutlass lazily, so this works without it
    from .cute import register as _register_cute
except ImportError as _err:  # pragma: no cover - only before the CuTe backend exists
    _logging.getLogger("fa4dist.kernels").debug("CuTe backend not registered: %s", _err)
else:
    _register_cute()

__all__ = [
    "attention_forward",
    "attention_backward",
    "WorkItem",
    "attention_forward_items",
    "attention_backward_items",
    "merge_into_",
    "merge_partials",
    "merge_sink_",
    "sink_grad",
    "Mask",
    "AttentionProblem",
    "validate_inputs",
    "Visibility",
    "block_visibility",
    "causal_decomposition",
    "visible_pairs",
    "Unsupported",
    "available_backends",
    "get_backend",
    "register_backend",
    "select_backend",
]
