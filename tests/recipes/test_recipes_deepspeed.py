"""The DeepSpeed recipe on 2 CPU processes (DeepSpeed's CPU accelerator, gloo): ZeRO-2 and ZeRO-3 with our cp group
as DeepSpeed's sequence-parallel group give the losses and gradient norms of a single-process run."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install --no-build-isolation deepspeed)")

import common  # noqa: E402
import launch  # noqa: E402

STEPS = 3
BASE = launch.tiny_args(STEPS)


@pytest.fixture(scope="module")
def reference(corpus):
    p = common.add_common_args(argparse.ArgumentParser())
    return common.reference_run(p.parse_args(BASE + ["--data", str(corpus)]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,cp,strategy", [(2, 2, "ring"), (3, 2, "auto")], ids=["zero2-cp2-ring", "zero3-cp2"])
def test_deepspeed_matches_single_process(tmp_path, corpus, reference, stage, cp, strategy):
    out = launch.torchrun("deepspeed_train.py", BASE + [
        "--data", corpus, "--zero-stage", stage, "--cp", cp, "--strategy", strategy,
        "--metrics-out", tmp_path / "m.jsonl"])
    s = launch.summary(out.stdout)
    assert (s["zero_stage"], s["cp"], s["dp"]) == (stage, cp, 2 // cp)
    metrics = common.read_metrics(tmp_path / "m.jsonl")
    assert len(metrics) == STEPS
    # losses, and the gradient norm before clipping: the gradients are summed over cp, averaged over dp (the
    # losses alone would not show a constant factor: AdamW is invariant to it)
    for key in ("loss", "grad_norm"):
        got = [m[key] for m in metrics]
        for step, (g, w) in enumerate(zip(got, reference[key])):
            assert abs(g - w) <= 2e-5 * max(1.0, abs(w)), f"{key} at step {step}: {got} vs {reference[key]}"
