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
