"""The DeepSpeed recipe on 2 CPU processes (DeepSpeed's CPU accelerator, gloo): ZeRO-2 and ZeRO-3 with our cp group
as DeepSpeed's sequence-parallel group give the losses and gradient norms of a single-process run."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

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
    # DeepSpeed's calls of torch.distributed's deprecated collectives warned at every step (126 FutureWarning lines
    # in a 20-step ZeRO-3 run): the recipe's output is its own lines
    assert "is deprecated" not in out.stdout, out.stdout[-3000:]
    metrics = common.read_metrics(tmp_path / "m.jsonl")
    assert len(metrics) == STEPS
    # losses, and the gradient norm before clipping: the gradients are summed over cp, averaged over dp (the
    # losses alone would not show a constant factor: AdamW is invariant to it)
    for key in ("loss", "grad_norm"):
        got = [m[key] for m in metrics]
        for step, (g, w) in enumerate(zip(got, reference[key])):
            assert abs(g - w) <= 2e-5 * max(1.0, abs(w)), f"{key} at step {step}: {got} vs {reference[key]}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_cp_invariant_weights_are_the_same_bytes_at_cp_1_and_2(tmp_path, corpus, reference, stage):
    """--cp-invariant under DeepSpeed: int64 parameter gradients summed over every rank, clipped by their whole norm
    and set into DeepSpeed's gradient partitions (deepspeed.utils.safe_set_full_grad) in place of its float
    reduction: a cp = 1 and a cp = 2 run end with the same weights and log the same losses, and train as the float
    run does."""
    steps = 2  # the reference's first two steps (warmup: their learning rates do not depend on the run's length)
    args = launch.tiny_args(steps) + ["--data", corpus, "--cp-invariant", "--zero-stage", stage]
    runs = []
    for cp in (1, 2):
        metrics_path = tmp_path / f"m{cp}.jsonl"
        out = launch.ranks("deepspeed_train.py", args + ["--cp", cp, "--metrics-out", metrics_path], nproc=cp)
        assert "parameter gradients (int64 fixed point" in out.stdout
        runs.append((launch.summary(out.stdout), common.read_metrics(metrics_path)))
    (first, m1), (second, m2) = runs
    assert len(m1) == len(m2) == steps
    assert (first["cp"], second["cp"], first["cp_invariant"], second["cp_invariant"]) == (1, 2, True, True)
    assert first["weights_sha256"] == second["weights_sha256"]
    assert [m["loss"].hex() for m in m1] == [m["loss"].hex() for m in m2]  # cp_cross_entropy's exact value
    for key in ("loss", "grad_norm"):  # the gradients DeepSpeed's own reduction gives (the reference's)
        for metrics in (m1, m2):
            for step, m in enumerate(metrics):
                want = reference[key][step]
                assert abs(m[key] - want) <= 2e-5 * max(1.0, abs(want)), f"{key} at step {step}: {m[key]} vs {want}"


def test_resume_without_a_ckpt_dir_is_refused_by_name(capsys):
    import deepspeed_train

    with pytest.raises(SystemExit):
        deepspeed_train.parse_args(["--resume", "latest"])
    assert "--resume needs --ckpt-dir" in capsys.readouterr().err


def test_a_ds_config_that_is_missing_or_not_json_is_refused_by_name(tmp_path, capsys):
    import deepspeed_train

    (tmp_path / "bad.json").write_text("{bad")
    for where in (tmp_path / "missing.json", tmp_path / "bad.json"):
        with pytest.raises(SystemExit):
            deepspeed_train.parse_args(["--ds-config", str(where)])
        assert f"--ds-config {where}: not a readable JSON file" in capsys.readouterr().err


@pytest.mark.parametrize("entry, message", [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage is 3 but --zero-stage is 2"),
    ({"gradient_clipping": 0.5}, "'gradient_clipping' is 0.5 but --grad-clip is 1.0"),
    ({"train_micro_batch_size_per_gpu": 4}, "'train_micro_batch_size_per_gpu' is 4, but the recipe runs one"),
    ({"fp16": {"enabled": True}}, "'fp16' is enabled, but the recipe computes in --dtype"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}, "'optimizer' is not used: the recipe takes --lr"),
    ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' is not used: the recipe takes --lr, --warmup and --steps"),
    ([], "a DeepSpeed config is a JSON object, got list"),
])
def test_ds_config_entries_that_contradict_the_recipe_or_go_unused_are_refused_by_name(tmp_path, capsys, entry,
                                                                                         message):
    """The recipe sets the batch shape, clipping, precision and ZeRO stage from its own options and trains with its
    AdamW and schedule: a --ds-config's contradicting entries were silently replaced (a file's ZeRO-3 ran at the
    default --zero-stage 2) or unused.  Refused at parse time where the run's layout is not needed, naming the
    entry and the option."""
    import deepspeed_train

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(entry))
    with pytest.raises(SystemExit):
        deepspeed_train.parse_args(["--ds-config", str(path)])
    assert f"--ds-config {path}: {message}" in capsys.readouterr().err


def test_ds_config_entries_that_agree_with_the_run_or_say_auto_are_accepted(tmp_path):
    """HF-style configs repeat the batch shape, clipping and precision, often as "auto": accepted where they agree
    with the run; a batch shape or bf16 section that contradicts the run's layout or dtype is refused by name when
    the config is built (every rank alike), and a bf16 section's other settings are kept."""
    import deepspeed_train

    layout = common.Layout(0, 2, 2, 1, 0, 0, None, None, None, 2)  # dp 2, one sequence per rank
    agreeing = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "train_batch_size": 2,
                "gradient_clipping": 1.0, "fp16": {"enabled": False}, "bf16": {"enabled": "auto", "x": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(agreeing))
    args = deepspeed_train.parse_args(["--ds-config", str(path), "--grad-clip", "1.0"])
    cfg = deepspeed_train.ds_config(args, layout, torch.bfloat16)
    assert cfg["bf16"] == {"enabled": True, "x": 3} and cfg["train_batch_size"] == 2
    for bad, message in (({"train_batch_size": 8}, "'train_batch_size' is 8 but this run has 2"),
                         ({"bfloat16": {"enabled": True}}, "'bfloat16' has enabled True but this run computes in")):
        path.write_text(json.dumps(bad))
        args = deepspeed_train.parse_args(["--ds-config", str(path)])
        with pytest.raises(SystemExit, match=message):
            deepspeed_train.ds_config(args, layout, torch.float32)


