"""The row maxima kernel of the fixed-point scales (fa4dist/kernels/cute/row_absmax.py) on the GPU: the same values
as torch's infinity norm (exact: a max), NaN and inf propagating, or (finite_only) left out; and fixed_point's
maxima, which take it, equal to their torch forms."""

import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

from fa4dist.kernels import fixed_point  # noqa: E402
from fa4dist.kernels.cute.row_absmax import row_absmax  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _planted(dtype, shape, seed):
    """Random rows (wide range of magnitudes, signed zeros, subnormals) with NaN / inf planted in a few."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(shape, device="cuda", generator=g) * torch.logspace(-6, 4, shape[-1], device="cuda")
    t = t.to(dtype)
    flat = t.view(-1, shape[-1])
    flat[3, 5], flat[4, 0], flat[5, -1], flat[6, 2] = NAN, INF, -INF, -0.0
    flat[6, 7], flat[7] = NAN, 0.0  # a row with NaN and inf, a row of zeros
    flat[7, 1] = -INF
    flat[8] = torch.finfo(dtype).tiny / 4  # subnormals
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 333, 5, 128), (1000, 3, 64), (17, 256), (40, 8)])
def test_row_maxima_equal_torch(dtype, shape):
    t = _planted(dtype, shape, seed=sum(shape))
    want = torch.linalg.vector_norm(t.float(), float("inf"), dim=-1)
    got = row_absmax(t)
    assert got.dtype == dtype and got.shape == t.shape[:-1]
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0, equal_nan=True)
    finite = torch.linalg.vector_norm(t.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), float("inf"), dim=-1)
    torch.testing.assert_close(row_absmax(t, finite_only=True).float(), finite, rtol=0, atol=0)


def test_fixed_point_maxima_take_the_kernel_and_equal_torch():
    t = _planted(torch.bfloat16, (1, 2048, 4, 128), seed=5)
    want_rows = torch.linalg.vector_norm(t, float("inf"), dim=-1).double()
    torch.testing.assert_close(fixed_point.absmax(t, -1), want_rows, rtol=0, atol=0, equal_nan=True)
    finite = t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    want_heads = torch.linalg.vector_norm(finite, float("inf"), dim=(0, 1, 3)).double()
    assert torch.equal(fixed_point.head_absmax(t), want_heads)
    # a layout the kernel does not take (non-contiguous) gives the same values through torch
    assert torch.equal(fixed_point.head_absmax(t.transpose(1, 2).contiguous().transpose(1, 2)), want_heads)
