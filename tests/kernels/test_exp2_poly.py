"""The exp2 polynomial of the kernels' softmax (cute.common_sm90.exp2_poly) evaluated by a float32 mirror of its
PTX on the CPU: relative error, the exact zero of masked scores, NaN propagation. The kernel itself is tested on
the GPU (tests/kernels/test_cute_fwd_gpu.py::test_exp2_on_the_fma_pipe)."""

import math

import numpy as np
import pytest

pytest.importorskip("cutlass")

from fa4dist.kernels.cute.common_sm90 import EXP2_POLY  # noqa: E402


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def fma32(a, b, c):
    # one rounding: a float32 product is exact in float64, and the sum rounds once more only in rare ties
    return f32(a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64))


def exp2_poly_mirror(x):
    x = f32(x)
    xc = np.where(np.isnan(x), x, np.maximum(x, np.float32(-127.0)))  # max.NaN
    magic = np.float32(1.5 * 2**23)
    with np.errstate(invalid="ignore"):
        xr = f32(np.floor(xc.astype(np.float64)) + float(magic))  # add.rm: exact at this magnitude
    xi = f32(xr - magic)
    fr = f32(xc - xi)
    a, b, c = (np.float32(v) for v in EXP2_POLY)
    p = fma32(fma32(fma32(fr, np.full_like(fr, c), np.full_like(fr, b)), fr, np.full_like(fr, a)), fr,
              np.ones_like(fr))
    bits = (xr.view(np.uint32) << np.uint32(23)) + p.view(np.uint32)
    return bits.view(np.float32)


def test_relative_error_below_bf16_and_fp16_rounding():
    x = np.linspace(-126.0, 8.0, 2_000_001, dtype=np.float32)
    got = exp2_poly_mirror(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 9e-5 < 2.0**-11


def test_integers_and_masked_scores():
    ints = np.arange(-126, 9, dtype=np.float32)
    np.testing.assert_allclose(exp2_poly_mirror(ints), np.exp2(ints), rtol=1e-7)
    zero = exp2_poly_mirror(np.array([-127.0, -127.5, -1e4, -math.inf], dtype=np.float32))
    assert (zero.view(np.uint32) == 0).all(), "masked scores must give exactly +0"
    assert np.isnan(exp2_poly_mirror(np.array([math.nan], dtype=np.float32))).all()
