"""bench/hf_context_search.py on the CPU: one short try of the tiny model runs to its SEARCH line.  Run as a script
from bench/, whose kernels.py would shadow Hugging Face's `kernels` package (installed with transformers' extras):
transformers then failed importing it at the first model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def test_the_context_search_runs_a_try_on_the_cpu(tmp_path):
    out = tmp_path / "tries.jsonl"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "hf_context_search.py"), "--seqlens", "256",
                          "--budget-s", "1", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    search = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("SEARCH "))[7:])
    assert search["largest_ok"] == 256 and search["tries"] == 1
    assert any(json.loads(line).get("ok") is True for line in out.read_text().splitlines())
