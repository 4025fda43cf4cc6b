"""The FSDP2 recipe on 2 CPU processes (gloo): dp x cp losses equal a single-process run of the same model and data,
the README's stop-and-resume pair repeats an uninterrupted run bit for bit, and --cp-invariant ends with the same
weights (and logs the same losses) at cp = 1 and 2."""

from __future__ import annotations

import argparse
import shlex

import pytest

import common  # noqa: E402
import launch  # noqa: E402
from recipe_metrics import assert_steps_close, step_metrics  # noqa: E402

STEPS = 4
BASE = launch.tiny_args(STEPS)


@pytest.fixture(scope="module")
def reference(corpus):
    p = common.add_common_args(argparse.ArgumentParser())
    return common.reference_run(p.parse_args(BASE + ["--data", str(corpus)]))


@pytest.mark.timeout(300)
def test_fsdp2_cp2_matches_single_process(tmp_path, corpus, reference):
    first = launch.torchrun("fsdp2_train.py", BASE + [
        "--data", corpus, "--cp", "2", "--metrics-out", tmp_path / "first.jsonl"])
    s = launch.summary(first.stdout)
    assert (s["dp"], s["cp"], s["world"]) == (1, 2, 2)
    assert s["tokens_per_s"] > 0 and s["peak_mem_gib"] > 0
    assert_steps_close(step_metrics(tmp_path / "first.jsonl"), reference["loss"])
    # the gradient's scale too (sum over cp, not average): AdamW would hide a constant factor in the losses
    assert_steps_close(step_metrics(tmp_path / "first.jsonl", "grad_norm"), reference["grad_norm"])


@pytest.mark.timeout(420)
def test_cp_invariant_weights_are_the_same_bytes_at_cp_1_and_2(tmp_path, corpus, reference):
    """--cp-invariant under FSDP2: int64 parameter gradients summed over every rank (each rank keeps its shard),
    and clipping by their whole norm, so a cp = 1 and a cp = 2 run end with the same weights; the logged losses
    (cp_cross_entropy's exact value) are the same bits too (the shares' float sum differed in its last bits)."""
    args = launch.tiny_args(2) + ["--data", corpus, "--cp-invariant"]
    runs, losses = [], []
    for cp in (1, 2):
        metrics = tmp_path / f"cp{cp}.jsonl"
        out = launch.ranks("fsdp2_train.py", args + ["--cp", str(cp), "--metrics-out", metrics], nproc=cp)
        assert "parameter gradients (int64 fixed point" in out.stdout
        runs.append(launch.summary(out.stdout))
        losses.append(step_metrics(metrics))
    assert [s["cp"] for s in runs] == [1, 2] and all(s["cp_invariant"] for s in runs)
    assert runs[0]["weights_sha256"] == runs[1]["weights_sha256"]
    assert len(losses[0]) == 2 and [x.hex() for x in losses[0]] == [x.hex() for x in losses[1]], losses
    # ... and they train what the float loop trains: the same losses and gradient norms to fp32 rounding (equal
    # bits at cp 1 and 2 alone would not show a mode that trains both alike and wrongly). The reference's first two
    # steps: warmup, whose learning rates do not depend on the run's length
    assert_steps_close(losses[0], reference["loss"][:2])
    assert_steps_close(step_metrics(tmp_path / "cp1.jsonl", "grad_norm"), reference["grad_norm"][:2])


def readme_resume_pair() -> list[list[str]]:
    """The README's stop-and-resume example: its two fsdp2_train.py command lines, as argument lists."""
    readme = (launch.REPO / "README.md").read_text()
    commands = []
    for line in readme.splitlines():
        if "recipes/fsdp2_train.py" in line and "--ckpt-dir" in line:
            args = shlex.split(line.split("recipes/fsdp2_train.py", 1)[1].split("#")[0])
            commands.append(args)
    assert len(commands) == 2 and "--resume" in commands[1], commands
    return commands


SCHEDULE_SHRINK = 5  # the README's step counts over 5 (30 / 20 / 10 -> 6 / 4 / 2): the same schedule, in a fifth