def test_the_shipped_ds_config_parses_at_both_stages_and_a_files_stage_3_settings_win(tmp_path):
    """The shipped config sets nothing the recipe sets, so it parses at --zero-stage 2 and 3; a file whose stage
    agrees with --zero-stage parses; at stage 3 the recipe's prefetch/persistence values are defaults a file's own
    override (they used to overwrite them)."""
    import deepspeed_train

    for stage in ("2", "3"):
        args = deepspeed_train.parse_args(["--zero-stage", stage])
        layout = common.Layout(0, 2, 2, 1, 0, 0, None, None, None, args.batch_size)
        cfg = deepspeed_train.ds_config(args, layout, torch.float32)
        assert cfg["zero_optimization"]["stage"] == int(stage) and cfg["gradient_accumulation_steps"] == 1
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1234}}))
    args = deepspeed_train.parse_args(["--ds-config", str(path), "--zero-stage", "3"])
    zero = deepspeed_train.ds_config(args, layout, torch.float32)["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 1234  # the file's
    assert zero["stage3_param_persistence_threshold"] == 100_000 and zero["overlap_comm"]  # the recipe's defaults


def test_a_resume_or_config_the_run_cannot_take_is_refused_before_the_process_group(tmp_path,
                                                                                    launched_without_a_rendezvous):
    """A tag that is not there, one saved at the other ZeRO stage or by another number of ranks (a
    ZeRORuntimeException inside DeepSpeed's loader), another schedule recorded beside it, and a --ds-config batch
    shape the run's layout contradicts: refused before the process group and the engine exist (they were refused
    once the engine was built and, for the schedule, the checkpoint loaded)."""
    import deepspeed_train

    base = ["--steps", "4", "--seqlen", "64", "--data", str(tmp_path), "--ckpt-dir", str(tmp_path)]
    tag = tmp_path / "step_000002"
    common.save_run_settings(tag, deepspeed_train.parse_args(base + ["--save-every", "2"]), 2)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):  # what ZeRO-2 writes on 2 ranks (not read here)
        (tag / name).write_bytes(b"")
    (tmp_path / "latest").write_text(tag.name)
    launched_without_a_rendezvous(2)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8}))
    for extra, message in (
            (["--resume", "step_000009"], "--resume step_000009: no checkpoint tag 'step_000009' in --ckpt-dir"),
            (["--resume", "latest", "--zero-stage", "3"], "saved with --zero-stage 2, this run has --zero-stage 3"),
            (["--resume", "latest", "--steps", "9"], r"LR schedule differs from the checkpoint's \(--steps 4"),
            (["--resume", "latest", "--stop-at", "2"], "--stop-at 2: the resumed checkpoint is at step 2 already"),
            (["--save-every", "2", "--ds-config", str(config)], "'train_batch_size' is 8 but this run has 2")):
        with pytest.raises(SystemExit, match=message):
            deepspeed_train.main(base + extra)
    launched_without_a_rendezvous(4)
    with pytest.raises(SystemExit, match="--resume latest: the checkpoint was saved by 2 ranks, this run has 4"):
        deepspeed_train.main(base + ["--resume", "latest", "--cp", "2"])
    launched_without_a_rendezvous(2)
    with pytest.raises(ValueError, match="MASTER_ADDR"):  # one it can resume goes on to the process group
        deepspeed_train.main(base + ["--resume", "latest", "--cp", "2"])


@pytest.mark.timeout(300)
def test_a_save_over_an_earlier_runs_tag_leaves_only_its_own_files(tmp_path, corpus):
    """A --ckpt-dir that holds an earlier run's checkpoint at the same tag (here: saved by 2 ranks at ZeRO-3): the
    new save wrote its files beside the old ones, and the resume was refused for the old ones ("saved with
    --zero-stage 3"; "saved by 2 ranks, this run has 1"), or, at the old world size, DeepSpeed's loader failed
    with a ZeRORuntimeException on the mix. The tag now holds the new save alone and resumes."""
    ckpt = tmp_path / "ckpt"
    stale = ["zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    (ckpt / "step_000001").mkdir(parents=True)
    for name in stale:
        (ckpt / "step_000001" / name).write_bytes(b"")
    args = launch.tiny_args(2) + ["--seqlen", "64", "--data", corpus, "--ckpt-dir", ckpt]
    launch.python("deepspeed_train.py", args + ["--stop-at", "1"])
    assert not any((ckpt / "step_000001" / name).exists() for name in stale)
    assert "start_step=1" in launch.python("deepspeed_train.py", args + ["--resume", "latest"]).stdout
