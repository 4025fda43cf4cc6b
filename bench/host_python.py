"""The Python host cost of ``fa4dist.attention(backend="cute")`` with the compiled kernels' launches replaced by
no-ops: on CPU tensors (the default, no GPU needed) what is timed is the contract, autograd and the cute backend's
own Python (validation, configs, launch setup); with ``--device cuda`` on a GPU machine also what torch's work
costs on CUDA tensors (allocations, fills, autograd's device thread). bench/RESULTS.md, forty-second session, on
the H100 machine at 1k: ~250 us per forward+backward on CPU tensors, ~810 on CUDA tensors, ~1090 with the launches
(bench/host_profile.py); flash-attn-4's whole host time ~430. Prints the best of several timed loops and the Python
calls per call (cProfile's count), and first what the cute backend's ``supports`` and ``available`` cost per call,
remembered and computed (not no-op'd there).

    python bench/host_python.py                      # 1 x 1k x 2 heads of 128, causal (the sizes do not matter)
    python bench/host_python.py --profile tottime    # and cProfile's table of the forward, then of forward+backward
    python bench/host_python.py --device cuda        # on a GPU machine: torch's own work on CUDA tensors too
    python bench/host_python.py --device cuda --launches real   # and the launches: the whole host time
    python bench/host_python.py --device cuda --direct --profile tottime   # the contract's calls without autograd
    python bench/host_python.py --device cuda --layers 8   # 8 chained calls, one backward: the per-layer cost
    python bench/host_python.py --device cuda --layers 8 --timeline   # and where in the backward the time sits

``--autograd-thread off`` runs autograd's backward on the calling thread (torch.autograd.set_multithreading_enabled),
which takes the hand-off to its device thread out of the time and puts the backward into cProfile's view. A bare
autograd.Function (identity forward, identity backward) on the same tensors is timed first, in the same mode: the
floor any Python autograd.Function pays.

``--direct`` times ``attention_forward`` and ``attention_backward`` called as functions: no autograd, so the
backward runs on the calling thread (autograd runs a CUDA backward on its device thread, which cProfile does not
see), and its profile shows what the backward's own host path costs on CUDA tensors.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import fa4dist  # noqa: E402
from fa4dist.kernels.cute import backend as cute_backend  # noqa: E402
from fa4dist.kernels.cute import host  # noqa: E402


def no_op_launches(cpu_tensors: bool) -> None:
    """Every compiled kernel becomes a no-op (a 132-SM GPU assumed); on CPU tensors the cute backend also takes the
    call (its device checks answer yes)."""
    host.get_compiled = lambda cfg: (lambda *args: None)
    host.sm_count = lambda *args, **kwargs: 132
    if cpu_tensors:
        cute_backend.CuteSm90Backend.available = lambda self, device: True
        cute_backend.CuteSm90Backend.supports = lambda self, problem, direction: None


def best_us(fn, calls: int, loops: int) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def python_calls(fn, calls: int) -> tuple[float, str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    return stats.total_calls / calls, stats


class Identity(torch.autograd.Function):
    """A bare autograd.Function: what any Python Function's forward+backward costs around its own work."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class BackwardRecorder:
    """Wraps fa4dist.attention's autograd backward so that its body's own time adds up (``seconds``, ``calls``) on
    whichever thread autograd runs it (its device thread for CUDA tensors), and, while ``events`` is a list, appends
    each body's (start, end) perf_counter pair to it: the timeline of one backward pass."""

    def __init__(self):
        from fa4dist.kernels import autograd as fa4_autograd

        body = fa4_autograd._AttentionFunction.backward
        self.seconds, self.calls, self.events = 0.0, 0, None

        def timed_backward(ctx, *grads):
            t0 = time.perf_counter()
            try:
                return body(ctx, *grads)
            finally:
                t1 = time.perf_counter()
                self.seconds += t1 - t0
                self.calls += 1
                if self.events is not None:
                    self.events.append((t0, t1))

        fa4_autograd._AttentionFunction.backward = staticmethod(timed_backward)

    def reset(self):
        self.seconds, self.calls = 0.0, 0


