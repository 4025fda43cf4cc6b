"""Context parallelism on every GPU of the machine (NCCL, one process per GPU): correctness and bitwise determinism
(tests/cp/multigpu_check.py under torchrun).  Skips without at least two GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least two GPUs")
def test_all_gpus_ring_ulysses_hybrid_match_one_gpu_and_are_deterministic():
    script = Path(__file__).with_name("multigpu_check.py")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={torch.cuda.device_count()}", str(script)],
        capture_output=True, text=True, timeout=580, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS" in proc.stdout, out[-6000:]
