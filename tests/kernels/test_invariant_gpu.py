"""cp_invariant on one GPU through the CuTe kernels (fa4dist/kernels/invariant.py): the fixed-point dq's bounds
follow each row's own keys (bf16), as tests/kernels/test_fixed_point.py checks on the CPU."""

import pytest
import torch

from test_fixed_point import check_dq_ignores_keys_it_cannot_see

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["cute", "auto"])
def test_cuda_cp_invariant_dq_ignores_keys_it_cannot_see(backend):
    check_dq_ignores_keys_it_cannot_see("cuda", torch.bfloat16, head_dim=64, backend=backend)
