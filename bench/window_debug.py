"""Development check of the CuTe sliding-window kernels against the reference, one case per process (a hang
costs one case; bench/sessions/gpu_session_window.sh runs it):
    python bench/window_debug.py CASE      (fwd256, fwd1024, bwd1024, ...; see CASES)"""
import faulthandler
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fa4dist  # noqa: E402,F401  (registers the cute backend)
from fa4dist.kernels import attention_backward, attention_forward  # noqa: E402

CASES = {  # name: (direction, seqlen, window_left)
    "fwd256": ("fwd", 256, 255), "fwd1024": ("fwd", 1024, 255), "fwd4096": ("fwd", 4096, 1000),
    "bwd256": ("bwd", 256, 255), "bwd1024": ("bwd", 1024, 255), "bwd4096": ("bwd", 4096, 1000),
}


def main(name):
    faulthandler.dump_traceback_later(50, exit=True)
    direction, s, w = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, s, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    kw = dict(causal=True, window=(w, -1))
    ref_out, ref_lse = attention_forward(q.float(), k.float(), v.float(), backend="reference", **kw)
    t0 = time.time()
    if direction == "fwd":
        out, lse = attention_forward(q, k, v, backend="cute", **kw)
        torch.cuda.synchronize()
        err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        print(f"{name}: ok in {time.time() - t0:.1f}s rel err {err:.2e}", flush=True)
    else:
        ref = attention_backward(do.float(), q.float(), k.float(), v.float(), ref_out, ref_lse, backend="reference",
                                 **kw)
        got = attention_backward(do, q, k, v, ref_out.to(q.dtype), ref_lse, backend="cute", **kw)
        torch.cuda.synchronize()
        errs = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
        print(f"{name}: ok in {time.time() - t0:.1f}s rel errs {errs}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
