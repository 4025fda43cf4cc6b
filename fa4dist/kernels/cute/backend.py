"""Registry adapter: exposes the Hopper CuTe DSL forward as backend "cute" of fa4dist.kernels.

The backend has a fused epilogue (it writes, or in accumulate mode merges, straight into the caller's buffers)
and no backward yet: backward calls fall back (auto picks the next backend; naming "cute" uses the reference).
"""

from __future__ import annotations



import torch

from . import interface as _impl


class CuteSm90Backend:
    name = "cute"
    priority = 30  # above "sdpa" (20): chosen by "auto" wherever it supports the call
    fused_epilogue = True

    def available(self, device) -> bool:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device)
        return major == 9 and _impl.cutlass_importable()

    def supports(self, problem, direction: str):
        from ..registry import Unsupported

        if direction != "forward":
            return Unsupported("the cute backend has no backward kernel yet", fallback=True)
        if problem.device.type != "cuda":
            return Unsupported(f"cute runs on CUDA tensors only, got {problem.device}")
        if problem.dtype not in (torch.bfloat16, torch.float16):
            return Unsupported(f"cute takes float16 or bfloat16, got {problem.dtype}")
        if problem.head_dim != problem.head_dim_v or problem.head_dim not in _impl.SUPPORTED_HEAD_DIMS:
            return Unsupported(
                f"cute supports head dims {_impl.SUPPORTED_HEAD_DIMS} with equal q/k/v head dims, "
                f"got {problem.head_dim}/{problem.head_dim_v}"
            )
        if problem.causal:
            for qo, ko in zip(problem.q_offsets, problem.k_offsets):
                if abs(qo - ko) > 2**30:
                    return Unsupported("q_offset - k_offset beyond int32 range")
        return None

    @staticmethod
    def _kernel_ready(t: torch.Tensor, elems: int) -> bool:
        return (
            t.stride(-1) == 1
            and all(s % elems == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0
        )

    def forward(self, problem, q, k, v, out=None, lse=None, accumulate=False):
        # TMA needs 16-byte aligned strides and a contiguous head dim: copy odd layouts once
        q, k, v = (t if self._kernel_ready(t, 8) else t.contiguous() for t in (q, k, v))
        if out is None:
            out = torch.empty(problem.out_shape(), dtype=q.dtype, device=q.device)
        if lse is None:
            lse = torch.empty(problem.lse_shape(), dtype=torch.float32, device=q.device)
        out_k = out if self._kernel_ready(out, 16 // out.element_size()) else out.contiguous()
        lse_k = lse if lse.stride(-1) == 1 else lse.contiguous()
        if problem.causal and not problem.uniform_offsets:
            q_off, k_off = problem.q_offsets, problem.k_offsets
        else:
            q_off, k_off = problem.q_offsets[0], problem.k_offsets[0]
        _impl.forward(
            q, k, v, out_k, lse_k,
            softmax_scale=problem.softmax_scale, causal=problem.causal, q_offset=q_off, k_offset=k_off,
            cu_seqlens_q=problem.cu_seqlens_q_tensor, cu_seqlens_k=problem.cu_seqlens_k_tensor,
            max_seqlen_q=problem.seqlen_q if problem.varlen else None,
            max_seqlen_k=problem.seqlen_k if problem.varlen else None,
            accumulate=accumulate,
        )
        if out_k is not out:
            out.copy_(out_k)
        if lse_k is not lse:
            lse.copy_(lse_k)
        return out, lse

    def backward(self, *args, **kwargs):  # pragma: no cover - supports() routes backward elsewhere
        raise NotImplementedError("the cute backend has no backward kernel yet")


_REGISTERED = False


def register() -> None:
    """Registers backend "cute" with fa4dist.kernels (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from ..registry import register_backend

    register_backend(CuteSm90Backend())
    _REGISTERED = True



