"""A training step's attention (forward+backward through autograd) eager against replayed from a CUDA graph: ours,
flash-attn-4 (when installed) and torch SDPA's cuDNN backend, per step queued back to back. Short sequences are
host bound (bench/RESULTS.md, fortieth session: ours ~1.1 ms of host per forward+backward at 16 x 1k, the kernels
~0.64 ms); a replay issues the captured launches without the host work, so eager / graph is what the host costs.

    python bench/cuda_graphs.py                                  # S 1k / 2k / 4k, hdim 128 / 64, causal
    python bench/cuda_graphs.py --seqlens 1024 --headdims 128 --deterministic
    python bench/cuda_graphs.py --seqlens 1024 2048 --layer --compiled [--profile]   # torch.compile's graphs too

``--compiled`` times the attention alone under ``torch.compile(mode="reduce-overhead")``; ``--layer`` a QKV
projection + attention + loss step eager against compiled (each point compiled for its static shapes);
``--profile`` prints torch.profiler tables of the layer's eager and compiled steps after all timings.
``--calling-thread`` also times each eager step with autograd's backward on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``) in the same rounds: a CUDA backward otherwise runs on autograd's
device thread, and on a host-bound step that hand-off and the two threads' alternation cost host time
(bench/RESULTS.md, forty-fourth session).

Sizes as bench/kernels.py: batch = total_tokens / S, heads = model_dim / hdim, bf16. A backend whose step cannot be
captured is reported as such (its error), not timed. Writes <out-dir>/<date>-cuda-graphs.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calls import make_calls  # noqa: E402  (bench/, the script's folder)

import fa4dist  # noqa: E402  (after calls, which puts the repository on the path)


def queued_us(fn, calls: int) -> float:
    """Microseconds per call of ``calls`` calls queued back to back (one synchronize at the end): the larger of
    the host's and the device's time per call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def capture(step, leaves):
    """(graph, the step's static result): a CUDA graph of ``step()`` (torch's recipe: warm-up calls on a side
    stream for the compiles and allocator pools, the leaves' gradients cleared, then one captured call); its replays
    write the same static gradients. tests/kernels/test_cuda_graphs_gpu.py captures with it too."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def attention_layer(batch: int, seqlen: int, heads: int, d: int, causal: bool, deterministic: bool, device="cuda"):
    """(layer(x) -> scalar loss, x, params): a QKV projection, fa4dist.attention and a squared-mean loss, bf16. Under
    torch.compile every input of the attention is made inside the compiled function (torch's graphs copy only x),
    where ``--compiled``'s attention-alone form had q, k, v and dout copied in on every replay."""
    torch.manual_seed(0)
    dim = heads * d
    proj = torch.nn.Linear(dim, 3 * dim, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(batch, seqlen, dim, device=device, dtype=torch.bfloat16)
    det = {"deterministic": True} if deterministic else {}

    def layer(x):
        q, k, v = proj(x).view(batch, seqlen, 3, heads, d).unbind(2)
        return fa4dist.attention(q, k, v, causal=causal, **det).float().square().mean()

    return layer, x, list(proj.parameters())


def profile_steps(label: str, step, steps: int = 5) -> None:
    """torch.profiler over ``steps`` calls of ``step``: the kernels by GPU time, the CUDA graph launches and
    torch.compile's cudagraph skips (why a compiled step might replay no graph)."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    print(f"--- {label}: {steps} steps, {launches} cudaGraphLaunch, inductor's cudagraph counters {skips}")
    print(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


def layer_rows(args, seqlen: int, d: int, to_profile: list) -> list[dict]:
    """Ours in attention_layer, a training step eager against torch.compile(mode="reduce-overhead") (its own CUDA
    graphs), in interleaved rounds."""
    batch, heads = max(args.total_tokens // seqlen, 1), args.model_dim // d
    layer, x, params = attention_layer(batch, seqlen, heads, d, args.causal, args.deterministic)
    # dynamic=False: each point compiles for its own shapes (a second point's shapes otherwise recompile the same
    # code with dynamic sizes, whose generated kernels ran 4-5x slower: a benchmark artifact, not the attention's)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True, dynamic=False)
    steps = {}
    for name, fn in (("eager", layer), ("reduce-overhead", compiled)):
        def step(fn=fn):
            for t in params:
                t.grad = None
            fn(x).backward()

        for _ in range(3):  # (the compiled one: warm-up, record, replay)
            step()
        steps[name] = step
    samples = {name: [] for name in (*steps, "calling thread")}
    for _ in range(args.rounds):
        for name, step in steps.items():
            samples[name].append(queued_us(step, args.calls))
        if args.calling_thread:
            with torch.autograd.set_multithreading_enabled(False):
                samples["calling thread"].append(queued_us(steps["eager"], args.calls))
    eager, graphed, calling = (sorted(x)[len(x) // 2] if x else None for x in samples.values())
    shown = f" {calling:15.1f}" if calling is not None else ""
    print(f"{seqlen:>6} {d:>4} {'ours, layer':>14} {eager:10.1f} {graphed:10.1f} {eager / graphed:12.2f}{shown}")
    if args.profile:  # (profiled after every timing: the profiler's CUPTI hooks slowed later eager launches)
        to_profile.extend((f"layer S={seqlen} d={d} {name}", step) for name, step in steps.items())
    return [dict(seqlen=seqlen, headdim=d, batch=batch, heads=heads, causal=args.causal,
                 deterministic=args.deterministic, backend="ours, QKV projection + attention + loss",
                 eager_us=eager, graph_us=graphed, eager_over_graph=eager / graphed, graph="torch.compile",
                 **({"eager_calling_thread_us": calling} if calling is not None else {}))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--headdims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--deterministic", action="store_true", help="deterministic backwards (ours and flash-attn-4)")
    p.add_argument("--compiled", action="store_true",
                   help="also ours under torch.compile(mode='reduce-overhead'), whose own CUDA graphs replay it")
    p.add_argument("--layer", action="store_true",
                   help="also ours in a layer (QKV projection, attention, loss): eager against "
                        "torch.compile(mode='reduce-overhead')")
    p.add_argument("--profile", action="store_true",
                   help="with --layer: torch.profiler tables of 5 eager and 5 compiled steps (kernels, graph launches)")
    p.add_argument("--calling-thread", action="store_true",
                   help="also time each eager step with autograd's backward on the calling thread")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point (median reported)")
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--model-dim", type=int, default=2048)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_graphs.py needs a CUDA GPU")
    rows, to_profile = [], []
    thread_col = f" {'calling thread':>15}" if args.calling_thread else ""
    print(f"{'S':>6} {'d':>4} {'backend':>14} {'eager us':>10} {'graph us':>10} {'eager/graph':>12}{thread_col}")
    for seqlen in args.seqlens:
        for d in args.headdims:
            problem = SimpleNamespace(seqlen=seqlen, batch=max(args.total_tokens // seqlen, 1),
                                      heads=args.model_dim // d, kv_heads=None, headdim=d, causal=args.causal,
                                      mode="deterministic" if args.deterministic else "plain", cudnn=True)
            if args.layer:
                rows += layer_rows(args, seqlen, d, to_profile)
            calls, dout, leaves = make_calls(problem, deterministic=args.deterministic, with_leaves=True)
            if args.compiled:  # ours under torch.compile's CUDA graphs (cudagraph trees): no capture of our own
                det = {"deterministic": True} if args.deterministic else {}
                traced = torch.compile(lambda q, k, v: fa4dist.attention(q, k, v, causal=args.causal, **det),
                                       mode="reduce-overhead", fullgraph=True, dynamic=False)
                calls["ours, reduce-overhead"] = lambda: traced(*leaves)
            timed = {}
            for name, fn in calls.items():
                def step(fn=fn):  # (fresh gradients each step, as the captured one makes: no accumulating add)
                    for t in leaves:
                        t.grad = None
                    fn().backward(dout)

                row = dict(seqlen=seqlen, headdim=d, batch=problem.batch, heads=problem.heads, causal=args.causal,
                           deterministic=args.deterministic, backend=name)
                if name.endswith("reduce-overhead"):  # torch replays its own graphs: timed as called
                    for _ in range(3):
                        step()
                    timed[name] = (row, step, None)
                    continue
                try:
                    graph, _ = capture(step, leaves)
                    timed[name] = (row, step, graph.replay)
                except Exception as exc:  # one backend that cannot be captured must not hide the others
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    torch.cuda.synchronize()
                    timed[name] = (row, step, None)
            samples = {name: ([], [], []) for name in timed}
            for _ in range(args.rounds):
                for name, (row, step, replay) in timed.items():
                    samples[name][0].append(queued_us(step, args.calls))
                    if replay is not None:
                        samples[name][1].append(queued_us(replay, args.calls))
                    if args.calling_thread and replay is not None:
                        with torch.autograd.set_multithreading_enabled(False):
                            samples[name][2].append(queued_us(step, args.calls))
            for name, (row, _, _) in timed.items():
                eager, graph, calling = (sorted(x)[len(x) // 2] if x else None for x in samples[name])
                row.update(eager_us=eager, graph_us=graph, eager_over_graph=eager / graph if graph else None)
                if calling is not None:
                    row["eager_calling_thread_us"] = calling
                rows.append(row)
                shown = (f"{graph:10.1f} {eager / graph:12.2f}" if graph else
                         f"{'-':>10} {'(torch graphs)' if name.endswith('overhead') else '(not captured)':>12}")
                shown += f" {calling:15.1f}" if calling is not None else ""
                print(f"{seqlen:>6} {d:>4} {name:>14} {eager:10.1f} {shown}")
    for label, step in to_profile:
        profile_steps(label, step)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{datetime.date.today().isoformat()}-cuda-graphs.json")
    with open(path, "w") as fh:
        json.dump(dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
