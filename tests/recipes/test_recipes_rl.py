"""The deterministic RL recipe on 2 CPU processes (cp = 2, deterministic): two runs with the same seed end with
bit-identical weights (the same hash), and the rollout-vs-training log-prob gap is reported and small."""

from __future__ import annotations

import re

import pytest

import launch  # noqa: E402
from recipe_metrics import step_metrics  # noqa: E402

ARGS = ["--cp", "2", "--sft-steps", "2", "--steps", "3", "--prompts", "4", "--group-size", "4", "--seed", "7"]


def run_once(tmp_path, name):
    out = launch.torchrun("rl_deterministic.py", ARGS + ["--metrics-out", tmp_path / f"{name}.jsonl"])
    digest = re.findall(r"^weights_sha256=([0-9a-f]{64})$", out.stdout, flags=re.M)
    assert len(digest) == 1, out.stdout[-3000:]
    return digest[0], launch.summary(out.stdout)


@pytest.mark.timeout(420)
def test_rl_two_runs_same_hash(tmp_path):
    h1, s1 = run_once(tmp_path, "a")
    h2, s2 = run_once(tmp_path, "b")
    assert h1 == h2
    assert (s1["cp"], s1["dp"]) == (2, 1)
    assert s1["rl_steps"] == 3 and s1["max_rollout_vs_train_logp_diff"] is not None
    assert s1["max_rollout_vs_train_logp_diff"] < 1e-3  # same weights, fp32: only summation order differs
    assert s1 == s2


@pytest.mark.timeout(420)
def test_cp_invariant_prefill_scores_equal_training_log_probs_exactly(tmp_path):
    """With cp_invariant attention and row-invariant matrix products, the rollout's scoring prefill (one process,
    no CP) and the cp = 2 training forward give the same log-prob bits for the same tokens."""
    out = launch.torchrun("rl_deterministic.py", ARGS + ["--cp-invariant", "--score-with-prefill"])
    s = launch.summary(out.stdout)
    assert s["cp_invariant"] and s["rollout_logp"] == "prefill"
    assert s["max_rollout_vs_train_logp_diff"] == 0.0, s
    assert s["max_sampling_vs_prefill_logp_diff"] is not None


@pytest.mark.timeout(420)
def test_cp_invariant_runs_end_with_the_same_weights_at_cp_1_and_2(tmp_path):
    """--cp-invariant: attention, matrix products and parameter gradients (int64 fixed point) do not depend on the
    cp size, so a cp = 1 and a cp = 2 run print the same weights hash and log the same losses (fixed-point sums of
    the token terms: the ranks' float shares, all-reduced, differed in their last bits)."""
    hashes, losses = [], []
    for cp in (1, 2):
        metrics = tmp_path / f"cp{cp}.jsonl"
        out = launch.ranks("rl_deterministic.py", _args_at(cp) + ["--cp-invariant", "--metrics-out", metrics],
                           nproc=cp)
        s = launch.summary(out.stdout)
        assert s["cp"] == cp and s["cp_invariant"]
        hashes.append(s["weights_sha256"])
        losses.append([x.hex() for x in step_metrics(metrics)])
    assert hashes[0] == hashes[1]
    assert len(losses[0]) == 5 and losses[0] == losses[1], losses


def _args_at(cp):
    """The module's ARGS at another cp size."""
    args = list(ARGS)
    args[args.index("--cp") + 1] = str(cp)
    return args


@pytest.mark.parametrize("bad, message", [
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--sft-steps", "-5"], "--sft-steps: must be >= 0, got -5"),
    (["--prompts", "0"], "--prompts: must be a positive integer, got 0"),
    (["--task-len", "0"], "--task-len: must be a positive integer, got 0"),
    (["--temperature", "0"], "--temperature must be positive and finite"),
    (["--clip-eps", "-1"], "--clip-eps must be >= 0"),
    (["--alphabet", ""], "--alphabet must hold at least one letter"),
    (["--alphabet", "abé"], "--alphabet letters must each be one byte"),  # é: two bytes, the lengths were off
])
def test_rl_options_it_cannot_run_are_refused_by_name(bad, message, capsys):
    import rl_deterministic

    with pytest.raises(SystemExit):
        rl_deterministic.parse_args(bad)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--seqlen", "64"], ["--batch-size", "4"], ["--packing", "stream"],
                                  ["--data", "README.md"], ["--data"], ["--dtype", "bf16"],
                                  ["--timing-warmup", "0"], ["--peak-tflops", "989"]])
def test_shared_options_the_rl_recipe_does_not_use_are_refused_by_name(flag, capsys):
    """The shared parser's data, dtype and throughput options have no meaning for the RL recipe (its sequences are
    the task's prompts and answers, its batch --prompts x --group-size, its models fp32): they were accepted and
    ignored; now each is refused naming it, even at its default value, and --help says so."""
    import rl_deterministic

    with pytest.raises(SystemExit):
        rl_deterministic.parse_args(["--cp", "2"] + flag)
    err = capsys.readouterr().err
    if flag == ["--data"]:  # a bare --data is refused by every recipe (it needs a path)
        assert "--data: expected at least one argument" in err
    else:
        assert f"{flag[0]} is not used by rl_deterministic: " in err
    assert rl_deterministic.parse_args(["--cp", "2"]).cp == 2  # without them it parses


def test_rl_help_marks_the_shared_options_it_refuses(capsys):
    import rl_deterministic

    with pytest.raises(SystemExit):
        rl_deterministic.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--seqlen SEQLEN", "--batch-size BATCH_SIZE", "--packing {documents,stream}",
                 "--dtype {auto,bf16,fp32}"):
        assert f"{flag} not used by this recipe (refused): " in out


def test_a_batch_dp_does_not_divide_is_refused_before_the_process_group(launched_without_a_rendezvous):
    """--prompts x --group-size completions that the dp replicas cannot split evenly: refused from torchrun's
    WORLD_SIZE before any process group or model exists (it was refused after both models were built)."""
    import rl_deterministic

    launched_without_a_rendezvous(2)
    with pytest.raises(SystemExit, match=r"prompts x group-size \(9\) must be a multiple of dp \(2\)"):
        rl_deterministic.main(["--prompts", "3", "--group-size", "3"])


def test_every_seed_torch_takes_seeds_the_steps_generators():
    """The per-step generator's seed (seed * 1_000_003 + step) overflowed torch's seed range for a --seed above
    ~1.8e13 (a nanosecond timestamp): a ValueError at the first step, the models built. It wraps to 64 bits now,
    the same generator as before for every seed that worked."""
    import torch

    import rl_deterministic

    def draws(gen):
        return torch.randint(0, 2**30, (4,), generator=gen)

    for seed, step in ((0, 0), (3, 7), (-1, 2), (9_000_000_000_000, 1)):
        old = torch.Generator().manual_seed(seed * 1_000_003 + step)  # in torch's range: taken as it was
        assert torch.equal(draws(rl_deterministic.step_generator(seed, step)), draws(old))
    big = rl_deterministic.step_generator(1_700_000_000_000_000_000, 5)
    assert torch.equal(draws(big), draws(rl_deterministic.step_generator(1_700_000_000_000_000_000, 5)))
    assert not torch.equal(draws(big), draws(rl_deterministic.step_generator(1_700_000_000_000_000_000, 6)))
