"""What the recipes share (recipes/common.py), at unit level: the checks that run before any training, and the
SUMMARY line's throughput fields."""

from __future__ import annotations

import argparse

import pytest
import torch

import common  # noqa: E402
from cp_harness import shared_pool

pytestmark = pytest.mark.timeout(120)


def _agree(rank, world, case):
    """common.check_ranks_agree on a 2-rank gloo world: rank 1 started with other options in ``case``."""
    options = dict(steps=10, seed=0, batch_size=2, lr=1e-3)
    if rank == 1 and case == "differ":
        options.update(seed=5, batch_size=4)
    try:
        common.check_ranks_agree(argparse.Namespace(**options))
    except SystemExit as err:
        return str(err)
    return None


def test_ranks_started_with_different_options_all_refuse_by_name():
    """Different --seed / --batch-size on one rank: every rank raises the same error naming them (the ranks used to
    train a silent mix, or wait in a collective until the timeout)."""
    pool = shared_pool(2)
    assert pool.run(_agree, case="same") == [None, None]
    first, second = pool.run(_agree, case="differ")
    assert first == second
    assert "the ranks were started with different options" in first
    assert "--seed 0 on ranks [0], 5 on ranks [1]" in first and "--batch-size 2 on ranks [0], 4 on ranks [1]" in first
    assert "--steps" not in first and "--lr" not in first


def test_a_resume_with_other_model_data_or_optimizer_settings_is_refused_by_name(tmp_path):
    """The settings a checkpoint was saved with are written beside it and checked on resume, before anything is
    loaded: another --seed / --batch-size read other windows silently (the run did not continue the stopped one),
    another --layers failed inside torch.distributed.checkpoint (a missing key)."""
    import deepspeed_train
    import fsdp2_train

    base = ["--steps", "4", "--seqlen", "64", "--data", str(tmp_path)]
    saved = fsdp2_train.parse_args(base + ["--ckpt-dir", str(tmp_path), "--save-every", "2"])
    ckpt = tmp_path / "step_000002"
    common.save_run_settings(ckpt, saved)
    (ckpt / ".metadata").write_bytes(b"")
    common.check_resumed_run(ckpt, fsdp2_train.parse_args(base + ["--resume", str(ckpt), "--metrics-out",
                                                                  str(tmp_path / "m.jsonl")]))  # the same run
    common.check_resumed_run(tmp_path / "older", saved)  # a checkpoint without the record: not checked
    other = fsdp2_train.parse_args(base + ["--resume", str(ckpt), "--seed", "3", "--batch-size", "4", "--layers", "3"])
    with pytest.raises(SystemExit, match=r"the run's settings differ from the checkpoint's \(--layers None in the "
                                         r"checkpoint, 3 now; --batch-size 2 in the checkpoint, 4 now; --seed 0 in"):
        fsdp2_train.find_checkpoint(other.resume, other.ckpt_dir, other)  # refused before loading
    other = deepspeed_train.parse_args(base + ["--ckpt-dir", str(tmp_path), "--resume", ckpt.name, "--seed", "3"])
    # a tag without DeepSpeed's files (the FSDP2 recipe's checkpoint, an empty tag) failed in an AssertionError inside
    # DeepSpeed's loader, once the engine was built
    with pytest.raises(SystemExit, match="is not a checkpoint of this recipe \\(no DeepSpeed model states in it\\)"):
        deepspeed_train.resume_tag(other)
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match="--seed 0 in the checkpoint, 3 now"):
        deepspeed_train.resume_tag(other)


