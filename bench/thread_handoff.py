"""Python work handed between two threads, as autograd's device thread and the caller hand a backward back and
forth: what a hand-off costs and how much slower the same work runs right after one (bench/RESULTS.md, forty-fourth
session: on the H100 machine a chain of 8 attention calls ran its backward bodies 15-25% slower on the device
thread, and the next forwards on the calling thread slower too; the suspect is the threads' alternation itself).

The work is the contract's input validation (``validate_inputs`` 8 times on a 1k x 2 x 128 problem, ~90 us on
this repository's CPU machine), CPU tensors only (no GPU needed).

    python bench/thread_handoff.py            # best of --loops; medians of the timed work
    python bench/thread_handoff.py --pin      # both threads on one core (os.sched_setaffinity), where the OS allows

Prints: two works on one thread; a work, a hand-off to a second thread that runs the work, and a hand-off back;
the work's own time on each thread in that alternation against alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from fa4dist.kernels.problem import validate_inputs  # noqa: E402

Q = torch.zeros(1, 1024, 2, 128, dtype=torch.bfloat16)


def work() -> float:
    t0 = time.perf_counter()
    for _ in range(8):
        validate_inputs(Q, Q, Q, causal=True)
    return time.perf_counter() - t0


class Partner:
    """A second thread that runs ``work`` each time it is handed the turn, and hands it back."""

    def __init__(self, pin_to=None):
        self.go, self.done, self.stop, self.times = threading.Event(), threading.Event(), False, []
        self.thread = threading.Thread(target=self._run, args=(pin_to,), daemon=True)
        self.thread.start()

    def _run(self, pin_to):
        if pin_to is not None:
            os.sched_setaffinity(0, pin_to)  # (0: this thread, on Linux)
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            self.times.append(work())
            self.done.set()

    def turn(self):
        self.go.set()
        self.done.wait()
        self.done.clear()

    def close(self):
        self.stop = True
        self.go.set()
        self.thread.join()


def median_us(values) -> float:
    return sorted(values)[len(values) // 2] * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--loops", type=int, default=3)
    p.add_argument("--pin", action="store_true", help="both threads on the calling thread's first allowed core")
    args = p.parse_args(argv)
    pin_to = None
    if args.pin:
        pin_to = {min(os.sched_getaffinity(0))}
        os.sched_setaffinity(0, pin_to)
    partner = Partner(pin_to)
    for _ in range(200):
        work()
        partner.turn()
    best = {"two works, one thread": [], "work, hand-off, work, hand-off": []}
    mine = []
    for _ in range(args.loops):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            work()
            work()
        best["two works, one thread"].append((time.perf_counter() - t0) / args.calls)
        partner.times.clear()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            mine.append(work())
            partner.turn()
        best["work, hand-off, work, hand-off"].append((time.perf_counter() - t0) / args.calls)
    alone = [work() for _ in range(args.calls)]
    partner.close()
    print(f"{os.cpu_count()} CPUs, {'pinned to one core' if args.pin else 'unpinned'}, best of {args.loops} x "
          f"{args.calls}")
    for name, values in best.items():
        print(f"  {name}: {min(values) * 1e6:.1f} us")
    print(f"  the work alone {median_us(alone):.1f} us; in the alternation: calling thread {median_us(mine):.1f} us, "
          f"partner {median_us(partner.times):.1f} us (medians)")


if __name__ == "__main__":
    main()
