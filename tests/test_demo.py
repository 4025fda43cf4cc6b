"""The README's first command: `torchrun --nproc-per-node N -m fa4dist.demo` (small sizes), and the torchrun-free
launcher `python -m fa4dist.demo --nproc N`."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

SMALL = ["--seqlen", "300", "--heads", "4", "--kv-heads", "2", "--headdim", "16", "--iters", "1"]


def _run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_demo_under_torchrun():
    out = _run(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "fa4dist.demo", *SMALL])
    assert "strategy: ring" in out and "max/mean compute" in out and "tokens/s" in out and "peak memory" in out
    assert out.count("(ok, tolerance") == 4, out
    assert out.rstrip().splitlines()[-1].startswith("PASS: fa4dist demo, 2 ranks"), out
    assert "\r" not in out  # not a terminal: plain progress lines


def test_demo_self_launched_packed_ulysses():
    out = _run([sys.executable, "-m", "fa4dist.demo", "--nproc", "2", "--docs", "5", "--strategy", "ulysses", *SMALL])
    assert "strategy: ulysses" in out and "5 packed documents" in out
    assert out.count("(ok, tolerance") == 4, out
