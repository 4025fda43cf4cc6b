"""The README's first command: `torchrun --nproc-per-node N -m fa4dist.demo` (small sizes), and the torchrun-free
launcher `python -m fa4dist.demo --nproc N`."""

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

SMALL = ["--seqlen", "300", "--heads", "4", "--kv-heads", "2", "--headdim", "16", "--iters", "1"]


def _run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_demo_under_torchrun():
    out = _run(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "fa4dist.demo", *SMALL])
    assert "strategy: ring" in out and "max/mean compute" in out and "tokens/s" in out and "peak memory" in out
    assert out.count("(ok, tolerance") == 4, out
    assert out.rstrip().splitlines()[-1].startswith("PASS: fa4dist demo, 2 ranks"), out
    assert "\r" not in out  # not a terminal: plain progress lines


def test_demo_self_launched_packed_ulysses():
    out = _run([sys.executable, "-m", "fa4dist.demo", "--nproc", "2", "--docs", "5", "--strategy", "ulysses", *SMALL])
    assert "strategy: ulysses" in out and "5 packed documents" in out
    assert out.count("(ok, tolerance") == 4, out


@pytest.mark.parametrize("bad, message", [
    (["--seqlen", "0"], "--seqlen must be a positive integer, got 0"),
    (["--nproc", "0"], "--nproc must be a positive integer, got 0"),
    (["--iters", "0"], "--iters must be a positive integer, got 0"),
    (["--batch", "0"], "--batch must be a positive integer, got 0"),
    (["--heads", "-1"], "--heads must be a positive integer, got -1"),
    (["--num-chunks", "0"], "--num-chunks must be a positive integer, got 0"),
    (["--docs", "-3"], "--docs must be 0 \\(one sequence\\) or a positive number"),
    (["--docs", "500", "--seqlen", "128"], "--docs 500 needs at least as many tokens"),
    (["--docs", "4", "--batch", "2"], "--batch applies to the one-sequence mode"),
    (["--kv-heads", "3"], "--kv-heads \\(3\\) must divide --heads \\(8\\)"),
    (["--timeout", "-1"], "--timeout must be a positive, finite number of seconds, got -1"),
    (["--timeout", "inf"], "--timeout must be a positive, finite number of seconds, got inf"),
    (["--timeout", "nan"], "--timeout must be a positive, finite number of seconds, got nan"),
    (["--seed", str(2**64)], r"--seed must be in \[-2\*\*63, 2\*\*64\) \(torch's seeds\), got 18446744073709551616"),
    # the default strategy is ring: a bare --ulysses-degree failed on every rank with "ulysses_degree=2 contradicts
    # strategy='ring'", a strategy the command never named
    (["--ulysses-degree", "2"], "--ulysses-degree 2 needs --strategy hybrid \\(or auto\\); --strategy ring, the"),
    # these failed on every rank once started, naming the module's ulysses_degree= (hybrid without one: a traceback
    # per rank under torchrun)
    (["--strategy", "hybrid"], "--strategy hybrid needs --ulysses-degree U"),
    (["--backend", "bogus"], "--backend: backend must be 'auto' or one of \\[.*'reference'.*\\], got 'bogus'"),
    (["--strategy", "hybrid", "--ulysses-degree", "3", "--nproc", "4"],
     "--ulysses-degree 3 must divide the number of ranks \\(4\\)"),
    # one rank runs plain attention: a Ulysses degree there was ignored silently
    (["--strategy", "hybrid", "--ulysses-degree", "4", "--nproc", "1"],
     "--ulysses-degree 4 must divide the number of ranks \\(1\\)"),
    (["--strategy", "ulysses", "--ulysses-degree", "2", "--nproc", "4"],
     "--ulysses-degree 2 contradicts --strategy ulysses, which runs Ulysses over all 4 ranks"),
    # these failed once every rank had started, naming make_plan's num_chunks=
    (["--num-chunks", "5", "--nproc", "2"], "--num-chunks 5 must be a multiple of the number of ranks \\(2\\)"),
    (["--balancer", "zigzag", "--num-chunks", "2", "--nproc", "2"],
     "--balancer zigzag needs --num-chunks to be a multiple of 4 \\(two chunks per ring member and round; 2 ring"),
    (["--strategy", "hybrid", "--ulysses-degree", "3", "--balancer", "zigzag", "--num-chunks", "6", "--nproc", "6"],
     "--balancer zigzag needs --num-chunks to be a multiple of 4 \\(two chunks per ring member and round; 2 ring"),
])
def test_demo_refuses_sizes_it_cannot_run_by_name(bad, message, capsys):
    from fa4dist import demo

    with pytest.raises(SystemExit) as exit_info:
        demo._args(bad)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_rank_that_raises_ends_the_self_launched_demo_with_one_line():
    cmd = [sys.executable, "-m", "fa4dist.demo", "--nproc", "3", "--strategy", "ulysses", *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fa4dist demo: a rank failed: ValueError: Ulysses degree 3 is impossible" in proc.stderr


def test_the_cp_invariant_mode_from_the_environment_is_named_and_matches_one_process_bit_for_bit():
    """FA4DIST_CP_INVARIANT=1 (left exported from a recipe's run, say) switched the demo's module and its
    single-process reference to the invariant mode without a word in the output, which still listed the ring steps
    the mode does not run.  The header names it, a line says what runs instead, and out, dq, dk, dv are the
    single-process bytes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FA4DIST_CP_INVARIANT="1")
    proc = subprocess.run([sys.executable, "-m", "fa4dist.demo", "--nproc", "2", *SMALL], capture_output=True,
                          text=True, timeout=170, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "backend auto, cp_invariant (FA4DIST_CP_INVARIANT='1')" in out.splitlines()[0], out
    assert "cp_invariant: every ring member gathers the whole sequence's K/V" in out, out
    assert out.count("max abs error 0.00e+00, rel. error 0.00e+00") == 4, out


def test_auto_strategy_reports_the_plan_of_the_degree_it_runs():
    # heads 4/2 on 2 ranks: auto runs Ulysses 2, so the balance report is Ulysses' (no ring steps that never run)
    out = _run([sys.executable, "-m", "fa4dist.demo", "--nproc", "2", "--strategy", "auto", "--no-check", *SMALL])
    assert "strategy: ulysses" in out and "ulysses=2: each rank computes 1/2" in out, out
    assert "ring of" not in out and "receives K/V" not in out, out
    # nothing was compared: not a PASS (a script grepping for it took a run that checked nothing as passed)
    assert out.rstrip().splitlines()[-1].startswith("DONE: fa4dist demo, 2 ranks"), out


def test_nproc_that_contradicts_torchruns_world_size_is_refused(monkeypatch, capsys):
    """Started by a launcher (RANK and WORLD_SIZE set) the demo ignored --nproc silently: `RANK=0 WORLD_SIZE=1 python
    -m fa4dist.demo --nproc 4` ran and passed on 1 rank (torchrun itself refuses --nproc as an ambiguous prefix of
    its --nproc-per-node; other launchers pass it on). A --nproc other than the launcher's world size is refused by
    name; the same number, or none, runs."""
    from fa4dist import demo

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        demo._args(["--nproc", "4"])
    assert exit_info.value.code == 2
    assert "--nproc 4 contradicts the launcher's world size 2 (WORLD_SIZE)" in capsys.readouterr().err
    assert demo._args(["--nproc", "2"]).nproc == 2 and demo._args([]).nproc == 2
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert demo._args(["--nproc", "4"]).nproc == 4 and demo._args([]).nproc == 2  # spawned: the default is 2


def test_a_rank_whose_run_is_refused_under_a_launcher_prints_one_line(monkeypatch, capsys):
    """Under torchrun a size the library refuses (e.g. --strategy ulysses with heads that do not split over the
    ranks) ended every rank with a traceback from inside the module; as in the self-launched demo, each rank now
    prints one line naming the error and exits 1. So does a wait past --timeout (CommError) and a start that did not
    come together (a rank missing: it waited 30 minutes whatever --timeout said; a RANK past WORLD_SIZE hung). Other
    errors (a bug) keep their traceback."""
    from fa4dist import demo

    def refused(args):
        raise ValueError("Ulysses degree 2 is impossible: 3 query heads do not split evenly over 2 ranks")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(demo, "run", refused)
    assert demo.main(["--seqlen", "8"]) == 1
    assert capsys.readouterr().err == ("fa4dist demo: rank 1 failed: ValueError: Ulysses degree 2 is impossible: 3 "
                                       "query heads do not split evenly over 2 ranks\n")

    from fa4dist.context_parallel.comm import CommError

    def timed_out(args):
        raise CommError("fa4dist context parallel: rank 1 of 2 failed waiting for the agreement check (timeout 5s)")

    monkeypatch.setattr(demo, "run", timed_out)
    assert demo.main(["--seqlen", "8"]) == 1
    assert capsys.readouterr().err.startswith("fa4dist demo: rank 1 failed: CommError: fa4dist context parallel:")
    monkeypatch.setattr(demo, "run", lambda args: demo._setup(5.0))
    monkeypatch.setenv("WORLD_SIZE", "1")  # (RANK 1)
    assert demo.main(["--seqlen", "8"]) == 1
    assert capsys.readouterr().err == "fa4dist demo: rank 1 failed: ValueError: RANK 1 must be in [0, WORLD_SIZE 1)\n"

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(demo, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        demo.main(["--seqlen", "8"])


class _Writes:
    """A stderr that records each write call (a pipe's stderr is write-through: each call is a write of its own)."""

    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)

    def flush(self):
        pass


def test_a_ranks_failure_line_is_one_write(monkeypatch):
    """Under torchrun the ranks share one stderr pipe, and print() wrote each rank's failure line and its line end
    separately: two ranks' lines ran together ("... got 3fa4dist demo: rank 3 failed: ..."). Each is one write."""
    from fa4dist import demo

    def refused(args):
        raise ValueError("num_chunks must be a multiple of cp_size (4) so every rank holds as many chunks, got 3")

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(demo, "run", refused)
    writes = _Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    assert demo.main(["--seqlen", "8"]) == 1
    assert writes.calls == ["fa4dist demo: rank 2 failed: ValueError: num_chunks must be a multiple of cp_size (4) so "
                            "every rank holds as many chunks, got 3\n"]