def test_a_resume_on_other_text_or_numerics_is_refused(tmp_path):
    """The record held the --data paths only: text edited between a stop and its resume (this repository's files, by
    default) was trained on silently, another run's windows than the stopped one's.  It holds the tokens' digest now,
    checked when the stream is built, and --dtype and --cp-invariant, which change the numerics a resume continues."""
    import fsdp2_train

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.md").write_text("the quick brown fox jumps over the lazy dog " * 40)
    base = ["--steps", "4", "--seqlen", "64", "--data", str(tmp_path / "data")]
    saved = fsdp2_train.parse_args(base)
    common.build_stream(saved)
    ckpt = tmp_path / "step_000002"
    common.save_run_settings(ckpt, saved, 2)
    again = fsdp2_train.parse_args(base)
    common.check_resumed_run(ckpt, again)
    common.build_stream(again, resumed=ckpt)  # the same text: taken
    (tmp_path / "data" / "a.md").write_text("the quick brown fox jumps over the lazy cat " * 40)
    with pytest.raises(SystemExit, match="the training text differs from the text the checkpoint .* was trained on"):
        common.build_stream(fsdp2_train.parse_args(base), resumed=ckpt)
    with pytest.raises(SystemExit, match="--cp-invariant False in the checkpoint, True now"):
        common.check_resumed_run(ckpt, fsdp2_train.parse_args(base + ["--cp-invariant"]))
    with pytest.raises(SystemExit, match="--dtype 'auto' in the checkpoint, 'fp32' now"):
        common.check_resumed_run(ckpt, fsdp2_train.parse_args(base + ["--dtype", "fp32"]))