def _tiny(args, ckpt, corpus, metrics):
    """A README command at test size: its schedule flags in proportion, our checkpoint directory, a tiny model."""
    args = list(args)
    args[args.index("--ckpt-dir") + 1] = str(ckpt)
    for flag in ("--steps", "--stop-at", "--save-every"):
        if flag in args:
            count = int(args[args.index(flag) + 1])
            assert count % SCHEDULE_SHRINK == 0, (flag, count)
            args[args.index(flag) + 1] = str(count // SCHEDULE_SHRINK)
    return args + ["--model", "tiny", "--seqlen", "128", "--batch-size", "2", "--data", str(corpus),
                   "--metrics-out", str(metrics)]


@pytest.mark.timeout(420)
def test_readme_stop_and_resume_repeats_an_uninterrupted_run(tmp_path, corpus, launched_without_a_rendezvous):
    stop, resume = readme_resume_pair()
    ckpt = tmp_path / "ckpt"
    launch.torchrun("fsdp2_train.py", _tiny(stop, ckpt, corpus, tmp_path / "stopped.jsonl"))
    launch.torchrun("fsdp2_train.py", _tiny(resume, ckpt, corpus, tmp_path / "resumed.jsonl"))
    whole = [a for a in _tiny(resume, ckpt, corpus, tmp_path / "whole.jsonl") if a not in ("--resume", "latest")]
    del whole[whole.index("--ckpt-dir"):whole.index("--ckpt-dir") + 2]  # (it neither saves nor resumes)
    launch.torchrun("fsdp2_train.py", whole)
    stopped, resumed = common.read_metrics(tmp_path / "stopped.jsonl"), common.read_metrics(tmp_path / "resumed.jsonl")
    uninterrupted = common.read_metrics(tmp_path / "whole.jsonl")
    steps = int(resume[resume.index("--steps") + 1]) // SCHEDULE_SHRINK
    assert [m["step"] for m in stopped + resumed] == list(range(steps)) == [m["step"] for m in uninterrupted]
    got = [m["loss"] for m in stopped + resumed]
    want = [m["loss"] for m in uninterrupted]
    assert got == want, "a stopped and resumed run must repeat the uninterrupted one bit for bit"

    # a resume of the checkpoint this run wrote that changes the schedule is refused, naming the flag (before the
    # process group: in this process, as a rank of two that torchrun launched)
    import fsdp2_train

    changed = [str(a) for a in _tiny(resume, ckpt, corpus, tmp_path / "x.jsonl")]
    changed[changed.index("--steps") + 1] = str(steps + 5)
    launched_without_a_rendezvous(2)
    with pytest.raises(SystemExit, match="LR schedule differs from the checkpoint's \\(--steps"):
        fsdp2_train.main(changed)


@pytest.mark.timeout(300)
def test_fsdp2_dp2_with_activation_checkpointing_matches_single_process(tmp_path, corpus, reference):
    launch.torchrun("fsdp2_train.py", BASE + [
        "--data", corpus, "--cp", "1", "--activation-checkpointing", "--metrics-out", tmp_path / "m.jsonl"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl"), reference["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), reference["grad_norm"])


def test_stop_at_out_of_range_is_refused(capsys):
    """At parse time, before a process group or model exists; last_step keeps the check for other callers."""
    import fsdp2_train

    for stop in ("11", "0"):
        with pytest.raises(SystemExit):
            fsdp2_train.parse_args(["--steps", "10", "--stop-at", stop, "--ckpt-dir", "unused"])
        assert f"--stop-at must be in [1, --steps=10], got {stop}" in capsys.readouterr().err
    args = fsdp2_train.parse_args(["--steps", "10", "--stop-at", "10", "--ckpt-dir", "unused"])
    args.stop_at = 11
    with pytest.raises(SystemExit, match=r"--stop-at must be in \[1, --steps=10\], got 11"):
        common.last_step(args)


@pytest.mark.parametrize("bad, message", [
    (["--cp", "0"], "--cp: must be a positive integer"),
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--layers", "0"], "--layers: must be a positive integer"),
    (["--strategy", "bogus"], "--strategy: invalid choice"),
    (["--balancer", "bogus"], "--balancer: invalid choice"),
    (["--stop-at", "1"], "give --ckpt-dir"),
    (["--save-every", "2"], "give --ckpt-dir"),
    # a --ckpt-dir nothing saves to or reads, a --save-every past --steps, --resume latest without --ckpt-dir
    (["--ckpt-dir", "somewhere"], "--ckpt-dir somewhere: no checkpoint would be saved there or resumed from it"),
    (["--ckpt-dir", "somewhere", "--save-every", "3"], "--save-every 3 is past --steps 2: no step would save"),
    (["--resume", "latest"], "--resume latest needs --ckpt-dir"),
    (["--seqlen", "1"], "--seqlen: must be at least 2 tokens, got 1"),
    (["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
    (["--timing-warmup", "-1"], "--timing-warmup: must be >= 0, got -1"),
    (["--cp", "2", "--strategy", "hybrid"], "--strategy hybrid needs --ulysses-degree"),
    (["--cp", "2", "--ulysses-degree", "3"], "--ulysses-degree 3 must divide --cp 2"),
    (["--cp", "2", "--strategy", "ring", "--ulysses-degree", "2"], "--ulysses-degree 2 contradicts it"),
    (["--cp", "4", "--strategy", "ulysses", "--ulysses-degree", "2"], "--ulysses-degree must be --cp (4), got 2"),
    (["--metrics-out", "/nonexistent-dir/m.jsonl"], "its directory does not exist"),
    (["--metrics-out", "."], "--metrics-out '.' is a directory; give a file"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0 (0: no clipping), got -1.0"),
    (["--lr", "inf"], "--lr must be finite and >= 0, got inf"),
    (["--lr", "-0.001"], "--lr must be finite and >= 0, got -0.001"),
    (["--weight-decay", "nan"], "--weight-decay must be finite and >= 0, got nan"),
    (["--peak-tflops", "-989"], "--peak-tflops must be finite and > 0, got -989.0"),
    (["--model", "bogus"], "--model: model size must be one of ['1b', 'base', 'small', 'tiny'], got 'bogus'"),
])
def test_bad_options_are_refused_by_name(bad, message, capsys):
    import fsdp2_train

    with pytest.raises(SystemExit):
        fsdp2_train.parse_args(["--steps", "2"] + bad)
    assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_the_hybrid_strategy_takes_a_ulysses_degree(tmp_path, corpus, reference):
    """--strategy hybrid on the recipes' 1-D cp mesh: Ulysses over --ulysses-degree ranks, ring over the rest; the
    same losses as one process."""
    launch.torchrun("fsdp2_train.py", BASE + ["--data", corpus, "--cp", "4", "--strategy", "hybrid",
                                              "--ulysses-degree", "2", "--metrics-out", tmp_path / "m.jsonl"], nproc=4)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl"), reference["loss"])


def test_resume_from_a_directory_without_a_checkpoint_is_refused_by_name(tmp_path, corpus,
                                                                         launched_without_a_rendezvous):
    """--resume DIR that holds no checkpoint (a typo, a deleted step): refused naming the flag before the process
    group (in this process, as a rank torchrun launched), not an AssertionError from inside
    torch.distributed.checkpoint (test_common has how a refusal ends a launched run: one line and its code)."""
    import fsdp2_train

    (tmp_path / "empty").mkdir()
    launched_without_a_rendezvous(1)
    for where in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(SystemExit) as err:
            fsdp2_train.main([str(a) for a in BASE + ["--data", corpus, "--resume", where]])
        assert f"--resume {where}: {str(where)!r} is not a checkpoint of this recipe" in str(err.value)


@pytest.mark.timeout(200)
def test_resume_with_a_stop_at_the_checkpoint_already_passed_is_refused(tmp_path, corpus, monkeypatch,
                                                                        launched_without_a_rendezvous):
    """--resume with --stop-at at or before the checkpoint's step would train nothing and save nothing, and used
    to end with a SUMMARY as if it had run: refused by name."""
    import fsdp2_train

    ckpt = tmp_path / "ckpt"
    args = BASE + ["--data", corpus, "--ckpt-dir", ckpt]
    launch.python("fsdp2_train.py", args + ["--stop-at", "2"], timeout=150)
    # (refused before the process group: in this process, as a rank torchrun launched)
    launched_without_a_rendezvous(1)
    with pytest.raises(SystemExit, match=r"--stop-at 1: the resumed checkpoint is at step 2 already"):
        fsdp2_train.main([str(a) for a in args + ["--resume", "latest", "--stop-at", "1"]])
    monkeypatch.undo()  # (the last run is a process of its own again)
    # --stop-at at --steps saves there too, as its help says (it used to save only before the last step)
    launch.python("fsdp2_train.py", args + ["--resume", "latest", "--stop-at", str(STEPS)], timeout=150)
    assert (ckpt / "latest").read_text().strip() == f"step_{STEPS:06d}" and (ckpt / f"step_{STEPS:06d}").is_dir()



def _checkpoint_at(tmp_path, step: int) -> list:
    """The arguments of a 4-step run (--steps 4, --ckpt-dir tmp_path) and, as `latest`, the settings record of
    a checkpoint it saved at ``step`` (no weights: the checks before the process group read the record only)."""
    import fsdp2_train

    base = ["--steps", "4", "--seqlen", "64", "--data", str(tmp_path), "--ckpt-dir", str(tmp_path)]
    ckpt = tmp_path / f"step_{step:06d}"
    common.save_run_settings(ckpt, fsdp2_train.parse_args(base + ["--save-every", "2"]), step)
    (ckpt / ".metadata").write_bytes(b"")
    (tmp_path / "latest").write_text(ckpt.name)
    return base

def test_a_resume_that_cannot_continue_is_refused_before_the_process_group(tmp_path, launched_without_a_rendezvous):
    """The schedule and step a checkpoint was saved at are recorded beside it: a resume with another --steps, or
    with a --stop-at the checkpoint has passed, is refused before the process group and the model exist (they
    were refused only after the model was built, sharded and loaded), with the messages of the later checks."""
    import fsdp2_train

    base = _checkpoint_at(tmp_path, 2)
    launched_without_a_rendezvous(1)
    for extra, message in ((["--steps", "9"], r"LR schedule differs from the checkpoint's \(--steps 4 in the "
                                              r"checkpoint, 9 now\)"),
                           (["--stop-at", "1"], "--stop-at 1: the resumed checkpoint is at step 2 already"),
                           (["--stop-at", "2"], "--stop-at 2: the resumed checkpoint is at step 2 already")):
        with pytest.raises(SystemExit, match=message):
            fsdp2_train.main(base + ["--resume", "latest"] + extra)
    with pytest.raises(ValueError, match="MASTER_ADDR"):  # a resume that continues the run goes on to the group
        fsdp2_train.main(base + ["--resume", "latest", "--stop-at", "3"])


def test_a_resume_of_a_finished_run_is_refused_before_the_process_group(tmp_path, launched_without_a_rendezvous):
    """A checkpoint at --steps (a --stop-at at --steps, or --save-every reaching it) has nothing left to train: a
    --resume of it ran no step and printed a SUMMARY as if it had trained (steps_timed 0), exit code 0."""
    import fsdp2_train

    base = _checkpoint_at(tmp_path, 4)
    launched_without_a_rendezvous(1)
    with pytest.raises(SystemExit, match="--resume: the checkpoint is at step 4, the end of --steps 4"):
        fsdp2_train.main(base + ["--resume", "latest"])
    args = fsdp2_train.parse_args(base + ["--save-every", "2"])  # checked again after loading (an older checkpoint)
    with pytest.raises(SystemExit, match="--resume: the checkpoint is at step 4, the end of --steps 4"):
        common.last_step(args, 4)
    assert common.last_step(args, 3) == 4
