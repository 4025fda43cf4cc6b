"""The Hugging Face SFT recipe on 2 CPU processes (gloo): a transformers model under enable_context_parallel and
FSDP2 trains with the losses and gradient norms of a plain single-process loop that uses the model's own attention
and loss (cp = 2 with activation checkpointing, tiled MLP and tiled loss; dp = 2 with the model's logits)."""

from __future__ import annotations


import pytest

pytest.importorskip("transformers")

import hf_sft  # noqa: E402
import launch  # noqa: E402
from recipe_metrics import assert_steps_close, step_metrics  # noqa: E402

STEPS = 3
BASE = launch.tiny_args(STEPS)


def reference(corpus, *extra):
    return hf_sft.reference_run(hf_sft.parse_args(BASE + ["--data", str(corpus), *extra]))


@pytest.mark.timeout(300)
def test_hf_sft_cp2_matches_single_process(tmp_path, corpus):
    out = launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--cp", "2", "--activation-checkpointing", "--tile-mlp", "48", "--loss-chunk", "40",
        "--metrics-out", tmp_path / "m.jsonl"])
    s = launch.summary(out.stdout)
    assert (s["recipe"], s["dp"], s["cp"], s["loss"]) == ("hf_sft", 1, 2, "tiled")
    assert s["tokens_per_s"] > 0 and s["peak_mem_gib"] > 0
    want = reference(corpus)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


@pytest.mark.timeout(300)
def test_hf_sft_qwen2_dp2_logits_loss_matches_single_process(tmp_path, corpus):
    launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--arch", "qwen2", "--cp", "1", "--loss", "logits", "--metrics-out", tmp_path / "m.jsonl"])
    want = reference(corpus, "--arch", "qwen2")
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt_oss"])
def test_hf_sft_windowed_archs_cp2_match_single_process(tmp_path, corpus, arch):
    """Gemma 2 (attention and final-logit soft-capping, every other layer a 32-token window), Gemma 3 (local and
    global layers) and GPT-OSS (sinks, MoE) at cp = 2 with the tiled loss, against the model's own eager attention
    and loss."""
    extra = ["--arch", arch, "--sliding-window", "32"]
    launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--cp", "2", "--loss-chunk", "40", "--metrics-out", tmp_path / "m.jsonl", *extra])
    want = reference(corpus, *extra)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


@pytest.mark.parametrize("bad", [["--arch", "llama", "--sliding-window", "32"],
                                 ["--arch", "gpt_oss", "--tile-mlp", "8"],
                                 ["--arch", "gpt_oss", "--experts", "2", "--experts-per-token", "3"],
                                 ["--strategy", "hybrid"], ["--ulysses-degree", "2"],
                                 ["--checkpoint", "/nonexistent/checkpoint"], ["--tile-mlp", "-1"],
                                 ["--loss-chunk", "0"]])
def test_hf_sft_refuses_options_its_arch_lacks(bad):
    with pytest.raises(SystemExit):
        hf_sft.parse_args(BASE + bad)
