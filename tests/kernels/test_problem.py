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
