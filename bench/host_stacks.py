"""Where a short attention step's host time goes, down to torch's C++ frames: a loop of forward+backward calls for
py-spy to sample (``--native``: Python and C/C++ frames together), and a summary of its samples.

bench/host_python.py separates the parts (RESULTS.md, forty-second session: at 16 x 1k, hdim 128, causal, our
Python ~250 us per forward+backward, torch's work on CUDA tensors ~560 us, the launches ~280 us); this names the
frames inside torch's part. On the GPU machine (py-spy from .devwheels/extra), attached once the loop is warm
(sampled from the start with ``--native``, the forty-second session's run spent its time limit in imports and
compiles: py-spy stops the process for every native unwind):

    python3 bench/host_stacks.py --seconds 40 --ready-file /tmp/ready [--backend flash_attn_4] &
    while [ ! -s /tmp/ready ]; do sleep 1; done
    py-spy record --pid $(cat /tmp/ready) --native --threads --idle --format raw --rate 200 --duration 20 \\
        -o stacks.txt
    python3 bench/host_stacks.py --summarize stacks.txt [--top 40]

The summary lists, per thread, the functions with the most samples in total (the function or anything it called)
and the frames (with their line) with the most on their own (the innermost frame), as percentages of that thread's
samples.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def loop(args) -> None:
    import torch

    from calls import make_calls  # noqa: E402  (bench/, the script's folder; puts the repository on the path)
    from types import SimpleNamespace

    problem = SimpleNamespace(seqlen=args.seqlen, batch=16384 // args.seqlen, heads=2048 // args.headdim,
                              kv_heads=None, headdim=args.headdim, causal=True, mode="plain", cudnn=True)
    calls, dout, leaves = make_calls(problem, deterministic=False, with_leaves=True)
    fn = calls[{"cute": "ours", "flash_attn_4": "flash-attn-4"}.get(args.backend, args.backend)]

    def step():
        for t in leaves:
            t.grad = None
        fn().backward(dout)

    for _ in range(20):  # compiles and warm caches before the sampled part
        step()
    torch.cuda.synchronize()
    if args.ready_file:  # a sampler attached by pid starts now (the compiles and imports stay out of its samples)
        with open(args.ready_file, "w") as fh:
            fh.write(str(os.getpid()))
    end = time.perf_counter() + args.seconds
    i = 0
    while i < args.calls or time.perf_counter() < end:
        step()
        i += 1
        if i % 200 == 0:  # (bounded queue: the host's time, not a full launch queue's waits, is sampled)
            torch.cuda.synchronize()
    torch.cuda.synchronize()


_FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")


def _short(frame: str, line: bool = True) -> str:
    """``name (file[:line])`` with the file's folder dropped (and the line, for totals per function)."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    name, where = m.group("name"), m.group("where")
    file, _, lineno = where.partition(":")
    return f"{name} ({os.path.basename(file)}{':' + lineno if line and lineno else ''})"


def summarize(path: str, top: int) -> None:
    per_thread_total = collections.Counter()
    inclusive = collections.defaultdict(collections.Counter)
    own = collections.defaultdict(collections.Counter)
    with open(path) as fh:
        for line in fh:
            line = line.rstrip("\n")
            if not line or " " not in line:
                continue
            stack, count = line.rsplit(" ", 1)
            count = int(count)
            frames = stack.split(";")
            thread, frames = (frames[0], frames[1:]) if frames[0].startswith(("thread", "process")) else ("all", frames)
            per_thread_total[thread] += count
            for f in {_short(f, line=False) for f in frames}:
                inclusive[thread][f] += count
            if frames:
                own[thread][_short(frames[-1])] += count
    for thread, total in per_thread_total.most_common():
        print(f"== {thread}: {total} samples")
        for title, table in (("total (frame and callees)", inclusive[thread]), ("own", own[thread])):
            print(f"-- {title}")
            for frame, n in table.most_common(top):
                print(f"{100 * n / total:6.1f}%  {frame[:160]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--seconds", type=float, default=0.0, help="loop at least this long after the warm-up")
    p.add_argument("--ready-file", help="write the pid here once warm (for py-spy record --pid)")
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--backend", default="cute", help="cute | flash_attn_4 | cudnn (bench/calls.py's names)")
    p.add_argument("--summarize", metavar="STACKS", help="summarize py-spy's raw output instead of running")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        loop(args)


if __name__ == "__main__":
    main()
