"""bench/cp_sim.py runs (CPU, tiny sizes) and reports what it promises; the numbers themselves come from the GPU."""

import json
import time

import bench_scripts
import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def _load():
    return bench_scripts.load("cp_sim")


def _members(tokens: int, cp: int, seed: int):
    """A causal LPT ring of `cp` members on `tokens` random tokens (1 x tokens x 2 heads of 16): its schedule, each
    member's (q, k, v) shards, the key rows each member receives from each other one, and reference-backend options."""
    from fa4dist.context_parallel import Schedule, make_plan
    from fa4dist.context_parallel.ring import KernelOptions, KVBuffer

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, tokens, 2, 16, generator=gen) for _ in range(3))
    plan = make_plan(tokens, cp, "lpt", causal=True)
    sched = Schedule(plan, 1, plan.mask)
    shards = [[plan.shard(t, rank=r) for t in (q, k, v)] for r in range(cp)]
    held = {(r, s): KVBuffer.gather(shards[s][1], shards[s][2], sched.needed(r, s), 1)
            for r in range(cp) for s in range(cp) if s != r and sched.needed(r, s)}
    opts = KernelOptions(softmax_scale=None, softcap=None, backend="reference", deterministic=False)
    return sched, shards, held, opts


def test_cp_sim_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = _load().main(["--device", "cpu", "--tiny", "--cp", "2", "4", "--seqlens", "96", "--reps", "3"])
    data = json.loads((tmp_path / "cp_sim.json").read_text())
    assert len(data["rows"]) == len(rows) == 2 * 3 * 2  # cp x balancers x directions
    for row in data["rows"]:
        assert row["efficiency"] > 0 and len(row["t_rank_ms"]) == row["cp"]
        # the efficiency is the median of the interleaved rounds' own ratios
        assert len(row["efficiency_rounds"]) == 3 and row["efficiency"] == sorted(row["efficiency_rounds"])[1]
        assert (row["kernel_only_efficiency"] is None) == (row["direction"] != "fwd")
        # K+V of one rank's member buffer (fp32 here), plus fp32 dK+dV backward
        per_step = 2 * 2 * 16 * 4 * (96 // row["cp"])
        assert row["bytes_per_step"] == per_step * (2 if row["direction"] == "bwd" else 1)
    lpt = [r for r in rows if r["balancer"] == "lpt"]
    contiguous = [r for r in rows if r["balancer"] == "contiguous"]
    assert all(r["model_efficiency"] > 0.99 for r in lpt)
    assert all(r["model_efficiency"] < 0.8 for r in contiguous)
    for r in rows:  # plain causal: zigzag/LPT ranks run every step; contiguous rank i never needs later keys
        want = [r["cp"]] * r["cp"] if r["balancer"] != "contiguous" else list(range(1, r["cp"] + 1))
        assert r["steps"] == want, r


def test_cp_sim_window_drops_the_steps(tmp_path, monkeypatch):
    """A causal window of 16 tokens in chunks of 32 (contiguous) or 16 (zigzag, LPT): a rank computes only its own
    keys and those of the one or two ranks whose chunks touch its own."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = _load().main(["--device", "cpu", "--tiny", "--cp", "4", "--seqlens", "128", "--reps", "1", "--window", "15",
                         "--directions", "fwd"])
    by = {r["balancer"]: r for r in rows}
    assert by["contiguous"]["steps"] == [1, 2, 2, 2]  # rank 0 has no earlier keys
    assert by["contiguous"]["steps_run"] == [0, 1]
    assert max(by["zigzag"]["steps"]) == 3 and max(by["lpt"]["steps"]) <= 3
    key_row = 2 * 2 * 16 * 4  # K and V, 2 heads of 16 fp32
    for r in rows:
        assert r["window"] == [15, -1] and r["efficiency"] > 0
        # only the 15 keys before a chunk travel (LPT deals chunks round-robin: a rank may need two such runs)
        assert r["bytes_per_step"] == key_row * 15 * (1 if r["balancer"] != "lpt" else 2), r


def test_cp_sim_profiles_the_ranks_asked_for(tmp_path, monkeypatch):
    """--profile-ranks: one step list of those ranks and the whole-sequence call under torch.profiler, their ops
    by time, the host time and a cProfile table (--cprofile, the first profiled rank), in the row's JSON."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = _load().main(["--device", "cpu", "--tiny", "--cp", "2", "--seqlens", "64", "--reps", "1",
                         "--balancers", "lpt", "--profile-ranks", "1", "--cprofile", "5", "--queue-ahead-ms", "1"])
    data = json.loads((tmp_path / "cp_sim.json").read_text())
    for row in data["rows"]:
        assert list(row["profiles"]) == ["1", "full"]  # JSON keys are strings
        for who in ("1", "full"):
            prof = row["profiles"][who]
            kernels = prof["kernels"]
            assert kernels and all(k["ms"] > 0 and k["calls"] >= 1 for k in kernels)
            assert [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
            assert prof["busy_ms"] >= sum(k["ms"] for k in kernels) - 1e-9 and prof["host_ms"] > 0
        assert "function calls" in row["profiles"]["1"]["python_profile"]
        assert row["profiles"]["full"]["python_profile"] == ""
    assert all(r["profiles"].keys() == {1, "full"} for r in rows)


def test_rounds_bracket_the_ranks_and_rotate_them():
    """Each round times the whole-sequence call first and last (their mean is its T_full) and the ranks in an order
    rotated by the round, so that clocks drifting within a round favour no rank; the times come back in rank order."""
    sim = _load()
    calls = []
    clock = iter(range(1, 10_000))

    def timer(fn):
        fn()
        return float(next(clock))

    full = lambda: calls.append("full")  # noqa: E731
    ranks = [lambda r=r: calls.append(r) for r in range(3)]
    rounds = sim.interleaved_rounds(timer, full, [ranks], reps=3)
    warmup, timed = calls[:4], calls[4:]
    assert warmup == ["full", 0, 1, 2]
    assert timed == ["full", 0, 1, 2, "full", "full", 1, 2, 0, "full", "full", 2, 0, 1, "full"]
    assert rounds[0] == [(1 + 5) / 2, 2.0, 3.0, 4.0]
    assert rounds[1] == [(6 + 10) / 2, 9.0, 7.0, 8.0]  # rank order, whichever order they ran in


def test_rounds_log_every_call_and_find_each_rounds_slowest_rank():
    """With a log, every timed call records its round, its place in the round, who ran and the timer's details;
    slowest_rank_places then names, per round, the slowest rank, its place and its time against its own median."""
    sim = _load()
    times = iter([10.0, 1.0, 1.0, 3.0, 10.0,   # round 0: full, ranks 0 1 2, full
                  10.0, 1.0, 1.0, 1.1, 10.0])  # round 1: full, ranks 1 2 0, full

    class FakeTimer:
        last: dict = {}

        def __call__(self, fn):
            fn()
            seconds = next(times)
            self.last = dict(host_ms=seconds * 2, probe_ms=0.25)
            return seconds

    log = []
    sim.interleaved_rounds(FakeTimer(), lambda: None, [[lambda: None] * 3], reps=2, log=log)
    assert [(rec["round"], rec["place"], rec["who"]) for rec in log] == [
        (0, 0, "full"), (0, 1, (0, 0)), (0, 2, (0, 1)), (0, 3, (0, 2)), (0, 4, "full"),
        (1, 0, "full"), (1, 1, (0, 1)), (1, 2, (0, 2)), (1, 3, (0, 0)), (1, 4, "full")]
    assert log[3]["ms"] == 3000.0 and log[3]["host_ms"] == 6.0
    slow = sim.slowest_rank_places(log, cp=3)
    assert [(s["round"], s["rank"], s["place"]) for s in slow] == [(0, 2, 3), (1, 0, 3)]
    # rank 2 ran 3.0 and 1.0 s (median 2.0); rank 0 ran 1.0 and 1.1 (median 1.05)
    assert slow[0]["vs_own_median"] == 1.5 and abs(slow[1]["vs_own_median"] - 1.1 / 1.05) < 1e-12
    assert slow[0]["host_ms"] == 6.0 and slow[0]["host_ms_round_median"] == 2.0


def test_back_to_back_rounds_time_the_same_sequence_as_one_stream():
    """With back_to_back, each round's calls (the same bracketed, rotated sequence) go to the timer's back_to_back
    as one list, and its seconds land where the one-by-one timing puts them."""
    sim = _load()
    streams = []

    class StreamTimer:
        def __call__(self, fn):
            raise AssertionError("back_to_back rounds time the round as one stream")

        def back_to_back(self, fns):
            streams.append(len(fns))
            for fn in fns:
                fn()
            seconds = [float(len(streams) * 100 + i) for i in range(len(fns))]
            return seconds, [dict(host_ms=0.0, probe_ms=0.25)] * len(fns)

    calls = []
    full = lambda: calls.append("full")  # noqa: E731
    ranks = [lambda r=r: calls.append(r) for r in range(3)]
    log = []
    rounds = sim.interleaved_rounds(StreamTimer(), full, [ranks], reps=2, log=log, back_to_back=True)
    assert streams == [5, 5]
    assert calls[4:] == ["full", 0, 1, 2, "full", "full", 1, 2, 0, "full"]
    assert rounds[0] == [(100 + 104) / 2, 101.0, 102.0, 103.0]
    assert rounds[1] == [(200 + 204) / 2, 203.0, 201.0, 202.0]
    assert [rec["place"] for rec in log] == [0, 1, 2, 3, 4] * 2 and log[6]["who"] == (0, 1)


def test_steady_rounds_time_each_load_in_a_block_and_drop_its_first_pass():
    """steady_rounds queues, per round, passes + 1 whole-sequence calls and then passes + 1 passes over the ranks
    (rotated by round and pass) as one stream; each fn's result is the median of its calls after its block's first
    pass, and the log marks which calls were kept."""
    sim = _load()
    streams, calls = [], []

    class StreamTimer:
        def back_to_back(self, fns):
            streams.append(len(fns))
            for fn in fns:
                fn()
            # the first call of each block slow (the other load's clock), the rest by their place
            seconds = [1000.0 if i in (0, 3) else float(i) for i in range(len(fns))]
            return seconds, [dict(host_ms=0.0, probe_ms=0.25)] * len(fns)

    full = lambda: calls.append("full")  # noqa: E731
    ranks = [lambda r=r: calls.append(r) for r in range(2)]
    log = []
    rounds = sim.steady_rounds(StreamTimer(), full, [ranks], reps=2, passes=2, log=log)
    assert streams == [3 + 3 * 2] * 2
    assert calls[:3] == ["full", 0, 1]  # warm-up
    assert calls[3:12] == ["full"] * 3 + [0, 1, 1, 0, 0, 1]
    assert calls[12:] == ["full"] * 3 + [1, 0, 0, 1, 1, 0]
    # round 0: full at places 0 (dropped), 1, 2; rank 0 at 3 (dropped), 6, 7; rank 1 at 4 (dropped), 5, 8
    assert rounds[0] == [1.5, 6.5, 6.5]
    # round 1: rank 1 first (dropped at 3, kept 6, 7), rank 0 dropped at 4, kept 5, 8
    assert rounds[1] == [1.5, 6.5, 6.5]
    assert [rec["kept"] for rec in log[:9]] == [False, True, True, False, False, True, True, True, True]
    slow = sim.slowest_rank_places(log, cp=2)
    assert all(s["ms"] < 1000.0 * 1e3 for s in slow)  # a dropped call is never the round's slowest


def test_call_kernels_split_a_profiled_stream_by_its_probe_spins():
    """call_kernels assigns a back-to-back stream's kernels to its calls by the probe spin after each call (the
    queue-ahead spin first skipped), and steady_profile summarizes the kept calls of the profiled round."""
    from types import SimpleNamespace

    sim = _load()
    cuda = torch.autograd.DeviceType.CUDA

    def kernel(name, start, ms):
        return SimpleNamespace(name=name, device_type=cuda, device_time=ms * 1e3,
                               time_range=SimpleNamespace(start=start * 1e3, end=(start + ms) * 1e3))

    events = [kernel("spin_kernel", 0, 8), kernel("bwd", 8, 10), kernel("add", 18, 1), kernel("spin_kernel", 19, 0.25),
              kernel("bwd", 20, 4), kernel("spin_kernel", 25, 0.25), kernel("spin_kernel", 26, 0.25)]
    calls = sim.call_kernels(events, 3, spin_first=True)
    assert [c["busy_ms"] for c in calls] == [11.0, 4.0, 0.0]
    assert calls[0]["span_ms"] == 11.0 and calls[0]["kernels"] == [("bwd", 10.0), ("add", 1.0)]
    with pytest.raises(RuntimeError, match="split into 3 calls, expected 2"):
        sim.call_kernels(events, 2, spin_first=True)
    log = [dict(who="full", kept=True, ms=20.0, busy_ms=19.0, span_ms=19.5, kernels=[("bwd_full", 19.0)]),
           dict(who="full", kept=False, ms=30.0, busy_ms=29.0, span_ms=29.0, kernels=[]),
           dict(who=(0, 0), kept=True, ms=11.0, busy_ms=10.0, span_ms=10.5, kernels=[("bwd", 9.0), ("add", 1.0)]),
           dict(who=(0, 1), kept=True, ms=11.0, busy_ms=10.0, span_ms=10.5, kernels=[("bwd", 9.0), ("add", 1.0)])]
    summary = sim.steady_profile(log, cp=2)
    assert summary["full"]["busy_ms"] == 19.0 and summary["rank"]["ms"] == 11.0
    assert summary["busy_efficiency"] == pytest.approx(19.0 / 20.0)
    assert summary["rank_kernels"] == [("bwd", 9.0), ("add", 1.0)]


def test_pooled_t_full_compares_every_row_with_one_whole_sequence_time():
    """pool_t_full: rows that time the same whole-sequence call at one sequence length share the median of all their
    rounds' T_full (whatever their cp or balancer); another call (bwd) or length pools apart."""
    sim = _load()
    rows = [dict(seqlen=8, cp=2, full_call="fwd", t_full_rounds_ms=[10.0, 11.0], max_rank_ms=5.0, direction="fwd"),
            dict(seqlen=8, cp=4, full_call="fwd", t_full_rounds_ms=[13.0], max_rank_ms=2.5, direction="fwd/all"),
            dict(seqlen=8, cp=2, full_call="bwd", t_full_rounds_ms=[30.0], max_rank_ms=20.0, direction="bwd"),
            dict(seqlen=16, cp=2, full_call="fwd", t_full_rounds_ms=[40.0], max_rank_ms=25.0, direction="fwd")]
    pooled = sim.pool_t_full(rows)
    assert [t for _, t in pooled] == [11.0, 11.0, 30.0, 40.0]
    assert rows[0]["efficiency_of_medians_pooled"] == pytest.approx(11.0 / 10.0)
    assert rows[1]["efficiency_of_medians_pooled"] == pytest.approx(11.0 / 10.0)
    assert rows[2]["t_full_pooled_ms"] == 30.0 and rows[3]["efficiency_of_medians_pooled"] == pytest.approx(0.8)


def test_timer_back_to_back_on_cpu_times_each_call():
    sim = _load()
    timer = sim.Timer(torch.device("cpu"))
    seconds, details = timer.back_to_back([lambda: time.sleep(0.02), lambda: None])
    assert seconds[0] >= 0.02 and seconds[1] < 0.02 and details[0]["host_ms"] >= 20
    assert timer(lambda: None) < 0.02 and set(timer.last) == {"host_ms"}


@pytest.mark.parametrize("per_launch", [2, 3, 0])
def test_launch_groups_give_the_members_forward_with_fewer_items(per_launch):
    """--steps-per-launch N: a member's remote steps N at a time (0: all) in one key buffer, as ring_forward
    receives them, their fully visible blocks coalesced, give its (out, lse) up to fp32 rounding, in fewer items
    than the steps' lists."""
    sim = _load()
    sched, shards, held, opts = _members(512, 8, seed=0)
    fewer = 0
    for r in range(8):
        groups = sim.rank_launches(sched, r, held, per_launch)
        steps = [sched.items(r, sched.source(r, t)) for t in sched.member_steps(r)]
        assert len(groups) <= -(-len(sched.steps()) // (per_launch or len(sched.steps())))
        fewer += sum(len(items) for _, items in groups) < sum(len(x) for x in steps)
        a = sim.run_rank_fwd(sched, r, *shards[r], groups, 16, opts)
        b = sim.run_rank_fwd(sched, r, *shards[r], sim.rank_launches(sched, r, held, 1), 16, opts)
        torch.testing.assert_close(a.out, b.out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.lse, b.lse, rtol=1e-5, atol=1e-6)
    assert fewer >= 4


def test_cp_sim_launch_group_rows(tmp_path, monkeypatch):
    """--steps-per-launch 1 2 0: one fwd and one bwd row per launch-group size, labelled and recorded (bwd_lse keeps
    one launch per step); the kernels-alone ratio only on the plain forward row; every row's modeled transfers."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = _load().main(["--device", "cpu", "--tiny", "--cp", "4", "--seqlens", "128", "--reps", "1",
                         "--balancers", "lpt", "--directions", "fwd", "bwd", "bwd_lse",
                         "--steps-per-launch", "1", "2", "0"])
    assert [(r["direction"], r["steps_per_launch"]) for r in rows] == [
        ("fwd", 1), ("fwd/2", 2), ("fwd/all", 0), ("bwd", 1), ("bwd/2", 2), ("bwd/all", 0), ("bwd_lse", 1)]
    assert [r["kernel_only_efficiency"] is not None for r in rows] == [True] + [False] * 6
    assert all(r["exposed_transfer_ms_modeled"] is not None for r in rows)


def test_exposed_transfers_of_launch_groups():
    """The model behind the "+xfer" column: one step per launch hides a transfer shorter than a step; a group's
    transfers arrive one after another under the launch before it (the own step for the first group)."""
    exposed = _load().exposed_transfer_ms
    assert exposed([1] * 7, 0.3, 1.8) == 0.0
    assert exposed([7], 0.3, 1.8) == pytest.approx(7 * 0.3 - 1.8)
    assert exposed([4, 3], 0.3, 1.8) == 0.0
    assert exposed([4, 3], 0.5, 1.8) == pytest.approx(4 * 0.5 - 1.8)  # the second group's 1.5 ms hide under 7.2
    assert exposed([1, 1], 2.0, 1.0) == pytest.approx(2 * (2.0 - 1.0))
    assert exposed([], 1.0, 1.0) == 0.0


def test_exposed_backward_transfers_of_launch_groups():
    """The backward's model: the first group's keys under half the own step, each group's compute covering the
    next group's keys and the previous group's returns, the last returns under the own step's second half."""
    exposed = _load().exposed_backward_transfer_ms
    assert exposed([1] * 7, 0.3, 0.6, 4.0) == 0.0
    # one group of 7: its keys (2.1) under 2.0, its returns (4.2) under 2.0
    assert exposed([7], 0.3, 0.6, 4.0) == pytest.approx((2.1 - 2.0) + (4.2 - 2.0))
    # [4, 3]: keys 1.2 under 2.0; group 0 covers 0.9 of keys; group 1 covers group 0's 2.4 of returns; 1.8 under 2.0
    assert exposed([4, 3], 0.3, 0.6, 4.0) == 0.0
    # slow returns: group 1 (3.0) covers group 0's returns (4.0); the last returns (3.0) under 0.5
    assert exposed([4, 3], 0.3, 1.0, 1.0) == pytest.approx((1.2 - 0.5) + (4.0 - 3.0) + (3.0 - 0.5))
    assert exposed([], 1.0, 1.0, 1.0) == 0.0


@pytest.mark.parametrize("bad, message", [
    (["--cp", "0"], "--cp takes integers >= 1, got [0]"),
    (["--seqlens", "0"], "--seqlens takes integers >= 1, got [0]"),
    (["--reps", "0"], "--reps must be a positive integer, got 0"),  # was statistics.median's error after the sweep
    (["--balancers", "foo"], "argument --balancers: invalid choice: 'foo'"),
    (["--window", "-5"], "--window is the keys before each query (>= 0"),
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads (3) must divide --heads (4)"),
    (["--cp", "2", "--profile-ranks", "5"], "--profile-ranks [5]: no simulated --cp [2] has those ranks"),
    (["--profile-steady"], "--profile-steady profiles a steady round: give --steady PASSES too"),
    (["--steady", "-1"], "--steady takes the passes kept per round (>= 1; 0 is off), got -1"),
    (["--steady", "1", "--profile-steady"], "--profile-steady splits a CUDA stream's kernels"),
])
def test_cp_sim_refuses_bad_options_by_name(bad, message, tmp_path, monkeypatch, capsys):
    """Each failed with a traceback from inside make_plan, the kernels or statistics (--reps 0 after the sweep)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        _load().main(["--device", "cpu", "--tiny", *bad])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cp_sim_tiny_keeps_the_head_counts_given(tmp_path, monkeypatch):
    """--tiny shrinks the defaults only: it clamped --heads to 2 and --headdim to 16 but kept --kv-heads, so --heads
    8 --kv-heads 4 failed ("query heads (2) must be a multiple of ... (4)") and other sizes ran silently smaller."""
    monkeypatch.setenv("OUT", str(tmp_path))
    _load().main(["--device", "cpu", "--tiny", "--heads", "8", "--kv-heads", "4", "--headdim", "32", "--cp", "2",
                  "--seqlens", "32", "--reps", "1", "--balancers", "lpt", "--directions", "fwd"])
    meta = json.loads((tmp_path / "cp_sim.json").read_text())["meta"]
    assert (meta["heads"], meta["kv_heads"], meta["headdim"]) == (8, 4, 32)


def test_cp_sim_times_the_backward_of_a_loss_of_the_lse(tmp_path, monkeypatch):
    """--directions bwd_lse: every rank's steps take the lse's gradient (dlse in the row sums), beside one device's
    backward with dlse; its bytes per step are the backward's."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = _load().main(["--device", "cpu", "--tiny", "--cp", "2", "--seqlens", "96", "--reps", "1",
                         "--balancers", "lpt", "--directions", "bwd", "bwd_lse"])
    assert [r["direction"] for r in rows] == ["bwd", "bwd_lse"]
    assert rows[1]["efficiency"] > 0 and rows[1]["bytes_per_step"] == rows[0]["bytes_per_step"]


