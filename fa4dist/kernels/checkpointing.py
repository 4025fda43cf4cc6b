"""Selective activation checkpointing around fa4dist's calls: a call runs as one unit, outside the policy.

``checkpoint(fn, ..., context_fn=create_selective_checkpoint_contexts(policy))`` asks the policy about every op
inside ``fn`` and, in the recompute, replays the outputs of the ops it saved instead of running them.  An attention
call is one op to its caller (a fused kernel is one to torch): the ops inside it are not the policy's to save.  A
saved matmul whose output the reference kernel then updates in place raised torch's "cached tensor has been
mutated", and saved sends and receives of a context-parallel call were skipped in the recompute (their buffers left
unfilled, the other ranks waiting out their timeout).  :func:`outside_selective_checkpoint` sets the policy's
dispatch modes aside for one call, so the whole call runs again in the recompute, as under a checkpoint without a
policy.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import checkpoint as _checkpoint

# The dispatch mode classes of torch's selective activation checkpointing (private to torch.utils.checkpoint: none
# where this torch has other names), looked up once at import: every exchanging call asks, and a functools cache
# here made torch.compile warn about tracing through a cached function.
SELECTIVE_CHECKPOINT_MODES = tuple(
    c for c in (getattr(_checkpoint, name, None) for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"))
    if isinstance(c, type))


def _dispatch_modes_active() -> bool:
    length = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return True if length is None else length() > 0


@contextlib.contextmanager
def outside_selective_checkpoint():
    """Runs one call's exchanges and kernels with selective activation checkpointing's modes set aside (a
    ``checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy))`` around the call).

    The policy is asked about every op inside, and the recompute replays the ops it saved instead of running them:
    saved sends and receives were skipped in the recompute (the receive buffers left unfilled, and the other ranks
    waiting out their timeout for them), and a saved matmul whose output the kernel then updates in place raised
    torch's 'cached tensor has been mutated'.  The call is one unit whose exchanges pair up across ranks: all of it
    runs again in the recompute, as in a checkpoint without a policy.  Other dispatch modes stay (a FlopCounterMode
    still counts the kernels' ops); infra modes (tracing) leave the stack as it is."""
    if not _dispatch_modes_active():  # (the usual case: no mode at all, nothing to look through)
        yield
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    kinds = SELECTIVE_CHECKPOINT_MODES
    stack = _get_current_dispatch_mode_stack() if kinds else []
    first = next((i for i, m in enumerate(stack) if isinstance(m, kinds)), None)
    if first is None or any(m.is_infra_mode() for m in stack):
        yield
        return
    above = stack[first:]  # bottom to top
    for _ in above:
        _pop_mode()
    kept = [m for m in above if not isinstance(m, kinds)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in above:
            _push_mode(m)
