"""fa4dist's own Hopper (sm_90a) attention kernels in CuTe DSL: forward and backward on one shared toolkit.

Nothing here imports cutlass at import time; the kernel modules are loaded on first use.  The rest of fa4dist
reaches the kernels through the contract (``backend="cute"``); the entry points, for kernel work, are
``forward.is_available()`` (cutlass importable and an sm90 GPU present), ``forward.supports(q, k, v, causal)``
(``(ok, reason)``), ``forward.forward(q, k, v, out, lse, ...)`` and ``backward.backward(dout, q, k, v, out, lse,
dq, dk, dv, ...)`` (their own docstrings list the arguments).

Layout: forward.py / backward.py are the Python entry points (configs, checks, launch); host.py is their shared
host layer (compile cache, AOT export, fake arguments, offsets); backend.py registers them as backend "cute";
fwd_sm90.py / bwd_sm90.py (+ bwd_preprocess.py, bwd_postprocess.py) are the kernels, built from the shared device
modules: tile_scheduler.py (which tile a CTA works on), block_info.py (sequence extents and block ranges),
mask.py, softmax.py, sanitize.py (non-finite inputs under the mask), barriers.py and common_sm90.py (layouts,
MMA, TMA and pipeline helpers, inline PTX).
"""

from .backend import CuteSm90Backend, register  # noqa: F401
from .forward import SUPPORTED_HEAD_DIMS, is_available, supports  # noqa: F401
from .host import cutlass_importable  # noqa: F401