def backward_timeline(forward, grad, recorder: BackwardRecorder, steps: int) -> str:
    """Medians over ``steps`` chained forward+backward passes of when each layer's backward body starts and ends,
    in us from the moment ``torch.autograd.grad`` is called, and when it returns: where a pass's time sits (in the
    bodies, between them, or before the first and after the last)."""
    rows = []
    for _ in range(steps):
        x = forward()
        recorder.events = []
        t0 = time.perf_counter()
        grad(x)
        t_end = time.perf_counter()
        rows.append([(a - t0, b - t0) for a, b in recorder.events] + [(t_end - t0, t_end - t0)])
    recorder.events = None

    def median_us(values):
        return sorted(values)[len(values) // 2] * 1e6

    cols = list(zip(*rows))
    parts = [f"body {i + 1} {median_us([a for a, _ in c]):.0f}-{median_us([b for _, b in c]):.0f}"
             for i, c in enumerate(cols[:-1])]
    return ", ".join(parts + [f"returns {median_us([a for a, _ in cols[-1]]):.0f}"])


def backend_choice(args) -> None:
    """What the cute backend's two questions cost per call (the contract asks both on every forward and backward):
    ``supports`` remembered against computed, on a problem placed on "cuda" (a fresh but equal problem each call,
    as the contract makes), and ``available`` remembered against asked of torch (on a GPU machine: its device
    queries)."""
    from dataclasses import replace

    from fa4dist.kernels.problem import validate_inputs

    be = cute_backend.CuteSm90Backend()
    q = torch.zeros(1, args.seqlen, args.heads, args.headdim, dtype=torch.bfloat16, device="meta")
    device = torch.device("cuda", 0)
    problem = replace(validate_inputs(q, q, q, causal=args.causal), device=device)
    rows = {
        "an equal problem made (in both supports rows)": lambda: replace(problem),
        "supports, remembered": lambda: be.supports(replace(problem), "backward"),
        "supports, computed": lambda: be._supports(replace(problem), "backward"),
        "available, remembered": lambda: be.available(device),
        "available, asked of torch": lambda: be.unavailable_reason(device) is None,
    }
    print("; ".join(f"{name} {best_us(fn, args.calls, args.loops):.1f} us" for name, fn in rows.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=1,
                   help="forward+backward through this many chained calls (one backward pass): what a model pays "
                        "per layer, against the one-call step's once-per-backward costs (times are per call chain)")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--calls", type=int, default=1500)
    p.add_argument("--loops", type=int, default=7)
    p.add_argument("--profile", choices=("tottime", "cumulative", "ncalls"), help="print cProfile's table too")
    p.add_argument("--launches", choices=("no-op", "real"), default="no-op",
                   help="real (with --device cuda): the kernels run, so the step's whole host time is timed (at the "
                        "default sizes the GPU keeps up with the host)")
    p.add_argument("--autograd-thread", choices=("on", "off"), default="on",
                   help="off: autograd's backward on the calling thread, not its device thread")
    p.add_argument("--timeline", action="store_true",
                   help="and when each chained call's backward body starts and ends within the backward pass")
    p.add_argument("--direct", action="store_true",
                   help="call the contract's attention_forward / attention_backward directly (no autograd)")
    p.add_argument("--device", default="cpu",
                   help="where the tensors live: 'cuda' on a GPU machine keeps torch's own work on CUDA tensors "
                        "(allocations, fills, autograd's gradient adds) and no-ops only our kernels' launches, "
                        "which separates their cost from the rest of the host time")
    args = p.parse_args(argv)
    backend_choice(args)
    if args.launches == "real" and args.device == "cpu":
        p.error("--launches real needs --device cuda")
    if args.launches == "no-op":
        no_op_launches(cpu_tensors=args.device == "cpu")
    shape = (1, args.seqlen, args.heads, args.headdim)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device=args.device, requires_grad=True) for _ in range(3))
    dout = torch.ones(shape, dtype=torch.bfloat16, device=args.device)
    opts = dict(causal=args.causal, backend="cute", deterministic=args.deterministic)

    def forward():
        with torch.no_grad():
            return fa4dist.attention(q, k, v, **opts)

    # each chained call has its own k and v, as a model's layers do (shared ones would add their gradients)
    layer_kv = [(k, v)] + [tuple(t.detach().clone().requires_grad_() for t in (k, v)) for _ in range(args.layers - 1)]
    leaves = (q, *(t for kv in layer_kv for t in kv))

    def chained_forward():
        x = q
        for lk, lv in layer_kv:  # (each call's out is the next one's q: one backward through all of them)
            x = fa4dist.attention(x, lk, lv, **opts)
        return x

    def chained_grad(x):
        torch.autograd.grad(x, leaves, dout)

    def forward_backward():
        chained_grad(chained_forward())

    def bare_forward_backward():
        x = q
        for _ in range(args.layers):
            x = Identity.apply(x)
        torch.autograd.grad(x, (q,), dout)

    per_layers = f" of {args.layers} chained calls" if args.layers > 1 else ""
    calls = (("forward", forward), (f"forward+backward{per_layers}", forward_backward))
    if args.direct:
        from fa4dist.kernels import attention_backward, attention_forward

        plain = [t.detach() for t in (q, k, v)]
        fwd_opts = {n: x for n, x in opts.items() if n != "deterministic"}
        out, lse = attention_forward(*plain, **fwd_opts)
        calls = (("attention_forward", lambda: attention_forward(*plain, **fwd_opts)),
                 ("attention_backward", lambda: attention_backward(dout, *plain, out, lse, **opts)))
    calls = ((f"bare autograd.Function, forward+backward{per_layers}", bare_forward_backward),) + calls
    torch.autograd.set_multithreading_enabled(args.autograd_thread == "on")
    recorder = BackwardRecorder()
    for name, fn in calls:
        recorder.reset()
        us = best_us(fn, args.calls, args.loops)
        if args.device != "cpu":
            torch.cuda.synchronize()  # (the fills and adds torch launched are queued: time the host's part only)
        body_us = (f", the autograd backward's body {recorder.seconds / recorder.calls * 1e6:.1f} us a call"
                   if recorder.calls else "")
        count, stats = python_calls(fn, 500)
        print(f"{name}: {us:.1f} us per call (best of {args.loops} x {args.calls}), {count:.0f} Python calls"
              f"{body_us}")
        if args.profile and name.startswith(("forward", "attention_")):
            stats.stream = sys.stdout
            stats.sort_stats(args.profile).print_stats(40)
    if args.timeline and not args.direct:
        print(f"backward timeline (us from torch.autograd.grad's call, medians of {args.calls}): "
              + backward_timeline(chained_forward, chained_grad, recorder, args.calls))


if __name__ == "__main__":
    main()
