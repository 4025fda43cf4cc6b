"""fa4dist.kernels.problem: the argument checks name the argument and what was expected, whatever the input."""

import pytest
import torch

from fa4dist.kernels import attention_forward


def _qkv():
    return tuple(torch.randn(1, 4, 2, 8) for _ in range(3))


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_an_int_too_large_for_a_float_is_a_value_error(name):
    """A Python int past the float range (10**400) cannot be a scale or a cap: a ValueError naming the argument,
    not the OverflowError of float()."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"{name} must be finite"):
        attention_forward(q, k, v, **{name: 10**400})


def test_a_numpy_bool_flag_is_named_as_numpy_s():
    """numpy's bool type calls itself "bool": the flag's error says numpy.bool, not "must be a bool, got bool"."""
    np = pytest.importorskip("numpy")
    from fa4dist.kernels import attention_backward

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"causal must be a bool, got numpy\.bool"):
        attention_forward(q, k, v, causal=np.bool_(True))
    out, lse = attention_forward(q, k, v)
    with pytest.raises(TypeError, match=r"deterministic must be a bool or None, got numpy\.bool"):
        attention_backward(out, q, k, v, out, lse, deterministic=np.bool_(False))


def test_softmax_scale_and_softcap_take_numpy_and_other_real_scalars():
    """numpy.float32 (not a float subclass, unlike numpy.float64) was refused with a TypeError."""
    from fractions import Fraction

    from fa4dist.kernels.problem import check_softcap, check_softmax_scale

    np = pytest.importorskip("numpy")
    for value in (np.float32(0.5), np.float16(0.5), np.float64(0.5), np.int64(2), Fraction(1, 2)):
        assert check_softmax_scale(value, 16) == float(value) and type(check_softmax_scale(value, 16)) is float
        assert check_softcap(value) == float(value) and type(check_softcap(value)) is float
    q = torch.randn(1, 8, 2, 16)
    want = attention_forward(q, q, q, softmax_scale=0.25, softcap=2.0)[0]
    torch.testing.assert_close(attention_forward(q, q, q, softmax_scale=np.float32(0.25), softcap=np.float32(2.0))[0],
                               want, rtol=0, atol=0)
    for bad in (np.bool_(True), True, torch.tensor(0.5), "0.5"):
        with pytest.raises(TypeError, match="softmax_scale must be a float"):
            check_softmax_scale(bad, 16)
        with pytest.raises(TypeError, match="softcap must be a float"):
            check_softcap(bad)
    for bad in (np.float32("nan"), np.float32("inf"), np.float32(0.0)):
        with pytest.raises(ValueError, match=r"softmax_scale must be finite and non-zero, got (nan|inf|0\.0)$"):
            check_softmax_scale(bad, 16)
    for bad in (np.float32("nan"), np.float32("inf"), np.float32(0.0), np.float32(-1.0), np.int64(-1)):
        with pytest.raises(ValueError, match=r"softcap must be finite and > 0, .* got (nan|inf|0\.0|-1\.0|-1)$"):
            check_softcap(bad)