def test_overlapped_forward_promises_overlap_after_the_first_launch_and_keeps_the_bytes(monkeypatch, tmp_path):
    """--directions fwd_pdl / fwd_pdl_events: a member's launches after its first promise the contract
    overlap_previous (MemberForward's overlap_launches; the first follows unknown work), which changes no byte
    (the reference ignores it); both rows are timed and recorded beside fwd."""
    from fa4dist.context_parallel import ring

    sim = _load()
    sched, shards, held, opts = _members(256, 4, seed=1)
    promised = []
    real = ring.attention_forward_items

    def recording(*a, **kw):
        promised.append(kw["overlap_previous"])
        return real(*a, **kw)

    monkeypatch.setattr(ring, "attention_forward_items", recording)
    for r in range(4):
        launches = sim.rank_launches(sched, r, held, 1)
        plain = sim.run_rank_fwd(sched, r, *shards[r], launches, 16, opts)
        assert not any(promised)
        promised.clear()
        overlapped = sim.run_rank_fwd(sched, r, *shards[r], launches, 16, opts, overlap=True,
                                      landed=sim.landed_event("cpu"))
        assert promised == [False] + [True] * (len(promised) - 1) and len(promised) == 1 + len(launches)
        promised.clear()
        assert torch.equal(plain.out, overlapped.out) and torch.equal(plain.lse, overlapped.lse)
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = sim.main(["--device", "cpu", "--tiny", "--cp", "4", "--seqlens", "128", "--reps", "1",
                     "--balancers", "lpt", "--directions", "fwd", "fwd_pdl", "fwd_pdl_events"])
    assert [r["direction"] for r in rows] == ["fwd", "fwd_pdl", "fwd_pdl_events"]
    assert all(r["efficiency"] > 0 for r in rows)


