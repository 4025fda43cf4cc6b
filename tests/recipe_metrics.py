"""What the recipe tests compare: per-step metrics a run wrote (``--metrics-out``) against a reference loop's."""

from __future__ import annotations

import common  # recipes/common.py (tests/recipes/conftest.py puts recipes/ on the path)


def step_metrics(path, key="loss") -> list[float]:
    """The value of ``key`` at every step of a ``--metrics-out`` file."""
    return [m[key] for m in common.read_metrics(path)]


def assert_steps_close(got, want, tol=2e-5):
    """Same number of steps, each within ``tol`` relative (absolute below 1)."""
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= tol * max(1.0, abs(w)), f"step {step}: {g} != {w} (all: {got} vs {want})"
