"""Sixty-sixth session's probe (calls 7 and 8): a batch of 65536 dense / 70000 packed 8-token sequences through the
CuTe forward and backward, the first 64 sequences' gradients against the reference. Before row_tile_grid the
backward's pre- and postprocess put the sequences on the grid's z (at most 65535) and CUDA refused the launch.

    source .devwheels/install.sh && python3 bench/sessions/s66_grid_probe.py
"""
import torch

from fa4dist.kernels import attention_backward, attention_forward

for b, s, packed in ((65536, 8, False), (70000, 8, True)):
    torch.manual_seed(0)
    try:
        if packed:
            q, k, v = (torch.randn(b * s, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
            kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        else:
            q, k, v = (torch.randn(b, s, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            kw = dict(causal=True)
        out, lse = attention_forward(q, k, v, backend="cute", **kw)
        do = torch.randn_like(out)
        dq, dk, dv = attention_backward(do, q, k, v, out, lse, backend="cute", **kw)
        torch.cuda.synchronize()
        # check a slice against the reference on the same rows
        n = 64
        sl = (slice(0, n * s),) if packed else (slice(0, n),)
        kw2 = dict(kw)
        if packed:
            kw2["cu_seqlens_q"] = kw2["cu_seqlens_k"] = cu[: n + 1]
        r = attention_backward(do[sl].double().cpu(), q[sl].double().cpu(), k[sl].double().cpu(), v[sl].double().cpu(),
                               out[sl].double().cpu(), lse[(slice(None),) + sl if packed else sl].cpu().double(),
                               backend="reference",
                               **{a: (c.cpu() if torch.is_tensor(c) else c) for a, c in kw2.items()})
        err = max(float((x[sl].double().cpu() - y).abs().max()) for x, y in zip((dq, dk, dv), r))
        print(b, s, packed, "ok, first rows' grad err", err, "tail finite", bool(torch.isfinite(dq[-8:]).all()))
    except Exception as e:
        print(b, s, packed, "FAILED:", type(e).__name__, str(e)[:300])