def test_cp_sim_links_remodels_the_exposed_transfers_at_other_rates(tmp_path):
    """bench/cp_sim_links.py: the launch groups a row ran, and its "+xfer" at other link rates from cp_sim's own
    model (here a forward in groups of [4, 3] whose step's transfer takes a whole step's compute at 100 GB/s: the
    first group's 4 transfers exceed the own step by 3 steps; the second group's 3 hide under the first's 4)."""
    links = bench_scripts.load("cp_sim_links")
    assert links.launch_groups(4, 7) == [4, 3] and links.launch_groups(0, 7) == [7]
    assert links.launch_groups(1, 3) == [1] * 3
    step_ms = 2.0
    row = dict(direction="fwd/4", seqlen=1024, cp=8, window=[-1, -1], steps_per_launch=4, max_rank_ms=16.0,
               efficiency_of_medians=0.9, step_compute_ms=step_ms, bytes_per_step=int(100e9 * step_ms / 1e3))
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(dict(rows=[row])))
    (out,) = links.main([str(path), "--gbps", "100", "1e9"])
    assert out["groups"] == [4, 3]
    exposed = 4 * step_ms - step_ms  # the first group's transfers against the own step
    assert out["with_transfers"][100.0] == pytest.approx(0.9 * 16.0 / (16.0 + exposed))
    assert out["with_transfers"][1e9] == pytest.approx(0.9)
