"""Launching the recipes from Python (the tests use this): torchrun in a subprocess with a timeout, and a frozen
copy of some local text so that every run of one test reads the same corpus."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parent
REPO = RECIPES.parent


def tiny_args(steps: int) -> list[str]:
    """The recipes' tiny size (a few seconds a step on 2 CPU processes): what the recipe tests train."""
    return ["--model", "tiny", "--seqlen", "256", "--batch-size", "2", "--steps", str(steps), "--lr", "1e-3"]


def torchrun(script: str, args: list[str], nproc: int = 2, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc recipes/<script> args``; raises with the output on failure
    or timeout (the whole process group is killed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(RECIPES / script), *map(str, args)]
    return run(cmd, timeout)


def ranks(script: str, args: list[str], nproc: int, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """The recipe on ``nproc`` processes: torchrun's, or for one a plain process (a world of one, as torchrun's one
    rank would be, without a launcher process to start)."""
    if nproc == 1:
        return python(script, args, timeout)
    return torchrun(script, args, nproc, timeout)


def python(script: str, args: list[str], timeout: float = 240.0):
    """The recipe as a plain single process (a world of one)."""
    return run([sys.executable, str(RECIPES / script), *map(str, args)], timeout)


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n{out[-6000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def snapshot_corpus(dst: Path) -> Path:
    """Copies a few of the repository's own files (source and docs) to ``dst``: a corpus that cannot change
    between the runs of one test, even while the checkout is being edited."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    picks = sorted((REPO / "fa4dist" / "kernels").glob("*.py")) + [REPO / "README.md", REPO / "pyproject.toml"]
    for i, f in enumerate(p for p in picks if p.exists()):
        shutil.copy(f, dst / f"{i:02d}_{f.name}")
    return dst


def summary(output: str) -> dict:
    """The JSON of the ``SUMMARY {...}`` line a recipe prints."""
    import json

    lines = [line for line in output.splitlines() if line.startswith("SUMMARY ")]
    if not lines:
        raise ValueError(f"no SUMMARY line in the output:\n{output[-3000:]}")
    return json.loads(lines[-1][len("SUMMARY "):])
