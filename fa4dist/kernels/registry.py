"""The backend registry: every single-GPU attention implementation registers here, and `attention_forward` /
`attention_backward` pick one by name or ("auto") by priority.

A backend is an object with:
  name: str
  priority: int                                   higher wins under "auto"
  fused_epilogue: bool                            True if it writes/merges into caller buffers itself
  fused_sinks: bool (optional)                    its forward takes sinks= into its epilogue when it writes a
                                                  result (not when merging into a running one)
  available(device) -> bool                       usable on this device at all (imports, hardware)
  supports(problem, direction) -> Unsupported | None
                                                  None if it computes this exact problem; else why not, and
                                                  whether the reference may stand in (a mask the kernel lacks)
                                                  or the input is simply out of its range (a head dim, a dtype)
  forward(problem, q, k, v[, out, lse, accumulate]) -> (out, lse)
  backward(problem, dout, q, k, v, out, lse, deterministic[, dq, dk, dv, accumulate]) -> (dq, dk, dv)
  lse_gradient: bool (optional)                   its backward takes dlse= (the lse's gradient, joined to the
                                                  row sums of dout * out); without it the contract runs one more
                                                  backward for it (api.lse_backward_operands; a fused-epilogue
                                                  backend must take it)
  forward_items / backward_items / shared_rows (optional)
                                                  a work list in few launches, and the query side many backward
                                                  lists share (fa4dist.kernels.worklist; None: the list loops
                                                  over the contract's calls).  backward_items and shared_rows
                                                  take dlse= where the backend has lse_gradient
  overlaps_previous: bool (optional)              its forward_items takes overlap_previous= (the caller's promise
                                                  that the work just before wrote none of q, k, v: its launches
                                                  may start while that work finishes)

Backends without a fused epilogue return fresh results; `fa4dist.kernels.api` writes or merges them into the
caller's buffers, and merges the attention sinks into them (a backend sees the sinks tensor only through
``fused_sinks``, else only ``problem.has_sinks``; a fused-epilogue backend's block is merged into the running fp32
result, or written in fp32, before the contract merges the sinks).  Masks (``problem.mask``: causal,
sliding window) and ``problem.softcap`` are the backend's to compute or refuse.  The contract checks what a
backend answers: ``supports`` (None or Unsupported) and the count, shapes and device of its results
(:func:`check_results`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .problem import AttentionProblem

log = logging.getLogger("fa4dist.kernels")



@dataclass(frozen=True)
class Unsupported:
    reason: str
    # True: a mask or layout the kernel cannot express; a named backend then falls back to the reference.
    # False: input outside the backend's range (head dim, dtype, device); asking for it by name is an error.
    fallback: bool = False


_BACKENDS: dict = {}
_FALLBACK_REPORTED: set = set()


_METHODS = ("available", "supports", "forward", "backward")


def register_backend(backend) -> None:
    """Adds ``backend`` (the interface in the module docstring) under its name, replacing one of that name.  It is
    checked here, once: a malformed one would otherwise fail inside every later "auto" call of every user."""
    if isinstance(backend, (str, type)) or backend is None:
        raise TypeError(f"register_backend takes a backend object (an instance with name, priority, "
                        f"fused_epilogue, {', '.join(_METHODS)}), got {type(backend).__name__}")
    name = getattr(backend, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a string, got {type(name).__name__}")
    if not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto' (which picks among them), got "
                         f"{name!r}")
    priority = getattr(backend, "priority", None)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"backend {name!r}: priority must be an int (higher wins under 'auto'), got "
                        f"{type(priority).__name__}")
    if not isinstance(getattr(backend, "fused_epilogue", None), bool):
        raise TypeError(f"backend {name!r}: fused_epilogue must be a bool, got "
                        f"{type(getattr(backend, 'fused_epilogue', None)).__name__}")
    for method in _METHODS:
        if not callable(getattr(backend, method, None)):
            raise TypeError(f"backend {name!r}: {method} must be a method (see fa4dist.kernels.registry)")
    current = _BACKENDS.get("reference")
    if name == "reference" and current is not None and type(backend) is not type(current):
        raise ValueError("'reference' is the registry's fallback (and the tests' oracle): register your backend "
                         "under a name of its own")
    _BACKENDS[name] = backend


def check_results(backend, direction: str, results, expected: dict, device, skipped: tuple = ()) -> tuple:
    """A backend's ``forward`` / ``backward`` results as a tuple, checked against ``expected`` (name -> shape, in
    order; names in ``skipped`` may be None: gradients not asked for).  The contract copies, adds or merges them
    into the caller's buffers, where a wrong shape that broadcasts (an lse of one column, a dk of one head) was
    taken silently, and a missing result was dropped by the zip."""
    names = ", ".join(expected)
    try:
        results = tuple(results)
    except TypeError:
        raise TypeError(f"backend {backend.name!r}: {direction} must return ({names}), got "
                        f"{type(results).__name__}") from None
    if len(results) != len(expected):
        raise TypeError(f"backend {backend.name!r}: {direction} must return ({names}), got {len(results)} results")
    for (name, shape), t in zip(expected.items(), results):
        if t is None and name in skipped:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"backend {backend.name!r}: {direction} returned {name} as {type(t).__name__}, expected "
                            "a tensor")
        if tuple(t.shape) != tuple(shape) or t.device != device:
            raise ValueError(f"backend {backend.name!r}: {direction} returned {name} of shape {tuple(t.shape)} on "
                             f"{t.device}, expected {tuple(shape)} on {device}")
    return results


def get_backend(name: str):
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be 'auto' or one of {sorted(_BACKENDS)}, got {name!r}") from None


def available_backends(device) -> list[str]:
    """Names of the backends usable on `device`, best first."""
    ordered = sorted(_BACKENDS.values(), key=lambda b: -b.priority)
    return [b.name for b in ordered if b.available(device)]


def _supports(backend, problem: AttentionProblem, direction: str):
    if problem.cp_invariant and not getattr(backend, "cp_invariant", False):
        return Unsupported("cp_invariant needs a backend whose arithmetic per row and per key does not depend on the "
                           "rest of the call", fallback=True)
    answer = backend.supports(problem, direction)
    if answer is not None and not isinstance(answer, Unsupported):  # False or a reason string would read as "no"
        raise TypeError(f"backend {backend.name!r}: supports() must return None or Unsupported, got "
                        f"{type(answer).__name__}")
    return answer


def check_backend(name, device):
    """The backend a call names, if it can run on ``device`` at all ("auto": None); else the error.  A call that has
    nothing to compute (an empty batch) still checks it, so a misspelt name fails at once, not on the first batch
    that holds a sequence."""
    if isinstance(name, str) and name == "auto":
        return None
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    backend = get_backend(name)
    if not backend.available(device):
        why = getattr(backend, "unavailable_reason", None)  # (optional: a backend that can say what is missing)
        why = why(device) if why is not None else None
        raise ValueError(f"backend {name!r} is not available on device {device}" + (f": {why}" if why else ""))
    return backend


def select_backend(name: str, problem: AttentionProblem, direction: str):
    """Returns the backend that computes `problem`.

    "auto" takes the highest-priority backend that supports it.  A named backend that cannot express this exact
    problem (a mask its kernel lacks, say) falls back to the reference and says so once through `logging`; one
    that cannot run on this device at all is an error."""
    if name == "auto":
        for backend in sorted(_BACKENDS.values(), key=lambda b: -b.priority):
            if backend.available(problem.device) and _supports(backend, problem, direction) is None:
                return backend
        raise ValueError(f"no attention backend supports this call: {problem}")
    backend = check_backend(name, problem.device)
    unsupported = _supports(backend, problem, direction)
    if unsupported is None:
        return backend
    if not unsupported.fallback:
        raise ValueError(f"backend {name!r} cannot compute this call: {unsupported.reason}")
    fallback = _BACKENDS["reference"]
    reason = unsupported.reason
    key = (name, direction, reason)
    if key not in _FALLBACK_REPORTED:
        _FALLBACK_REPORTED.add(key)
        log.warning("fa4dist: backend %r cannot do this %s call (%s); using the reference backend", name, direction,
                    reason)
    return fallback
