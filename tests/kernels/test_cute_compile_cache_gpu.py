"""GPU test of the compile cache on disk (cute/host.py, disk_cache_dir): a second process loads every variant the
first one compiled (forward, backward pre / main / post) and computes the same bytes."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
pytest.importorskip("cutlass")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP = """
import sys, torch
from fa4dist.kernels import attention_backward, attention_forward
torch.manual_seed(0)
q, k, v, dout = (torch.randn(2, 333, 4, 64, device="cuda").to(torch.bfloat16) for _ in range(4))
out, lse = attention_forward(q, k, v, causal=True, backend="cute")
dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True, backend="cute")
torch.save([t.cpu() for t in (out, lse, dq, dk, dv)], sys.argv[1])
"""


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    env = {**os.environ, "FA4DIST_CUTE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("FA4DIST_CUTE_AOT_DIR", None)
    results = []
    for run in (1, 2):
        env["FA4DIST_CUTE_COMPILE_LOG"] = str(tmp_path / f"compiled{run}.txt")
        subprocess.run([sys.executable, "-c", STEP, str(tmp_path / f"out{run}.pt")], env=env, check=True,
                       timeout=600)
        results.append(torch.load(tmp_path / f"out{run}.pt"))
    first = (tmp_path / "compiled1.txt").read_text().splitlines()
    assert len(first) >= 4, first  # the forward and the backward's preprocess, main kernel and postprocess
    assert not (tmp_path / "compiled2.txt").exists(), "the second process compiled instead of loading"
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
