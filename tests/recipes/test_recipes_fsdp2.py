"""The FSDP2 recipe on 2 CPU processes (gloo): dp x cp losses equal a single-process run of the same model and data,
and a run resumed from a distributed checkpoint continues with the same losses."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))

import common  # noqa: E402
import launch  # noqa: E402

STEPS = 4
BASE = ["--model", "tiny", "--seqlen", "256", "--batch-size", "2", "--steps", str(STEPS), "--lr", "1e-3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return launch.snapshot_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus):
    p = common.add_common_args(argparse.ArgumentParser())
    return common.reference_run(p.parse_args(BASE + ["--data", str(corpus)]))


def losses(path, key="loss") -> list[float]:
    return [m[key] for m in common.read_metrics(path)]


def assert_close(got, want, tol=2e-5):
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= tol * max(1.0, abs(w)), f"step {step}: {g} != {w} (all: {got} vs {want})"


@pytest.mark.timeout(420)
def test_fsdp2_cp2_matches_single_process_and_resumes(tmp_path, corpus, reference):
    ckpt = tmp_path / "ckpt"
    first = launch.torchrun("fsdp2_train.py", BASE + [
        "--data", corpus, "--cp", "2", "--ckpt-dir", ckpt, "--save-every", "2",
        "--metrics-out", tmp_path / "first.jsonl"])
    s = launch.summary(first.stdout)
    assert (s["dp"], s["cp"], s["world"]) == (1, 2, 2)
    assert s["tokens_per_s"] > 0 and s["peak_mem_gib"] > 0
    full = losses(tmp_path / "first.jsonl")
    assert_close(full, reference["loss"])
    # the gradient's scale too (sum over cp, not average): AdamW would hide a constant factor in the losses
    assert_close(losses(tmp_path / "first.jsonl", "grad_norm"), reference["grad_norm"])
    assert (ckpt / "step_000002").is_dir() and (ckpt / "latest").read_text() == "step_000004"

    launch.torchrun("fsdp2_train.py", BASE + [
        "--data", corpus, "--cp", "2", "--resume", ckpt / "step_000002",
        "--metrics-out", tmp_path / "resumed.jsonl"])
    resumed = common.read_metrics(tmp_path / "resumed.jsonl")
    assert [m["step"] for m in resumed] == [2, 3]
    assert_close([m["loss"] for m in resumed], full[2:], tol=1e-6)


@pytest.mark.timeout(300)
def test_fsdp2_dp2_with_activation_checkpointing_matches_single_process(tmp_path, corpus, reference):
    launch.torchrun("fsdp2_train.py", BASE + [
        "--data", corpus, "--cp", "1", "--activation-checkpointing", "--metrics-out", tmp_path / "m.jsonl"])
    assert_close(losses(tmp_path / "m.jsonl"), reference["loss"])
    assert_close(losses(tmp_path / "m.jsonl", "grad_norm"), reference["grad_norm"])
