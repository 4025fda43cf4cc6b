"""The exp2 cubic of the kernels (cute.common_sm90.exp2_poly, the backward's exp2_poly_every) evaluated by a float32
mirror of its PTX on the CPU: relative error, the exact zero of masked scores, NaN. The kernel itself runs on the
GPU under FA4DIST_BWD_OVERRIDE=exp2_poly_every=k (bench/sessions/gpu_session_28.sh 3)."""

import math

import pytest
import torch

pytest.importorskip("cutlass")

from fa4dist.kernels.cute.common_sm90 import EXP2_POLY  # noqa: E402


def fma32(a, b, c):
    # one rounding: a float32 product is exact in float64, and the sum's double rounding is below these checks
    return (a.double() * b.double() + c.double()).float()


def exp2_poly_mirror(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    xc = torch.where(torch.isnan(x), x, torch.clamp_min(x, -127.0))  # max.NaN
    magic = 1.5 * 2**23
    xr = (torch.floor(xc.double()) + magic).float()  # add.rm: exact at this magnitude
    xi = xr - magic
    fr = xc - xi
    a, b, c = (torch.tensor(v, dtype=torch.float32) for v in EXP2_POLY)
    p = fma32(fma32(fma32(fr, c.expand_as(fr), b.expand_as(fr)), fr, a.expand_as(fr)), fr, torch.ones_like(fr))
    ei = ((xr.view(torch.int32).long() << 23) + p.view(torch.int32).long()) & 0xFFFFFFFF  # shl.b32, add.s32
    ei = torch.where(ei >= 2**31, ei - 2**32, ei)
    return ei.to(torch.int32).view(torch.float32)


def test_relative_error_below_bf16_and_fp16_rounding():
    x = torch.linspace(-126.0, 8.0, 2_000_001, dtype=torch.float32)
    got = exp2_poly_mirror(x).double()
    rel = (got / torch.exp2(x.double()) - 1.0).abs()
    assert rel.max() < 9e-5 < 2.0**-11


def test_integers_masked_scores_and_nan():
    ints = torch.arange(-126, 9, dtype=torch.float32)
    torch.testing.assert_close(exp2_poly_mirror(ints), torch.exp2(ints), rtol=1e-7, atol=0)
    zero = exp2_poly_mirror(torch.tensor([-127.0, -127.5, -1e4, -math.inf]))
    assert (zero.view(torch.int32) == 0).all(), "masked scores must give exactly +0"
    assert torch.isnan(exp2_poly_mirror(torch.tensor([math.nan]))).all()
