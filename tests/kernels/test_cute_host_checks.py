"""Host-side checks of the cute backend that run without a GPU (meta tensors, a problem placed on "cuda")."""

from dataclasses import replace

import pytest
import torch

from fa4dist.kernels.cute import backend as cute_backend
from fa4dist.kernels.cute import host
from fa4dist.kernels.problem import validate_inputs
from fa4dist.kernels.worklist import WorkItem


def _supports(direction, **kw):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="meta")
    problem = replace(validate_inputs(q, q, q, **kw), device=torch.device("cuda"))
    return cute_backend.CuteSm90Backend().supports(problem, direction)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_supports_takes_no_diagonal_the_launches_refuse(direction):
    """The backward's launch refuses a causal diagonal |q_offset - k_offset| > INT32_MAX // 4 (the forward's
    > INT32_MAX // 2): supports() must decline such calls (auto then picks another backend) instead of taking them
    and failing at launch."""
    limit = host.INT32_MAX // 4
    assert _supports(direction, causal=True, q_offset=limit) is None
    for diag in (limit + 1, 2**30):
        assert _supports(direction, causal=True, q_offset=diag) is not None, diag
        assert _supports(direction, causal=True, k_offset=diag) is not None, diag
    assert _supports(direction, q_offset=2**30 + 5) is None  # no causal diagonal: the offsets do not matter
    item = WorkItem(0, 8, 0, 8, limit + 1, 0, causal=True)
    assert cute_backend.CuteSm90Backend._band(item) is None
    assert cute_backend.CuteSm90Backend._band(replace(item, q_offset=limit)) is not None