def test_run_main_ends_a_refusal_with_its_message_and_code():
    """A recipe's __main__ (common.run_main): a SystemExit raised inside main (a refusal after the process group is
    up) keeps its message and exit code but ends through exit_process, not the interpreter's teardown, which could
    abort a rank on a joinable gloo thread (SIGABRT after the message)."""
    import subprocess
    import sys
    from pathlib import Path

    recipes = Path(common.__file__).resolve().parent
    cases = (("raise SystemExit('resume: the LR schedule differs')", 1, "resume: the LR schedule differs"),
             ("raise SystemExit(3)", 3, ""), ("print('done')", 0, "done"),
             # any other exception: its traceback and exit code 1, as the interpreter's, but without its teardown
             # (which aborted about one failing 2-rank gloo run in three with SIGABRT after the traceback)
             ("raise RuntimeError('deep inside')", 1, "RuntimeError: deep inside"))
    procs = [subprocess.Popen([sys.executable, "-c", f"import atexit, common\ndef main():\n    atexit.register("
                               f"print, 'interpreter teardown')\n    {body}\ncommon.run_main(main)\n"
                               f"print('not reached')\n"], cwd=recipes, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for body, _, _ in cases]  # together: ~3 s each
    for (body, code, text), proc in zip(cases, procs):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == code, (body, proc.returncode, stderr[-2000:])
        assert text in stdout + stderr and "not reached" not in stdout, (body, stdout, stderr)
        assert "interpreter teardown" not in stdout, (body, stdout)


@pytest.mark.parametrize("recipe, argv", [
    ("fsdp2_train", ["--cp", "2"]),
    ("deepspeed_train", ["--cp", "2"]),
    ("hf_sft", ["--cp", "2"]),
    ("rl_deterministic", ["--cp", "2"]),
])
def test_a_cp_the_world_size_does_not_allow_is_refused_before_the_process_group(recipe, argv,
                                                                               launched_without_a_rendezvous):
    """--cp 2 on 3 ranks: refused by name from torchrun's WORLD_SIZE before any process group or model exists (it
    was refused once the process group was up)."""
    import importlib

    launched_without_a_rendezvous(3)
    with pytest.raises(SystemExit, match="--cp 2 must divide the world size 3$"):
        importlib.import_module(recipe).main(argv)


def test_a_cp_above_one_without_a_launcher_says_to_start_the_ranks_with_torchrun():
    """`python recipes/fsdp2_train.py --cp 2` said only "--cp 2 must divide the world size 1"."""
    with pytest.raises(SystemExit, match=r"world size 1 \(a plain python run is one process: start the ranks with "
                                         r"torchrun --nproc-per-node N\)"):
        common.check_layout(1, 2)


@pytest.mark.parametrize("recipe", ["fsdp2_train", "deepspeed_train", "hf_sft", "rl_deterministic"])
def test_a_backend_the_run_cannot_use_is_refused_when_parsed(recipe, capsys):
    """A misspelt --backend, or one the run's device lacks (sdpa on a CPU run), failed with a traceback from the
    first attention call, once the process group, the model and its shards existed: refused by name at parse
    time, with the registry's own message."""
    import importlib

    import torch

    parse_args = importlib.import_module(recipe).parse_args
    with pytest.raises(SystemExit):
        parse_args(["--backend", "bogus"])
    err = capsys.readouterr().err
    assert "--backend: backend must be 'auto' or one of [" in err and "got 'bogus'" in err, err
    if not torch.cuda.is_available():  # (the recipes take a GPU where there is one)
        with pytest.raises(SystemExit):
            parse_args(["--backend", "sdpa"])
        assert "--backend: backend 'sdpa' is not available on device cpu" in capsys.readouterr().err
    assert parse_args(["--backend", "reference"]).backend == "reference"


def test_data_that_is_missing_empty_or_not_given_is_refused_by_name(tmp_path, capsys):
    """--data of a path that does not exist failed with a FileNotFoundError traceback once the process group and
    the model existed; a directory without text files likewise (a ValueError); and a bare --data (an empty
    variable in a launch script) trained on this repository's text, silently. Each is refused naming --data."""
    import fsdp2_train

    with pytest.raises(SystemExit):
        fsdp2_train.parse_args(["--data", str(tmp_path), str(tmp_path / "missing.txt")])
    assert f"--data: these paths do not exist: [{str(tmp_path / 'missing.txt')!r}]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fsdp2_train.parse_args(["--data"])
    assert "--data: expected at least one argument" in capsys.readouterr().err
    args = fsdp2_train.parse_args(["--data", str(tmp_path)])  # exists, but holds no text
    with pytest.raises(SystemExit, match=r"--data: no text files \(.*\) found under "):
        common.build_stream(args)
    (tmp_path / "a.txt").write_text("some text to train on")
    assert common.build_stream(fsdp2_train.parse_args(["--data", str(tmp_path)])).num_tokens > 0


@pytest.mark.parametrize("recipe", ["fsdp2_train", "deepspeed_train", "hf_sft", "rl_deterministic"])
def test_a_ulysses_degree_the_models_heads_cannot_split_over_is_refused_when_parsed(recipe, capsys):
    """--strategy ulysses over --cp 3 with the tiny model's 4 query heads (or a --ulysses-degree the heads do not
    split over) failed in the first attention call on every rank, once the process group and the sharded model
    existed: refused by name at parse time, with the library's reason."""
    import importlib

    parse_args = importlib.import_module(recipe).parse_args
    cases = [(["--cp", "3", "--strategy", "ulysses"], "--strategy ulysses runs a Ulysses degree of 3 over --model "
              "tiny's 4 query heads / 2 key/value heads: Ulysses degree 3 is impossible: 4 query heads do not split "
              "evenly over 3 ranks")]
    if recipe != "hf_sft":  # (it takes no --ulysses-degree)
        cases.append((["--model", "small", "--cp", "4", "--strategy", "auto", "--ulysses-degree", "4"],
                      "--strategy auto runs a Ulysses degree of 4 over --model small's 6 query heads"))
    for argv, message in cases:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    for argv in (["--cp", "3"], ["--cp", "3", "--strategy", "ring"], ["--cp", "4", "--strategy", "ulysses"]):
        parse_args(argv)  # auto picks a degree the heads allow; ring runs none; 4 heads split over 4


@pytest.mark.parametrize("recipe", ["fsdp2_train", "deepspeed_train", "hf_sft", "rl_deterministic"])
def test_a_seed_outside_torchs_range_is_refused_when_parsed(recipe, capsys):
    """--seed 2**64 failed in torch.manual_seed ("Overflow when unpacking long long"), after the process group was
    up: refused by name at parse time. torch's whole range is taken."""
    import importlib

    parse_args = importlib.import_module(recipe).parse_args
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(SystemExit):
            parse_args(["--seed", str(seed)])
        assert f"--seed must be in [-2**63, 2**64) (torch's seeds), got {seed}" in capsys.readouterr().err
    for seed in (2**64 - 1, -(2**63), 0):
        assert parse_args(["--seed", str(seed)]).seed == seed


@pytest.mark.parametrize("recipe", ["fsdp2_train", "deepspeed_train"])
def test_a_ckpt_dir_that_cannot_be_a_directory_is_refused_when_parsed(recipe, tmp_path, capsys):
    """--ckpt-dir naming a file (or a path under one) trained every step up to the first --save-every and then
    failed in mkdir (NotADirectoryError), the steps lost: refused by name at parse time."""
    import importlib

    parse_args = importlib.import_module(recipe).parse_args
    (tmp_path / "file").write_text("")
    for where in (tmp_path / "file", tmp_path / "file" / "ckpts"):
        with pytest.raises(SystemExit):
            parse_args(["--steps", "2", "--save-every", "2", "--ckpt-dir", str(where)])
        assert f"--ckpt-dir {where}: {str(tmp_path / 'file')!r} is not a directory" in capsys.readouterr().err
    for where in (tmp_path, tmp_path / "new" / "ckpts"):  # an existing directory, or one to be made
        assert parse_args(["--steps", "2", "--save-every", "2", "--ckpt-dir", str(where)]).ckpt_dir == str(where)


@pytest.mark.parametrize("recipe", ["fsdp2_train", "deepspeed_train", "hf_sft", "rl_deterministic"])
def test_the_environment_variable_turns_the_whole_cp_invariant_mode_on(recipe, monkeypatch, capsys):
    """FA4DIST_CP_INVARIANT=1 is --cp-invariant, as the help says: the recipe's whole mode (invariant gradients,
    the weights hash, the SUMMARY's cp_invariant), not the attention alone (which it used to be: the kernels read
    the variable, the recipes did not); a value the kernels refuse is a usage error naming the variable."""
    import importlib

    parse_args = importlib.import_module(recipe).parse_args
    monkeypatch.delenv("FA4DIST_CP_INVARIANT", raising=False)
    assert not parse_args([]).cp_invariant and parse_args(["--cp-invariant"]).cp_invariant
    monkeypatch.setenv("FA4DIST_CP_INVARIANT", "1")
    assert parse_args([]).cp_invariant
    monkeypatch.setenv("FA4DIST_CP_INVARIANT", "0")
    assert not parse_args([]).cp_invariant
    monkeypatch.setenv("FA4DIST_CP_INVARIANT", "maybe")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "FA4DIST_CP_INVARIANT must be 1" in capsys.readouterr().err


def test_throughput_summary_counts_only_the_steps_after_the_warmup():
    """The SUMMARY fields every recipe prints, from one place (fsdp2 and hf_sft each spelled them out, deepspeed a
    subset): two timed steps of 1000 tokens and 6e12 FLOPs in 2 s on 2 devices, after one warm-up step."""
    meter = common.Throughput(1, torch.device("cpu"))
    meter.add(0, 100.0, 10**6, 1e18)  # the warm-up: left out
    meter.add(1, 0.5, 1000, 2e12)
    meter.add(2, 1.5, 1000, 4e12)
    got = meter.summary(1e12, 2)
    assert got == dict(steps_timed=2, tokens_per_s=1000.0, tokens_per_s_per_device=500.0, mfu=1.5,
                       peak_tflops_per_device=1.0, achieved_tflops_per_device=1.5), got
    assert common.Throughput(5, torch.device("cpu")).summary(None, 2) == dict(
        steps_timed=0, tokens_per_s=None, tokens_per_s_per_device=None, mfu=None, peak_tflops_per_device=None,
        achieved_tflops_per_device=None)
    # a CPU run's rates: 3 significant digits, not 0.0 (rounded to 2 and 4 decimals they were)
    small = common.Throughput(0, torch.device("cpu"))
    small.add(0, 3.0, 1000, 2.5e9)
    got = small.summary(1e12, 2)
    assert (got["achieved_tflops_per_device"], got["mfu"]) == (0.000417, 0.000417), got


@pytest.mark.parametrize("recipe", ["fsdp2_train", "deepspeed_train", "rl_deterministic", "hf_sft"])
def test_the_help_shows_every_options_default(recipe, capsys, monkeypatch):
    """--help promises each option's default where it has one: argparse left it out of options without help text
    (--lr, --seed, ...), so the RL recipe's own --lr (10x the others') did not show; a default of 0 was hidden too."""
    import importlib

    monkeypatch.delenv("FA4DIST_CP_INVARIANT", raising=False)
    module = importlib.import_module(recipe)
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = capsys.readouterr().out
    options = text[text.index("options:"):]
    blocks = {}  # option -> its help text (up to the next option)
    for part in options.split("\n  --")[1:]:
        name = part.split()[0].rstrip(",")
        blocks["--" + name] = " ".join(part.split())
    parsed = vars(module.parse_args([] if recipe != "hf_sft" else ["--arch", "llama"]))
    shown = 0
    for dest, value in parsed.items():
        option = "--" + dest.replace("_", "-")
        if option not in blocks or value is None or value is False:
            continue
        assert "default" in blocks[option], (option, value, blocks[option])
        shown += 1
    assert shown >= 10 and "(default: 0)" in blocks["--seed"]


def test_metrics_file_holds_one_line_per_step_of_the_run_so_far(tmp_path):
    """--metrics-out: a new run starts the file afresh (it appended to an earlier run's lines), and a resumed run
    keeps the lines of the steps before its checkpoint and drops the rest, which it takes again (a run stopped past
    its last checkpoint left them: they appeared twice). A torn last line is dropped."""
    path = tmp_path / "m.jsonl"

    def run(start, stop):
        progress = common.Progress(stop, 0, str(path), start=start)
        for step in range(start, stop):
            progress.update(step, loss=float(step))
        progress.close()
        return [m["step"] for m in common.read_metrics(path)]

    assert run(0, 6) == [0, 1, 2, 3, 4, 5]
    assert run(0, 3) == [0, 1, 2]  # a new run: the old lines gone
    assert run(0, 6) == list(range(6))
    assert run(3, 6) == list(range(6))  # resumed at step 3 after a stop at 6: steps 3-5 once
    path.write_text(path.read_text() + '{"step": 6, "lo')  # killed while writing step 6
    assert run(6, 8) == list(range(8))
    path.unlink()
    assert run(4, 5) == [4]  # a resume without the earlier file
    assert common.Progress(5, 1, str(tmp_path / "other.jsonl")).metrics is None  # rank 0 writes it alone
    assert not (tmp_path / "other.jsonl").exists()


def test_a_timing_warmup_that_leaves_no_step_timed_is_named():
    """--timing-warmup covering every step an invocation trains was taken silently: the SUMMARY's tokens/s and MFU
    came out null (steps_timed 0) with nothing to say why. Counted from where the invocation starts (a resume)."""
    import warnings

    import fsdp2_train

    args = fsdp2_train.parse_args(["--steps", "6", "--timing-warmup", "3", "--seqlen", "64"])
    for start, stop in ((0, 3), (4, 6), (0, 2)):
        with pytest.warns(UserWarning, match=rf"--timing-warmup 3 leaves out every one of the {stop - start} steps "
                                             r"this run trains: its SUMMARY will have no tokens/s or MFU \(null\)"):
            common.Throughput.for_run(args, "cpu", start, stop)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meter = common.Throughput.for_run(args, "cpu", 2, 6)
    for step in range(2, 6):
        meter.add(step, 1.0, 10, 0.0)
    assert meter.steps == 1 and meter.tokens_per_s() == 10.0  # step 5 alone: 2 + 3 steps left out


def test_a_warmup_longer_than_the_run_is_named():
    """--warmup 100 --steps 6 was taken silently: the learning rate never reached --lr."""
    import warnings

    import fsdp2_train

    with pytest.warns(UserWarning, match=r"--warmup 100 is longer than --steps 6: the learning rate stops at 6% of"):
        fsdp2_train.parse_args(["--steps", "6", "--warmup", "100", "--seqlen", "64"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fsdp2_train.parse_args(["--steps", "6", "--warmup", "6", "--seqlen", "64"])
