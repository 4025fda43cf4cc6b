"""The sinks' gradient's row dot kernel (fa4dist/kernels/cute/row_dot.py) on the GPU: the factors exactly those of
fixed_point.power_of_two_below, the scaled sums torch's up to the order of fp32 adds (and exact against fp64 where
that order cannot matter), rows near the top of the range without overflow, non-finite rows non-finite, the same
bits for a row in any layout; and merge.sink_grad_terms, which takes it, against its torch form."""

import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

from fa4dist.kernels import merge  # noqa: E402
from fa4dist.kernels.cute.row_dot import row_dot_scaled  # noqa: E402
from fa4dist.kernels.fixed_point import power_of_two_below  # noqa: E402

NAN, INF = float("nan"), float("inf")
BIG = 1e37  # products of two such entries overflow fp32; the scaled ones do not


def _rows(shape, seed):
    """Random bf16 rows over a wide range of magnitudes, with planted rows: zeros, subnormals, huge entries,
    NaN, inf, and a row with both."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(shape, device="cuda", generator=g) * torch.logspace(-6, 4, shape[-1], device="cuda")
    t = t.to(torch.bfloat16)
    flat = t.view(-1, shape[-1])
    flat[1] = 0.0
    flat[2] = torch.finfo(torch.bfloat16).tiny / 4  # subnormals
    flat[3] = flat[3].float().sign().to(torch.bfloat16) * BIG
    flat[4, 5], flat[5, 0], flat[6, -1] = NAN, INF, -INF
    flat[7, 1], flat[7, 2] = NAN, INF
    return t


def _torch_form(a, b):
    """(dot, fa, fb) as merge's torch form computes them (fp32)."""
    fa, fb = (power_of_two_below(t.float().abs().amax(-1, keepdim=True)) for t in (a, b))
    return (a.float() * fa * (b.float() * fb)).sum(-1), fa.squeeze(-1), fb.squeeze(-1)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_against_the_torch_form(d):
    a, b = _rows((3, 40, 4, d), 0), _rows((3, 40, 4, d), 1)
    got = row_dot_scaled(a, b)
    want = _torch_form(a, b)
    finite = torch.isfinite(a.float()).all(-1) & torch.isfinite(b.float()).all(-1)
    for name, x, y in zip(("fa", "fb"), got[1:], want[1:]):
        assert x.shape == a.shape[:-1] and x.dtype == torch.float32
        assert torch.equal(x[finite], y[finite]), f"{name}: the factors differ from power_of_two_below's"
        assert (x > 0).all() and torch.isfinite(x).all(), f"{name}: a factor is not a normal power of two"
    # fp32 sums of d terms in two orders: apart by at most ~d u of the sum of the |terms| (cancellation)
    abs_sum = _torch_form(a.abs(), b.abs())[0]
    _close_within(got[0][finite], want[0][finite], abs_sum[finite] * d * 2.0**-23)
    assert not torch.isfinite(got[0][~finite]).any(), "a row with NaN / inf gave a finite dot"
    # unscaled: the fp64 row sums (the BIG row's true value is far beyond fp32 and stays finite scaled)
    exact = (a.double() * b.double()).sum(-1)
    unscaled = got[0].double() / got[1].double() / got[2].double()
    exact_abs = (a.double() * b.double()).abs().sum(-1)
    _close_within(unscaled[finite], exact[finite], exact_abs[finite] * d * 2.0**-23)


def test_a_row_has_the_same_bits_in_any_layout():
    a, b = _rows((2, 96, 8, 128), 2), _rows((2, 96, 8, 128), 3)
    base = row_dot_scaled(a, b)
    perm = [t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (a, b)]  # (b, s, h, d), strided
    assert not perm[0].is_contiguous()
    part = row_dot_scaled(a[:, 17:53], b[:, 17:53])
    for x, y, z in zip(base, row_dot_scaled(*perm), part):
        assert torch.equal(x.nan_to_num(), y.nan_to_num()) and torch.equal(x[:, 17:53].nan_to_num(), z.nan_to_num())


@pytest.mark.parametrize("packed", [False, True])
def test_sink_grad_terms_take_it(monkeypatch, packed):
    """merge.sink_grad_terms on bf16 CUDA rows (through the kernel) against its torch form: the order of fp32 adds
    apart, the same terms, huge rows included."""
    shape = (300, 4, 128) if packed else (2, 150, 4, 128)
    dout, out = _rows(shape, 4), _rows(shape, 5)
    g = torch.Generator(device="cuda").manual_seed(6)
    lse_shape = (4, 300) if packed else (2, 4, 150)
    lse = torch.randn(lse_shape, device="cuda", generator=g) * 4
    sinks = torch.randn(4, device="cuda", generator=g)
    got = merge.sink_grad_terms(dout, out, lse, sinks)
    with monkeypatch.context() as m:
        m.setattr(merge, "_row_dot_kernel", lambda *a: None)
        want = merge.sink_grad_terms(dout, out, lse, sinks)
        abs_terms = merge.sink_grad_terms(dout.abs(), out.abs(), lse, sinks)  # (the sums of |terms|, times share)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    _close_within(got[finite], want[finite], abs_terms[finite] * 128 * 2.0**-22)


def _close_within(got, want, bound):
    err = (got.double() - want.double()).abs()
    worst = (err - bound.double()).argmax()
    assert (err <= bound.double()).all(), f"{err[worst].item()} apart where {bound[worst].item()} is allowed"
