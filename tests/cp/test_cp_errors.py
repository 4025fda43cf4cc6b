"""Bad input and disagreeing ranks: every rank fails with the same clear error instead of hanging, on the first call
and on any later one (every call is checked), and a rank that never shows up costs the others one timeout whose
message names what they waited for."""

import contextlib
import re
import time

import pytest
import torch

import cp_cases
from cp_harness import GROUPS, fresh_group, shared_pool

pytestmark = pytest.mark.timeout(240)

TOL = 1e-10  # fp64 against the fp64 oracle


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


def _error(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), time.monotonic() - t0
    return None


def _inputs(plan, rank, heads=(4, 2), dtype=torch.float64, total=None):
    q, k, v, _ = cp_cases.global_inputs(0, total or plan.total_len, heads[0], heads[1], 8, dtype, batch=1)
    return [plan.shard(t, rank=rank) for t in (q, k, v)]


def bad_input_case(rank, world, kind):
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    opts = dict(strategy="ring", causal=True, backend="reference", timeout=30)
    plan = make_plan(40, 4)
    dtype, heads = torch.float64, (4, 2)
    if kind == "length" and rank == 1:
        q, k, v = _inputs(plan, rank)
        return _error(lambda: FA4ContextParallelAttention(GROUPS[4], **opts)(q[:, :-1], k[:, :-1], v[:, :-1], plan))
    if kind == "dtype" and rank == 1:
        dtype = torch.float32
    if kind == "causal" and rank == 2:
        opts["causal"] = False
    if kind == "plan" and rank == 3:
        plan = make_plan(40, 4, "contiguous")
    if kind == "heads" and rank == 0:
        heads = (2, 2)
    if kind == "ulysses":
        opts["strategy"], heads = "ulysses", (12, 6)
    if kind == "hybrid-no-degree":
        opts["strategy"] = "hybrid"
    module = FA4ContextParallelAttention(GROUPS[4], **opts)
    if kind == "cp-size":
        plan = make_plan(40, 2)
        q, k, v = _inputs(make_plan(40, 4), rank)
        return _error(lambda: module(q, k, v, plan))
    if kind == "no-plan":
        q, k, v = _inputs(plan, rank)
        return _error(lambda: module(q, k, v))
    if kind == "no-plan-on-one-rank":  # the ranks that pass their plan must not wait for rank 2 until the timeout
        q, k, v = _inputs(plan, rank)
        return _error(lambda: module(q, k, v, None if rank == 2 else plan))
    if kind == "packed-dims":
        q, k, v = _inputs(plan, rank)
        return _error(lambda: module(q, k, v, make_plan([0, 10, 40], 4)))
    if kind == "plan-type":
        q, k, v = _inputs(plan, rank)
        return _error(lambda: module(q, k, v, [0, 40]))
    if kind.startswith(("steps-per-launch", "ulysses-chunks")):  # one rank's environment asks for launch groups,
        # or for head chunks of the Ulysses exchange
        from fa4dist.context_parallel.ring import STEPS_PER_LAUNCH_ENV
        from fa4dist.context_parallel.ulysses import CHUNKS_ENV

        name = STEPS_PER_LAUNCH_ENV if kind.startswith("steps") else CHUNKS_ENV
        value = "two" if kind.endswith("-bad") else "0" if name == STEPS_PER_LAUNCH_ENV else "2"
        if name == CHUNKS_ENV:
            module = FA4ContextParallelAttention(GROUPS[4], **dict(opts, strategy="ulysses"))
            heads = (8, 4)
        with cp_cases.environment({name: value if rank == 2 else "1"}):  # (the others: the default, explicitly)
            q, k, v = _inputs(plan, rank, heads)
            return _error(lambda: module(q, k, v, plan))
    if kind.startswith("transport"):  # one rank's environment asks for copy-engine peer copies (CPU tensors here),
        # or for a transport that does not exist
        from fa4dist.context_parallel.peer import TRANSPORT_ENV

        with cp_cases.environment({TRANSPORT_ENV: ("nvlink" if kind.endswith("-bad") else "peer") if rank == 2
                                   else "group"}):
            q, k, v = _inputs(plan, rank, heads)
            return _error(lambda: module(q, k, v, plan))
    if kind == "cp-invariant-env":  # one rank's environment turns the invariant numerics on
        import os

        from fa4dist.kernels.invariant import ENV

        if rank == 2:
            os.environ[ENV] = "1"
        try:
            module = FA4ContextParallelAttention(GROUPS[4], **opts)
        finally:
            os.environ.pop(ENV, None)
        q, k, v = _inputs(plan, rank)
        return _error(lambda: module(q, k, v, plan))
    if kind == "unexpected-error":  # not one of the checks' own errors: the other ranks must still not wait for it
        from fa4dist.context_parallel.core import ContextParallel

        original = ContextParallel._local_check

        def failing(self, *args):
            if rank == 1:
                raise RuntimeError("an injected fault in rank 1's input checks")
            return original(self, *args)
        ContextParallel._local_check = failing
        try:
            q, k, v = _inputs(plan, rank)
            return _error(lambda: module(q, k, v, plan))
        finally:
            ContextParallel._local_check = original
    q, k, v = _inputs(plan, rank, heads, dtype)
    return _error(lambda: module(q, k, v, plan))


@pytest.mark.parametrize("kind, error, pattern", [
    ("length", "ValueError",
     "rank 1 rejected its inputs: ValueError: q holds 9 tokens but the plan gives cp rank 1 10 "),
    ("dtype", "ValueError", "ranks disagree on forward call 1: dtype: rank 0 'torch.float64', rank 1 'torch.float32'"),
    ("causal", "ValueError", "ranks disagree on forward call 1: mask: .*rank 2 'full'"),
    ("plan", "ValueError", "ranks disagree on forward call 1: plan: "),
    ("heads", "ValueError", "ranks disagree on forward call 1: heads_q: rank 0 2, rank 1 4"),
    ("ulysses", "ValueError", "Ulysses degree 4 is impossible: .*use strategy='hybrid' with ulysses_degree in \\[2\\]"),
    ("hybrid-no-degree", "ValueError", "strategy='hybrid' on one process group needs ulysses_degree="),
    ("cp-size", "ValueError", "the plan is for cp_size=2 but the process group has 4 ranks"),
    ("no-plan", "ValueError", "needs the plan the inputs were sharded with"),
    ("no-plan-on-one-rank", "ValueError", "rank 2 rejected its inputs: ValueError: context-parallel attention needs "
     "the plan the inputs were sharded with"),
    ("packed-dims", "ValueError", "q must be 3-D \\(local_tokens, heads, head_dim\\) for this packed-document plan"),
    # every rank's own TypeError keeps its type (the message adds that the other ranks made the same mistake)
    ("plan-type", "TypeError",
     "rank 0 rejected its inputs: TypeError: plan must be a ShardPlan .*got list \\(and 3 more rank"),
    ("unexpected-error", "ValueError", "rank 1 rejected its inputs: RuntimeError: an injected fault"),
    # groups change the messages a rank posts: ranks must agree on them, or fail together
    ("steps-per-launch", "ValueError", "ranks disagree on forward call 1: ring_steps_per_launch: .*rank 2 0"),
    # the invariant mode computes other numerics: a rank whose environment alone turns it on must not go along
    ("cp-invariant-env", "ValueError", "ranks disagree on forward call 1: .*cp_invariant: rank 0 False, .*rank 2 True"),
    ("steps-per-launch-bad", "ValueError", "rank 2 rejected its inputs: ValueError: FA4DIST_RING_STEPS_PER_LAUNCH "
     "must be an int >= 0"),
    ("ulysses-chunks", "ValueError", "ranks disagree on forward call 1: ulysses_chunks: .*rank 2 2"),
    ("transport-cpu", "ValueError", "rank 2 rejected its inputs: ValueError: FA4DIST_CP_TRANSPORT=peer .*needs "
     "CUDA tensors, got q on cpu"),
    ("transport-bad", "ValueError", "rank 2 rejected its inputs: ValueError: FA4DIST_CP_TRANSPORT must be one of "
     "group, peer .*got 'nvlink'"),
    ("ulysses-chunks-bad", "ValueError", "rank 2 rejected its inputs: ValueError: FA4DIST_ULYSSES_CHUNKS must be an "
     "int in \\[1, 64\\]"),
])
def test_every_rank_gets_the_same_clear_error(pool, kind, error, pattern):
    import re

    results = pool.run(bad_input_case, kind=kind, timeout=90)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} did not fail"
        name, message, elapsed = res
        assert name == error and re.search(pattern, message), (rank, name, message)
        assert elapsed < 20, elapsed  # an error, not a timeout


def drift_case(rank, world, strategy, kind):
    """Two plans (or dtypes) both used once by every rank; then rank 1 alone switches on the third call."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    heads = (4, 4)
    module = FA4ContextParallelAttention(GROUPS[4], strategy=strategy, backend="reference", timeout=60)
    a, b = make_plan(48, 4), make_plan(48, 4, "contiguous")
    for plan in (a, b):  # both seen once, in agreement
        module(*_inputs(plan, rank, heads), plan=plan)
    plan, dtype = a, torch.float64
    if rank == 1:
        plan, dtype = (b, dtype) if kind == "plan" else (a, torch.float32)
    return _error(lambda: module(*_inputs(plan, rank, heads, dtype), plan=plan))


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("kind, field", [("plan", "plan"), ("dtype", "dtype")])
def test_ranks_that_drift_apart_on_a_later_call_fail_at_once(pool, strategy, kind, field):
    results = pool.run(drift_case, strategy=strategy, kind=kind, timeout=90)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert name == "ValueError" and f"ranks disagree on forward call 3: {field}: " in message, message
        assert "rank 1" in message and elapsed < 5, (elapsed, message)


def backward_drift_case(rank, world):
    """Two forward calls; rank 1 back-propagates them in the other order."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
    plan = make_plan(48, 4)
    outs = [module(*[t.requires_grad_() for t in _inputs(plan, rank)], plan=plan) for _ in range(2)]
    order = [1, 0] if rank == 1 else [0, 1]
    return _error(lambda: [outs[i].sum().backward() for i in order])


def test_backward_of_different_calls_fails_clearly(pool):
    for res in pool.run(backward_drift_case, timeout=90):
        name, message, _ = res
        assert "ranks disagree on the backward of forward call" in message, message
        assert "call number" in message and "rank 1" in message, message


def two_modules_case(rank, world, swap):
    """Two modules alike (every multi-layer model has them), each called once: rank 1 calls them (swap="forward")
    or back-propagates them (swap="backward") in the other order. Each module's first call looks the same to
    a check without the module's number."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    mods = [FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
            for _ in range(2)]
    plan = make_plan(48, 4)
    order = [1, 0] if rank == 1 else [0, 1]
    if swap == "forward":
        return _error(lambda: [mods[i](*_inputs(plan, rank), plan=plan) for i in order])
    outs = [m(*[t.requires_grad_() for t in _inputs(plan, rank)], plan=plan) for m in mods]
    return _error(lambda: [outs[i].sum().backward() for i in order])


@pytest.mark.parametrize("swap, what", [("forward", "forward call 1"),
                                        ("backward", "the backward of forward call 1")])
def test_modules_called_in_different_orders_fail_naming_the_module(pool, swap, what):
    for rank, res in enumerate(pool.run(two_modules_case, swap=swap, timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert name == "ValueError" and f"ranks disagree on {what}: module (which attention module" in message, (
            rank, message)
        assert elapsed < 20, elapsed


def sinks_grad_case(rank, world):
    """Only rank 1's sinks take a gradient (q, k, v take none): the ranks disagree on the backward."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
    plan = make_plan(48, 4)
    sinks = torch.zeros(4, dtype=torch.float64).requires_grad_(rank == 1)
    return _error(lambda: module(*_inputs(plan, rank), plan=plan, sinks=sinks))


def test_sinks_that_take_a_gradient_on_one_rank_only_fail_naming_grad(pool):
    for rank, res in enumerate(pool.run(sinks_grad_case, timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert name == "ValueError" and "ranks disagree on forward call 1: grad: " in message, (rank, message)
        assert elapsed < 20, elapsed


def fresh_grid_groups(rank) -> dict:
    """Fresh groups of a 4-rank 2 x 2 grid (every rank makes them all, in the same order): this rank's "ulysses"
    ({0, 1} or {2, 3}), "ring" ({0, 2} or {1, 3}) and "all" group."""
    groups = {}
    for name, sets in (("ulysses", ([0, 1], [2, 3])), ("ring", ([0, 2], [1, 3])), ("all", ([0, 1, 2, 3],))):
        for ranks in sets:
            g = fresh_group(ranks)
            if rank in ranks:
                groups[name] = g
    return groups


def long_error_case(rank, world, grid):
    """Rank 1's input check fails with a message that is far longer once JSON-encoded than as text (quotes,
    newlines, non-ASCII): its frame of the agreement exchange must still fit, so every rank fails at once with the
    message instead of the others waiting for a rank that raised before the exchange.  Fresh groups: the old code
    broke the group it timed out on."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.context_parallel.core import ContextParallel
    from fa4dist.modules import FA4ContextParallelAttention

    groups = fresh_grid_groups(rank)
    if grid:
        module = FA4ContextParallelAttention(ulysses_group=groups["ulysses"], ring_group=groups["ring"],
                                             backend="reference", timeout=8)
        plan = make_plan(40, 4, ulysses_degree=2)
    else:
        module = FA4ContextParallelAttention(groups["all"], strategy="ring", backend="reference", timeout=8)
        plan = make_plan(40, 4)
    original = ContextParallel._local_check

    def failing(self, *args):
        if self.cp_rank == 1:
            raise RuntimeError("injected: " + 'a "quoted"\n\u00e9\u4e2d\U0001F600 ' * 1000)
        return original(self, *args)
    ContextParallel._local_check = failing
    try:
        return _error(lambda: module(*_inputs(plan, module.cp_rank), plan=plan))
    finally:
        ContextParallel._local_check = original


@pytest.mark.parametrize("grid", [False, True])
def test_an_error_message_too_long_for_the_frame_still_fails_every_rank_at_once(pool, grid):
    for rank, res in enumerate(pool.run(long_error_case, grid=grid, timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert name == "ValueError", (rank, name, message[:300])
        assert 'rank 1 rejected its inputs: RuntimeError: injected: a "quoted"\n\u00e9\u4e2d\U0001F600 ' in message, \
            (rank, message[:300])
        assert elapsed < 6, (rank, elapsed)  # an error, not the 8 s timeout


def grid_message_case(rank, world, kind):
    """A 2 x 2 grid whose ranks refuse or disagree in three patterns: every rank refuses its plan (a list), only
    rank 3 refuses, or the two Ulysses groups ({0, 1} and {2, 3}) each agree inside but call with different dtypes."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    groups = fresh_grid_groups(rank)
    module = FA4ContextParallelAttention(ulysses_group=groups["ulysses"], ring_group=groups["ring"],
                                         backend="reference", timeout=8)
    plan = make_plan(40, 4, ulysses_degree=2)
    dtype = torch.float32 if kind == "dtype-by-group" and rank >= 2 else torch.float64
    q, k, v = _inputs(plan, module.cp_rank, dtype=dtype)
    given = [1, 2] if kind == "all-refuse" or (kind == "one-refuses" and rank == 3) else plan
    return _error(lambda: module(q, k, v, plan=given))


@pytest.mark.parametrize("kind, pattern", [
    ("all-refuse", "rank 0 rejected its inputs: TypeError: plan must be a ShardPlan .* "
     "\\(and 3 more rank\\(s\\) too\\)$"),
    ("one-refuses", "rank 3 rejected its inputs: TypeError: plan must be a ShardPlan .*got list$"),
    ("dtype-by-group", "ranks disagree on forward call 1: dtype: "),
])
def test_a_grid_raises_one_message_on_every_rank(pool, kind, pattern):
    """On a 2-D grid the agreement's exchange runs over the Ulysses then the ring group: every rank must still raise
    the same message, counting every rank that refused (the Ulysses groups' messages differed, and the count was
    the first group's own)."""
    import re

    results = pool.run(grid_message_case, kind=kind, timeout=90)
    messages = set()
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert re.search(pattern, message), (rank, message)
        assert elapsed < 6, (rank, elapsed)  # an error, not the 8 s timeout
        messages.add(message)
    assert len(messages) == 1, messages


def functional_local_calls_case(rank, world):
    """The functional form on the group, then rank 0 alone makes more single-process calls (distinct options) than
    its cache holds, then the group call again: rank 0's own calls must not evict the shared object on rank 0 only
    (a rebuilt object restarts its call count and takes a new module number: the ranks would disagree)."""
    from fa4dist.context_parallel import context_parallel_attention, make_plan

    plan = make_plan(48, 4)
    kw = dict(strategy="ring", backend="reference", timeout=60)
    first = context_parallel_attention(*_inputs(plan, rank), plan, GROUPS[4], **kw)
    if rank == 0:
        x = torch.randn(1, 6, 2, 8, dtype=torch.float64)
        for i in range(80):
            context_parallel_attention(x, x, x, None, None, backend="reference", softmax_scale=0.1 + i / 100)
    again = _error(lambda: context_parallel_attention(*_inputs(plan, rank), plan, GROUPS[4], **kw))
    return again, bool(torch.equal(first, context_parallel_attention(*_inputs(plan, rank), plan, GROUPS[4], **kw)))


def test_one_ranks_own_functional_calls_do_not_break_the_groups(pool):
    for rank, (error, same) in enumerate(pool.run(functional_local_calls_case, timeout=90)):
        assert error is None and same, (rank, error)


def functional_subgroup_calls_case(rank, world):
    """The functional form on the whole group, then ranks 0 and 1 alone make more calls on their subgroup (distinct
    options) than a cache holds, then the whole group's call again: the subgroup's calls must not evict the whole
    group's object on ranks 0 and 1 only (rebuilt there, it restarts its call count and takes a new module number)."""
    from fa4dist.context_parallel import context_parallel_attention, make_plan

    plan, sub = make_plan(8, 4), make_plan(8, 2)
    kw = dict(strategy="ring", backend="reference", timeout=20)
    q = torch.randn(1, 8, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    context_parallel_attention(*[plan.shard(q, rank=rank)] * 3, plan, GROUPS[4], **kw)
    if rank < 2:
        for i in range(70):
            context_parallel_attention(*[sub.shard(q, rank=rank)] * 3, sub, GROUPS[2], softmax_scale=0.1 + i / 100,
                                       **kw)
    return _error(lambda: context_parallel_attention(*[plan.shard(q, rank=rank)] * 3, plan, GROUPS[4], **kw))


def test_a_subgroups_functional_calls_do_not_break_the_group(pool):
    for rank, error in enumerate(pool.run(functional_subgroup_calls_case, timeout=60)):
        assert error is None, (rank, error)


def functional_bad_option_case(rank, world, kind):
    """One rank's functional call has options it cannot run with (a bad value, or one its constructor refuses): the
    others, which made the call, must fail at once naming that rank's error, not wait out their timeout.  Fresh
    groups (on the 2-D ones the first call still has their grid check to make): the refused call leaves the ranks'
    objects on its groups out of step."""
    from fa4dist.context_parallel import context_parallel_attention, make_plan

    groups = fresh_grid_groups(rank)
    kw = dict(backend="reference", timeout=8)
    if kind == "grid":
        kw.update(ulysses_group=groups["ulysses"], ring_group=groups["ring"])
        plan = make_plan(40, 4, ulysses_degree=2)
        cp_rank = groups["ring"].rank() * 2 + groups["ulysses"].rank()
    else:
        kw.update(group=groups["all"], strategy="ring")
        plan, cp_rank = make_plan(40, 4), rank
    if rank == 1:
        kw.update(dict(window=dict(window=(-2, 0)), ulysses_degree=dict(ulysses_degree=3),
                       grid=dict(softcap=0.0))[kind])
    return _error(lambda: context_parallel_attention(*_inputs(plan, cp_rank), plan, **kw))


@pytest.mark.parametrize("kind, pattern", [
    ("window", "rank 1 rejected its inputs: ValueError: window left must be an int >= -1"),
    ("ulysses_degree", "rank 1 rejected its inputs: ValueError: ulysses_degree \\(3\\) must divide the cp size"),
    ("grid", "rank 1 rejected its inputs: ValueError: softcap must be finite and > 0"),
])
def test_a_functional_call_one_rank_refuses_fails_every_rank_at_once(pool, kind, pattern):
    import re

    for rank, res in enumerate(pool.run(functional_bad_option_case, kind=kind, timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert name == "ValueError" and re.search(pattern, message), (rank, name, message)
        assert elapsed < 6, (rank, elapsed, message)  # an error, not the 8 s timeout


def functional_later_call_case(rank, world, kind):
    """Three functional calls on a fresh group; on the second, rank 1 alone refuses an option ("refused"), or spells
    one that computes the same otherwise ("timeout": its own wait limit, "deterministic": False for None, which
    resolves to False): what the second and third calls raise on each rank (None: it computed)."""
    from fa4dist.context_parallel import context_parallel_attention, make_plan

    group = fresh_group(range(world))
    plan = make_plan(16, world)
    kw = dict(group=group, strategy="ring", backend="reference", timeout=8)
    x = _inputs(plan, rank)
    context_parallel_attention(*x, plan, **kw)
    odd = dict(refused=dict(window=(-2, 0)), timeout=dict(timeout=9), deterministic=dict(deterministic=False))[kind]
    second = _error(lambda: context_parallel_attention(*x, plan, **dict(kw, **(odd if rank == 1 else {}))))
    return second, _error(lambda: context_parallel_attention(*x, plan, **kw))


@pytest.mark.parametrize("kind", ["refused", "timeout", "deterministic"])
def test_a_functional_call_that_differs_on_one_rank_leaves_the_group_in_step(pool, kind):
    """Each option set of the functional form had its own object, with its own call count and module number: a
    rank whose call was refused (an object made for the refusal alone) fell one call behind, and every later call
    on the group failed naming the 'call number'; a rank that spelled an option that changes nothing (its timeout,
    deterministic=False where the others' None resolves to False) got a new object and the ranks failed naming the
    'module' and 'call number', not the option.  The functional calls on a group now share one call count."""
    for rank, (second, third) in enumerate(pool.run(functional_later_call_case, kind=kind, timeout=90)):
        if kind == "refused":
            assert second is not None and "rank 1 rejected its inputs: ValueError: window left" in second[1], second
        else:
            assert second is None, (rank, second)
        assert third is None, (rank, third)


def test_functional_form_checks_its_options_on_every_call():
    """A value that compares equal to an accepted one (1 == True) is still checked, as the module checks it."""
    from fa4dist.context_parallel import context_parallel_attention

    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    context_parallel_attention(q, q, q, backend="reference", causal=True)
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        context_parallel_attention(q, q, q, backend="reference", causal=1)
    context_parallel_attention(q, q, q, backend="reference", deterministic=False)
    with pytest.raises(TypeError, match="deterministic must be a bool or None, got int"):
        context_parallel_attention(q, q, q, backend="reference", deterministic=0)
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds, got None"):
        context_parallel_attention(q, q, q, backend="reference", timeout=None)


def test_functional_form_caches_one_object_per_parsed_option():
    """window=[3, 0] and (3, 0), softcap 2 and 2.0 made separate objects, with separate module numbers: ranks that
    spelled an option otherwise failed their agreement check naming the 'module', not the option.  So did spellings
    of one mask band (causal with window (3, 0) or (3, -1))."""
    from fa4dist.context_parallel import context_parallel_attention, core

    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)

    def cached(**options):
        before = {id(cp) for _, objects, _ in core._FUNCTIONAL.values() for cp in objects.values()}
        context_parallel_attention(q, q, q, backend="reference", **options)
        made = [cp for _, objects, _ in core._FUNCTIONAL.values() for cp in objects.values() if id(cp) not in before]
        return made[0] if made else None

    first = cached(window=(3, 0), softcap=2.0, softmax_scale=0.25)
    assert first is not None and first.window == (3, 0) and first.softcap == 2.0
    assert cached(window=[3, 0], softcap=2, softmax_scale=0.25) is None  # the same object again
    assert cached(window=(3, 0), softcap=2.0, softmax_scale=0.25) is None
    # one band, other spellings: causal + (3, 0), causal + (3, 5), non-causal + (3, 0) are causal + (3, -1)
    assert cached(window=(3, -1), softcap=2.0, softmax_scale=0.25) is None
    assert cached(window=(3, 5), softcap=2.0, softmax_scale=0.25) is None
    assert cached(causal=False, window=(3, 0), softcap=2.0, softmax_scale=0.25) is None
    assert cached(causal=False, window=(3, -1), softcap=2.0, softmax_scale=0.25) is not None  # another band
    with pytest.raises(TypeError, match="window left must be an int"):
        context_parallel_attention(q, q, q, backend="reference", window=[True, 0])


def double_backward_case(rank, world):
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
    plan = make_plan(48, 4)
    q, k, v = [t.requires_grad_() for t in _inputs(plan, rank)]
    out = module(q, k, v, plan=plan)
    return _error(lambda: torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True))


def test_double_backward_across_ranks_is_refused_clearly(pool):
    for res in pool.run(double_backward_case, timeout=90):
        name, message, _ = res
        assert name == "RuntimeError" and "double backward (create_graph=True) is not supported" in message


def double_backward_one_rank_case(rank, world):
    """Only rank 2 differentiates with create_graph=True: it must not raise alone and leave the others waiting in
    the backward's agreement check until the timeout."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
    plan = make_plan(48, 4)
    q, k, v = [t.requires_grad_() for t in _inputs(plan, rank)]
    out = module(q, k, v, plan=plan)
    return _error(lambda: torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=rank == 2))


def test_double_backward_on_one_rank_fails_on_every_rank_at_once(pool):
    for rank, res in enumerate(pool.run(double_backward_one_rank_case, timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert "ranks disagree on the backward of forward call 1: create_graph: " in message, (rank, message)
        assert "rank 2 True" in message and elapsed < 20, (rank, elapsed, message)


def torch_func_case(rank, world, everywhere, transform="grad"):
    """The module's inputs wrapped by a torch.func transform (grad) on every rank, or on rank 2 alone (the others
    call it plainly)."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(GROUPS[4], strategy="ring", backend="reference", timeout=60)
    plan = make_plan(48, 4)
    q, k, v = _inputs(plan, rank)
    if transform == "forward_ad":
        import torch.autograd.forward_ad as fwad

        with fwad.dual_level():
            return _error(lambda: module(fwad.make_dual(q, torch.ones_like(q)), k, v, plan=plan))
    if everywhere or rank == 2:
        return _error(lambda: torch.func.grad(lambda a: module(a, k, v, plan=plan).sum())(q))
    return _error(lambda: module(q, k, v, plan=plan))


@pytest.mark.parametrize("everywhere", [True, False])
def test_torch_func_transforms_fail_on_every_rank_by_name(pool, everywhere):
    """A torch.func transform has no rule for the ring's kernels: refused naming it (torch's message was 'it must
    override the setup_context staticmethod'), on every rank at once when one rank alone transforms."""
    for rank, res in enumerate(pool.run(torch_func_case, everywhere=everywhere, timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert "does not support torch.func transforms" in message and elapsed < 20, (rank, name, message)


def test_forward_mode_ad_is_refused_by_name(pool):
    """Forward-mode AD (torch.autograd.forward_ad) through the module: refused naming it (torch's message was 'You
    must implement the jvp function for custom autograd.Function')."""
    for rank, res in enumerate(pool.run(torch_func_case, everywhere=True, transform="forward_ad", timeout=90)):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert "fa4dist context parallel does not support forward-mode AD" in message, (rank, name, message)


def non_grid_case(rank, world, verify):
    """Ulysses groups {0, 1}, {2, 3} with ring groups {0, 3}, {1, 2}: every cp rank is distinct, but a ring step
    would pair ranks of different Ulysses indices (other heads) and a Ulysses group ranks of two ring members."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    ring = None
    for ranks in ([0, 3], [1, 2]):
        g = fresh_group(ranks)
        if rank in ranks:
            ring = g
    module = FA4ContextParallelAttention(ulysses_group=GROUPS["ulysses"], ring_group=ring, backend="reference",
                                         timeout=30, verify=verify)
    plan = make_plan(40, 4, ulysses_degree=2)
    return _error(lambda: module(*_inputs(plan, module.cp_rank), plan=plan))


@pytest.mark.parametrize("verify", [True, False])
def test_groups_that_do_not_form_a_grid_fail_on_every_rank(pool, verify):
    results = pool.run(non_grid_case, verify=verify, timeout=90)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert name == "ValueError" and "ulysses_group and ring_group do not form a 2-D grid" in message, message
        assert elapsed < 20, elapsed


def swapped_grid_case(rank, world):
    """Rank 0 alone passes its two groups the other way round (its ring group as ulysses_group): its exchanges on
    each group pair with another round of the grid check on the other ranks, whose values could still agree."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    groups = fresh_grid_groups(rank)
    uly, ring = (groups["ring"], groups["ulysses"]) if rank == 0 else (groups["ulysses"], groups["ring"])
    module = FA4ContextParallelAttention(ulysses_group=uly, ring_group=ring, backend="reference", timeout=2)
    plan = make_plan(16, 4, ulysses_degree=2)
    return _error(lambda: module(*_inputs(plan, module.cp_rank), plan=plan))


def test_groups_swapped_on_one_rank_fail_the_grid_check(pool):
    """Rank 2 passed the grid check (its rounds paired with rank 0's other rounds and saw the same ring and Ulysses
    ranks) and failed in the agreement check with "IndexError: list index out of range" (a grid-check row of two
    values read as an agreement row of four).  Each round now carries its number: rank 2 and the ranks it checks
    with find the grid broken; ranks 0 and 1, whose last round has no partner left, time out naming the check."""
    results = pool.run(swapped_grid_case, timeout=60)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} computed instead of failing"
        name, message, elapsed = res
        assert (name == "ValueError" and "ulysses_group and ring_group do not form a 2-D grid" in message or name
                == "CommError" and "the check that ulysses_group and ring_group form a grid" in message), (rank, res)
        assert elapsed < 4, (rank, elapsed)
    assert results[2][0] == results[3][0] == "ValueError", results


def grid_heads_case(rank, world):
    """The 2-D groups' Ulysses group size (2) cannot split 3 query heads: the hint is about the groups, not the
    ulysses_degree= option a caller with groups cannot use."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(ulysses_group=GROUPS["ulysses"], ring_group=GROUPS["ring"],
                                         backend="reference", timeout=30)
    plan = make_plan(40, 4, ulysses_degree=2)
    return _error(lambda: module(*_inputs(plan, module.cp_rank, heads=(3, 3)), plan=plan))


def test_groups_whose_ulysses_size_the_heads_forbid_get_a_hint_about_groups(pool):
    for res in pool.run(grid_heads_case, timeout=90):
        name, message, elapsed = res
        assert name == "ValueError" and "Ulysses degree 2 is impossible" in message, message
        assert "(the Ulysses group size is the degree)" in message and "ulysses_degree" not in message
        assert elapsed < 20, elapsed


def test_pool_still_healthy_after_errors(pool):
    res = pool.run(cp_cases.run_case, cp=4, seqlen=30)
    assert max(r["out"] for r in res) < 1e-10


def absent_rank_case(rank, world, verify):
    """Ranks 0 and 1 of a throw-away group: rank 1 never calls; rank 0 must fail within its 2 s timeout."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group([0, 1])  # broken by this test on purpose; nothing else uses it
    if rank != 0:
        time.sleep(4 if rank == 1 else 0)
        return None
    plan = make_plan(20, 2)
    module = FA4ContextParallelAttention(group, strategy="ring", backend="reference", timeout=2, verify=verify)
    return _error(lambda: module(*_inputs(plan, 0), plan=plan))


@pytest.mark.parametrize("verify, pattern", [
    (True, "rank 0 of 2 failed waiting for the agreement check of forward call 1 from all ranks of its group "
           "\\(timeout 2s; did every rank call it\\? A rank busy elsewhere for longer, e.g. saving a checkpoint alone, "
           "needs a larger timeout= \\(the module's, the call's, or enable_context_parallel's\\)\\)"),
    (False, "rank 0 of 2 failed waiting for K/V of forward ring step 1 \\(send to rank 1, recv from rank 1; "
            "timeout 2s\\)"),
])
def test_absent_rank_times_out_with_a_named_wait(pool, verify, pattern):
    import re

    name, message, elapsed = pool.run(absent_rank_case, verify=verify, timeout=60)[0]
    assert name == "CommError" and re.search(pattern, message), message
    assert elapsed < 10


def mixed_verify_case(rank, world, timeouts):
    """Ranks 0 and 1 of a throw-away group, rank 0 with verify=True and rank 1 with verify=False, each with its
    timeout of `timeouts`."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group([0, 1])  # broken by this test on purpose; nothing else uses it
    if rank > 1:
        return None
    plan = make_plan(20, 2)
    module = FA4ContextParallelAttention(group, strategy="ring", backend="reference", timeout=timeouts[rank],
                                         verify=rank == 0)
    return _error(lambda: module(*_inputs(plan, rank), plan=plan))


@pytest.mark.parametrize("timeouts", [(2, 5), (5, 2)], ids=["checking-rank-first", "unchecked-rank-first"])
def test_ranks_that_mix_verify_flags_are_told_so(pool, timeouts):
    """verify=True waits in the agreement check while a verify=False rank waits for its first ring transfer.  Both
    fail, and each message names the unchecked calls, whichever times out first: the unchecked rank's failures say
    so, and it posted its group's name once, which the checking rank's timeout reads (they named two waits, or
    'posted nothing')."""
    for name, message, elapsed in pool.run(mixed_verify_case, timeouts=timeouts, timeout=60)[:2]:
        assert name in ("CommError", "GroupBroken") and "verify=False" in message, message
        assert elapsed < 10


def different_groups_case(rank, world, refuse):
    """Ranks 0 and 1 of two throw-away groups of the same members (every rank makes both): rank 0 calls on the one,
    rank 1 on the other (refuse=False), or rank 1 makes the functional call without its group (refuse=True). Each
    rank: (its error's type, message, seconds to fail)."""
    from fa4dist.context_parallel import context_parallel_attention, make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    groups = fresh_group([0, 1]), fresh_group([0, 1])  # broken by this test on purpose; nothing else uses them
    if rank > 1:
        return None
    plan = make_plan(20, 2)
    inputs = _inputs(plan, rank)
    if refuse:
        group = groups[0] if rank == 0 else None
        return _error(lambda: context_parallel_attention(*inputs, plan, group, strategy="ring", backend="reference",
                                                         timeout=4))
    module = FA4ContextParallelAttention(groups[rank], strategy="ring", backend="reference", timeout=8)
    return _error(lambda: module(*inputs, plan=plan))


def test_ranks_calling_on_different_groups_fail_at_once_naming_both(pool):
    """Two ranks that call on different process groups (the same members) each wait for the other in their own
    group's agreement check: a deadlock that used to last the whole timeout, ending in 'did every rank call it?'.
    Each posts its wait once the blocking part of it (a quarter of the 8 s timeout here) has passed; the first to
    find the other waiting for it fails naming both waits, and posts that as its row of the other's exchange, which
    fails the other (GroupBroken, naming the same message) unless it found the cycle itself first."""
    results = pool.run(different_groups_case, refuse=False, timeout=60)
    for rank, (name, message, elapsed) in enumerate(results[:2]):
        assert name in ("CommError", "GroupBroken"), message
        assert "in the agreement check of forward call 1 on process group" in message, message
        assert "the ranks made different calls (on different process groups" in message, message
        assert elapsed < 6, (rank, elapsed)
    assert "CommError" in [r[0] for r in results[:2]]


def test_a_rank_that_refused_its_call_on_its_own_is_named_by_the_others_timeout(pool):
    """A rank whose functional call has no group (its plan is for cp = 2) refuses it without an exchange the other
    rank could read; the other waits out its timeout (the refusing rank may still make the call), and its message
    says what that rank did."""
    results = pool.run(different_groups_case, refuse=True, timeout=60)
    assert results[1][0] == "ValueError" and "there is no process group" in results[1][1]
    name, message, elapsed = results[0]
    assert name == "CommError" and "did every rank call it?" in message, message
    assert re.search(r"global rank 1 refused a call on its own at \d\d:\d\d:\d\d UTC and has made no exchange since "
                     r"\(a refusal its caller handled, or its call never came\): ValueError: the plan is for "
                     r"cp_size=2", message), message


def _ring_module_of_two(rank, timeout):
    """(module, plan of 20 tokens) on ranks 0 and 1 of a throw-away group (None on the other ranks)."""
    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group([0, 1])
    if rank > 1:
        return None
    module = FA4ContextParallelAttention(group, strategy="ring", backend="reference", timeout=timeout)
    return module, module.make_plan(20)


def module_helper_refusal_case(rank, world, helper):
    """Ranks 0 and 1 of a throw-away group (timeout 4 s): rank 1's module.make_plan / shard refuses its batch on its
    own (another length) and it makes no call; rank 0 calls forward.  (error name, message) per rank."""
    made = _ring_module_of_two(rank, 4)
    if made is None:
        return None
    module, plan = made
    if rank == 1:
        if helper == "make_plan":
            return _error(lambda: module.make_plan(torch.tensor([0, 12, 10], dtype=torch.int32)))
        return _error(lambda: module.shard(torch.zeros(1, 21, 2, 8), plan))
    return _error(lambda: module(*_inputs(plan, 0), plan=plan))


@pytest.mark.parametrize("helper", ["make_plan", "shard"])
def test_a_refusal_in_the_modules_plan_or_shard_is_named_by_the_waiting_ranks(pool, helper):
    """module.make_plan / shard / positions check a rank's own batch without an exchange: they post the refusal, so
    the ranks left waiting in their call name it when their timeout ends (they said "posted nothing" before)."""
    results = pool.run(module_helper_refusal_case, helper=helper, timeout=60)
    assert results[1][0] == "ValueError", results[1]
    name, message = results[0][:2]
    assert name == "CommError" and re.search(r"global rank 1 refused a call on its own at .* UTC and has made no "
                                             r"exchange since .*: ValueError", message), message


def handled_refusal_case(rank, world):
    """Ranks 0 and 1 of a throw-away group (timeout 3 s): rank 1 refuses a plan (caught), makes a call with both
    ranks, then stays away from the next one; rank 0's error for that call."""
    made = _ring_module_of_two(rank, 3)
    if made is None:
        return None
    module, plan = made
    if rank == 1:
        with contextlib.suppress(ValueError):
            module.make_plan(20, balancer="zigzagg")
    module(*_inputs(plan, rank), plan=plan)  # both ranks: rank 1 went on after its refusal
    if rank == 1:
        return None
    return _error(lambda: module(*_inputs(plan, rank), plan=plan))


def test_a_refusal_the_caller_handled_is_not_named_after_the_rank_made_an_exchange(pool):
    name, message = pool.run(handled_refusal_case, timeout=60)[0][:2]
    assert name == "CommError" and "global rank 1 posted nothing" in message and "zigzagg" not in message, message


def test_the_modules_shard_and_positions_refuse_a_plan_for_another_cp_size():
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    module = FA4ContextParallelAttention(None, backend="reference")
    wrong = make_plan(20, 2)
    with pytest.raises(ValueError, match=r"plan is for cp_size=2 but the module's group has 1"):
        module.shard(torch.zeros(1, 20, 2, 8), wrong)
    with pytest.raises(ValueError, match=r"plan is for cp_size=2 but the module's group has 1"):
        module.positions(wrong)


def skipped_call_case(rank, world, skip):
    """Ranks 0 and 1 of a throw-away group (timeout 3 s) make forward call 1 and its backward; then rank 1 skips call
    2's forward ("forward") or its backward ("backward").  Rank 0: (the error of the call it waited in, the errors
    of its later calls on the group: the module, the functional form, a new module, reduce_value, FixedPointGrads);
    rank 1: the error of its next call on the group, made once rank 0 has failed; ranks 0 and 1: the max abs
    difference between call 1's output and a call's on a group made after the failure."""
    import torch.distributed as dist

    from fa4dist.context_parallel import context_parallel_attention, make_plan
    from fa4dist.models import reduce_value
    from fa4dist.models.invariant_grads import FixedPointGrads
    from fa4dist.modules import FA4ContextParallelAttention

    group = fresh_group([0, 1])  # broken by this test on purpose; nothing else uses it
    plan = make_plan(20, 2)
    kw = dict(strategy="ring", backend="reference", timeout=3)
    if rank >= 2:
        fresh_group([0, 1])
        return None
    x = [t.requires_grad_() for t in _inputs(plan, rank)]
    module = FA4ContextParallelAttention(group, **kw)
    first = module(*x, plan=plan)
    first.sum().backward()
    result = None
    if skip == "forward":
        failed = _error(lambda: module(*x, plan=plan)) if rank == 0 else None
    else:
        out = module(*x, plan=plan)
        failed = _error(lambda: out.sum().backward()) if rank == 0 else None
    if rank == 0:
        later = [_error(lambda: module(*x, plan=plan)),
                 _error(lambda: context_parallel_attention(*x, plan, group, **kw)),
                 _error(lambda: FA4ContextParallelAttention(group, **kw)(*x, plan=plan)),
                 _error(lambda: reduce_value(torch.ones(1), group, timeout=3)),
                 _error(lambda: FixedPointGrads(group).finish())]
        result = failed, later
    dist.barrier(GROUPS[2])  # (rank 0 has failed)
    if rank == 1:
        result = _error(lambda: module(*x, plan=plan))
    new = fresh_group([0, 1])  # (every world rank, once rank 0 has failed)
    again = FA4ContextParallelAttention(new, **kw)(*x, plan=plan)
    return result, float((again - first).abs().max())


@pytest.mark.parametrize("skip, waited", [
    ("forward", "the agreement check of forward call 2 "),
    ("backward", "the agreement check of the backward of forward call 2 "),
])
def test_a_group_whose_exchange_failed_is_refused_at_once(pool, skip, waited):
    """After a rank that never made its call, the others' CommError left the group out of step: each later fa4dist
    call on it waited out another timeout (or paired with the absent rank's next call, which now met an exchange
    left unanswered).  Now every later call there (the module, the functional form, a new module, reduce_value,
    FixedPointGrads) is refused at once, naming the group, the earlier failure and the remedy; so is the absent
    rank's next call, which reads rank 0's failure in its agreement check; a new group works."""
    results = pool.run(skipped_call_case, skip=skip, timeout=60)
    (failed, later), diff0 = results[0]
    theirs = results[1][0]
    name, message, elapsed = failed
    assert name == "CommError" and f"failed waiting for {waited}" in message, message
    assert elapsed < 10, elapsed
    for res in later:
        assert res is not None, "a call on the broken group ran"
        name, message, elapsed = res
        assert name == "GroupBroken", (name, message)
        assert "refused: an earlier fa4dist exchange on this group failed on this rank" in message, message
        assert f"The earlier failure: fa4dist context parallel: rank 0 of 2 failed waiting for {waited}" in message
        assert "destroy_process_group" in message and "restart the job" in message, message
        assert elapsed < 0.5, (elapsed, message)  # at once, not after the 3 s timeout
    assert theirs is not None, "rank 1's call on the broken group ran"
    name, message, elapsed = theirs
    assert name == "GroupBroken" and "failed on rank 0 of the group, so its ranks are out of step" in message, message
    assert f"The earlier failure: fa4dist context parallel: rank 0 of 2 failed waiting for {waited}" in message
    assert elapsed < 0.5, (elapsed, message)
    assert diff0 < TOL and results[1][1] < TOL, results  # the group made after the failure computes


def out_of_step_case(rank, world):
    """Ranks 0 and 1 of a throw-away group: one store exchange with 4 values from rank 0 and 3 from rank 1 (as a
    rank one call behind pairs an agreement check with the grid check), then a second exchange: the errors."""
    from fa4dist.context_parallel.comm import Transport

    group = fresh_group([0, 1])
    if rank >= 2:
        return None
    t = Transport(group, timeout=3)
    return (_error(lambda: t.host_gather_ints([7] * (4 - rank), f"the exchange of rank {rank}")),
            _error(lambda: t.host_gather_ints([7] * 4, "the next exchange")))


def test_an_exchange_whose_ranks_sent_different_counts_says_out_of_step(pool):
    """The rows were returned as they came: a caller that read the fourth value of a three-value row failed with
    'IndexError: list index out of range'.  Now each rank raises CommError naming the exchange and the counts, and
    the group is refused from then on."""
    for rank, (first, second) in enumerate(pool.run(out_of_step_case, timeout=60)[:2]):
        assert first is not None, f"rank {rank} read rows of different lengths"
        name, message, _ = first
        assert name == "CommError", (name, message)
        assert f"the ranks are out of step in the exchange of rank {rank}: it takes {4 - rank} values from every " \
               "rank, got rank 0 4, rank 1 3" in message, message
        name, message, elapsed = second
        assert name == "GroupBroken" and "the next exchange on process group" in message, message
        assert elapsed < 0.5, elapsed


# ---- constructor and argument errors (single process) ------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(strategy="tree"), ValueError, "strategy must be one of"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool or None"),
    (dict(backend=3), TypeError, "backend must be a string"),
    (dict(backend="nope"), ValueError, r"backend must be 'auto' or one of \[.*'reference'.*\], got 'nope'"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(timeout=0), ValueError, "timeout must be a positive, finite number of seconds"),
    (dict(timeout=float("inf")), ValueError, "timeout must be a positive, finite number of seconds, got inf"),
    (dict(ulysses_degree=0), ValueError, "ulysses_degree must be a positive int"),
    (dict(ulysses_group=object()), ValueError, "ulysses_group and ring_group must be given together"),
    (dict(mesh=object()), TypeError, "mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    (dict(plan=42), TypeError, "plan must be a ShardPlan"),
    (dict(verify=0), TypeError, "verify must be a bool, got int"),
    (dict(verify="no"), TypeError, "verify must be a bool, got str"),
    # a contradiction at every cp size: refused without a group too, not first when the code runs on a cp group
    (dict(strategy="ring", ulysses_degree=2), ValueError, "ulysses_degree=2 contradicts strategy='ring'"),
])
def test_module_argument_errors(kwargs, error, pattern):
    from fa4dist.modules import FA4ContextParallelAttention

    with pytest.raises(error, match=pattern):
        FA4ContextParallelAttention(**kwargs)


def test_module_options_are_checked_at_construction():
    """What can be checked without inputs fails when the module is built, not on its first call: a backend name the
    registry does not know (for the functional form too), a plan for another cp size."""
    from fa4dist.context_parallel import context_parallel_attention, make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    with pytest.raises(ValueError, match="plan is for cp_size=2 but the module's group has 1 rank"):
        FA4ContextParallelAttention(plan=make_plan(8, 2))
    FA4ContextParallelAttention(plan=make_plan(8, 1), backend="reference")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):  # before the inputs are looked at
        context_parallel_attention(None, None, None, backend="Reference")
    with pytest.raises(ValueError, match="ulysses_degree=2 contradicts strategy='ring'"):  # without a group too
        context_parallel_attention(None, None, None, strategy="ring", ulysses_degree=2)


def test_single_process_plan_errors():
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="the plan is for cp_size=2 but there is no process group"):
        FA4ContextParallelAttention()(q, q, q, plan=make_plan(8, 2))
    # without a process group the plan's token count is checked as every rank checks its own
    for total in (5, 21):
        with pytest.raises(ValueError, match=f"q holds 8 tokens but the plan covers {total}"):
            FA4ContextParallelAttention()(q, q, q, plan=make_plan(total, 1))
    longer = torch.randn(1, 9, 2, 4)
    with pytest.raises(ValueError, match="k holds 9 tokens but the plan covers 8"):
        FA4ContextParallelAttention()(q, longer, longer, plan=make_plan(8, 1))
    with pytest.raises(ValueError, match="q must be 3-D \\(local_tokens, heads, head_dim\\) for this packed-document"):
        FA4ContextParallelAttention()(q, q, q, plan=make_plan([0, 3, 8], 1))


def test_single_process_takes_the_data_helpers_single_rank_plan():
    """fa4dist.data's plan of an unsplit packed sample (make_sample_plan(sample, 1)) is a plan the module takes:
    attention within each of its documents, as a cp-size-1 ShardPlan of the same boundaries gives."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.data.sharding import SingleRankPlan
    from fa4dist.modules import FA4ContextParallelAttention

    q, k, v = (torch.randn(8, 2, 4, dtype=torch.float64) for _ in range(3))
    attn = FA4ContextParallelAttention(causal=True)
    got = attn(q, k, v, plan=SingleRankPlan([0, 3, 8]))
    assert torch.equal(got, attn(q, k, v, plan=make_plan([0, 3, 8], 1)))
    with pytest.raises(ValueError, match="q holds 8 tokens but the plan covers 9"):
        attn(q, k, v, plan=SingleRankPlan([0, 3, 9]))


def test_single_rank_plan_shards_and_positions_as_forward_takes_it():
    """Where forward takes a SingleRankPlan (cp size 1), so do the constructor, shard and positions: the identity
    along the packed token dim and positions within each document, as a cp-size-1 ShardPlan of the boundaries."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.data.sharding import SingleRankPlan
    from fa4dist.modules import FA4ContextParallelAttention

    single, cp1 = SingleRankPlan([0, 3, 8]), make_plan([0, 3, 8], 1)
    attn = FA4ContextParallelAttention(plan=single)
    x = torch.randn(8, 2, 4, dtype=torch.float64)
    assert torch.equal(attn.shard(x), attn.shard(x, cp1))
    assert torch.equal(attn.positions(), attn.positions(cp1))
    assert attn.positions().tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert torch.equal(attn(x, x, x), attn(x, x, x, plan=cp1))
    with pytest.raises(ValueError, match="x has 9 tokens along seq_dim=0, but the plan expects 8"):
        attn.shard(torch.randn(9, 2, 4))


def single_rank_plan_on_a_group_case(rank, world):
    from fa4dist.data.sharding import SingleRankPlan
    from fa4dist.modules import FA4ContextParallelAttention

    if rank >= 2:
        return None
    single = SingleRankPlan([0, 3, 8])
    attn = FA4ContextParallelAttention(GROUPS[2], backend="reference")
    return (_error(lambda: FA4ContextParallelAttention(GROUPS[2], plan=single))[:2],
            _error(lambda: attn.shard(torch.randn(8, 2, 4), single))[:2], _error(lambda: attn.positions(single))[:2])


def test_single_rank_plan_is_refused_alike_on_a_group(pool):
    for result in pool.run(single_rank_plan_on_a_group_case)[:2]:
        (ctor_kind, ctor), *uses = result
        assert ctor_kind == "ValueError" and "plan is for cp_size=1 but the module's group has 2" in ctor, ctor
        for kind, message in uses:
            assert kind == "TypeError" and "SingleRankPlan is a plan for cp size 1 only" in message, message


def outsider_case(rank, world):
    """Ranks 2 and 3 build attention on the group of ranks 0 and 1 (new_group gives them a placeholder whose size
    and rank are -1): the error each construction raises there."""
    from fa4dist.context_parallel import context_parallel_attention
    from fa4dist.modules import FA4ContextParallelAttention

    if rank < 2:
        return None
    q = torch.randn(1, 4, 2, 8)
    return [_error(build)[:2] for build in (
        lambda: FA4ContextParallelAttention(GROUPS[2]),
        lambda: FA4ContextParallelAttention(ulysses_group=GROUPS[2], ring_group=GROUPS["ring"]),
        lambda: FA4ContextParallelAttention(ulysses_group=GROUPS["ulysses"], ring_group=GROUPS[2]),
        lambda: context_parallel_attention(q, q, q, None, GROUPS[2]),
    )]


def test_a_group_without_this_rank_is_refused_at_construction(pool):
    """Was a module of cp_size -1 and cp_rank -1, whose make_plan, shard and call then failed on other names."""
    for rank, errors in enumerate(pool.run(outsider_case)[2:], start=2):
        expected = [("ValueError", f"{name} is a process group that this rank (global rank {rank}) is not a member of")
                    for name in ("group", "ulysses_group", "ring_group", "group")]
        assert [(kind, message.split(";")[0]) for kind, message in errors] == expected, errors


def test_a_new_world_s_group_that_reuses_a_name_does_not_wait(pool, tmp_path):
    """The agreement exchanges were numbered per group name for the life of the process: after
    destroy_process_group and a new init_process_group, a group that got an old group's name (with other ranks)
    waited for its timeout on ranks that had used the old group and raised CommError."""
    results = pool.run(cp_cases.reinit_reused_name_case, timeout=60, init_file=str(tmp_path / "store"))
    assert results[0] is None and results[3] is None
    assert results[1] == 0.0 and results[2] == 0.0


def test_a_new_world_s_group_that_reuses_a_broken_group_s_name_starts_clean(pool, tmp_path):
    """The same, the old group broken on ranks 0 and 1 (an exchange of theirs failed on it): the new world's group
    of that name is not refused (the record of broken groups is per world)."""
    results = pool.run(cp_cases.reinit_reused_name_case, timeout=60, init_file=str(tmp_path / "store"), broken=True)
    assert results[0] is None and results[3] is None
    assert results[1] == 0.0 and results[2] == 0.0


def test_the_functional_form_lets_destroyed_groups_go(pool):
    """Its cache held every process group it was called on for the life of the process, destroyed ones too, and
    their connections with them: a process that made and destroyed groups leaked file descriptors per group."""
    for error, held, fds in pool.run(cp_cases.destroyed_groups_case, rounds=4):
        assert error < 1e-12
        assert held <= 1, held  # the last round's group, until the next call that makes an object
        assert fds[-1] <= fds[0], fds


def test_a_module_on_a_destroyed_group_says_so(pool):
    """It passed its agreement check (the exchange runs through the world's store, by the group's name) and failed
    deep in the transfers ('Group ... is not registered' from torch.distributed.P2POp)."""
    for name, message, seconds in pool.run(cp_cases.destroyed_module_group_case):
        assert name == "RuntimeError" and "group was destroyed" in message, message
        assert seconds < 5


def test_two_threads_calling_one_group_fail_at_once(pool):
    """Two threads calling a module at once (each rank's calls on a group pair up by number): the ranks paired one
    thread's call with another's, a silently wrong result, or waited out the timeout.  Now the second thread raises
    at once, naming the threads, and the first one (whose partner on another rank may have been the wrong call)
    raises when it ends; the module is in step again after, and a backward on another thread than its forward
    still runs."""
    import uuid

    results = pool.run(cp_cases.concurrent_threads_case, key=f"threads-{uuid.uuid4().hex}", timeout=60)
    threads = results[0][0]
    assert threads is not None and all(t is not None for t in threads), threads
    refused = [t for t in threads if "while thread" in t[1]]
    assert len(refused) == 1, threads
    kind, message, seconds = refused[0]
    assert kind == "RuntimeError" and "from one thread at a time" in message and seconds < 2, refused
    (kind, message, _), = [t for t in threads if t is not refused[0]]
    assert kind == "RuntimeError" and "its result is not trusted" in message, message
    for _, serial, other_thread in results[:2]:
        assert serial < TOL and other_thread < TOL, (serial, other_thread)


def test_what_is_not_a_process_group_is_refused_by_name(pool):
    """A DeviceMesh passed as a module's group (FA4Llama takes one as cp_group, the module as mesh=) or as
    FixedPointGrads' group failed with "Group DeviceMesh(...) is not registered", and a string with "'str' object has
    no attribute 'size'", from deep in torch.distributed.  Now the argument is named, with what to pass."""
    names = ["group", "group", "ulysses_group", "cp_group", "group", "group", "cp_group"]
    for errors in pool.run(cp_cases.not_a_group_case):
        for name, error in zip(names, errors):
            assert error is not None and error[0] == "TypeError", (name, error)
            assert error[1].startswith(f"{name} must be a torch.distributed ProcessGroup"), (name, error)
        for error in (errors[0], errors[4]):  # a DeviceMesh: what to pass instead
            assert "mesh.get_group()" in error[1], error


def unavailable_backend_case(rank, world, strategy):
    """A module whose backend cannot run on the inputs' device (sdpa on CPU tensors), then one on the reference on
    the same throw-away group: the first call's (error type, message, seconds) and the second's max abs error
    against the oracle (or its error)."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention
    from oracle import naive_attention

    group = fresh_group(range(world))  # a regression breaks it; nothing else uses it
    plan = make_plan(40, world)
    q, k, v, _ = cp_cases.global_inputs(0, 40, 4, 2, 8, torch.float64, batch=1)
    local = [plan.shard(t, rank=rank) for t in (q, k, v)]
    refused = _error(lambda: FA4ContextParallelAttention(group, strategy=strategy, backend="sdpa", timeout=10)(
        *local, plan=plan))
    module = FA4ContextParallelAttention(group, strategy=strategy, backend="reference", timeout=10)
    try:
        out = module(*local, plan=plan)
    except Exception as err:  # noqa: BLE001
        return refused, (type(err).__name__, str(err))
    return refused, float((out - plan.shard(naive_attention(q, k, v, causal=True)[0], rank=rank)).abs().max())


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_a_backend_unavailable_on_the_device_fails_every_rank_and_leaves_the_group_in_step(pool, strategy):
    """The ring's first kernel call raised "backend 'sdpa' is not available on device cpu" on every rank with the
    first step's transfers posted and never answered: the next call on the group waited out its timeout and raised
    a CommError about K/V of ring step 1.  Now the input check refuses the backend, through the agreement check,
    before any transfer."""
    for refused, after in pool.run(unavailable_backend_case, strategy=strategy, timeout=90):
        name, message, seconds = refused
        assert name == "ValueError" and "backend 'sdpa' is not available on device cpu" in message, refused
        assert message.startswith("fa4dist context parallel: rank 0 rejected its inputs"), message
        assert seconds < 5, seconds
        assert isinstance(after, float) and after < TOL, after


@contextlib.contextmanager
def _narrow_backend(direction, ranks=None):
    """A backend whose kernels cover head dims up to 8 only (as cute's cover some), registered in this worker for
    the block (its name): a call at head dim 16 is refused by its first kernel call in ``direction`` ("forward" or
    "backward"), on the ranks ``ranks`` (None: every rank)."""
    import torch.distributed as dist

    from fa4dist.kernels import Unsupported, registry
    from fa4dist.kernels.reference import ReferenceBackend

    class Narrow(ReferenceBackend):
        name = "test_head_dim_8"

        def supports(self, problem, direction_):
            if problem.head_dim > 8 and direction_ == direction and (ranks is None or dist.get_rank() in ranks):
                return Unsupported(f"head dim {problem.head_dim} (its kernels take up to 8)")
            return None

    saved = dict(registry._BACKENDS)
    registry.register_backend(Narrow())
    try:
        yield Narrow.name
    finally:
        registry._BACKENDS.clear()
        registry._BACKENDS.update(saved)


def _destroy(groups):
    """Destroys throw-away groups that a test broke on purpose, once every rank is done with them (their unanswered
    transfers kept gloo's loop threads spinning, taking the CPU from every later test of the pool)."""
    torch.distributed.barrier()
    for group in groups:
        torch.distributed.destroy_process_group(group)
    torch.distributed.barrier()


def refusing_backend_case(rank, world, direction):
    """A ring call at head dim 16 on :func:`_narrow_backend`, refused by its first kernel call on every rank
    (forward, or ``direction="backward"`` its backward), with ring transfers posted.  Then a call on the reference
    on the same throw-away group.  (error type, message, seconds) of both calls."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    with _narrow_backend(direction) as backend:
        group = fresh_group(range(world))  # broken by this test on purpose; nothing else uses it
        plan = make_plan(40, world)
        q, k, v, _ = cp_cases.global_inputs(0, 40, 2, 2, 16, torch.float64, batch=1)
        local = [plan.shard(t, rank=rank).requires_grad_() for t in (q, k, v)]
        module = FA4ContextParallelAttention(group, strategy="ring", backend=backend, timeout=20)
        refused = _error(lambda: module(*local, plan=plan).sum().backward())
        after = FA4ContextParallelAttention(group, strategy="ring", backend="reference", timeout=20)
        result = refused, _error(lambda: after(*local, plan=plan))
        _destroy([group])  # as the error says
        return result


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_kernel_error_with_ring_transfers_in_flight_breaks_the_group_at_once(pool, direction):
    """Every rank's kernel call raised with the ring's next transfers posted: no rank timed out, so the group was
    not recorded as out of step, and the next call on it paired its transfers with the unanswered ones, waited out
    its timeout and raised a CommError about K/V of ring step 1, which named neither the cause nor the remedy.
    Now the failure that stopped the ring marks the group: the next call raises GroupBroken at once, naming it."""
    for refused, after in pool.run(refusing_backend_case, direction=direction, timeout=120):
        name, message, _ = refused
        assert name == "ValueError" and "cannot compute this call: head dim 16" in message, refused
        name, message, seconds = after
        assert name == "GroupBroken", after
        assert f"stopped its {direction} ring steps with transfers in flight: ValueError: backend " in message, message
        assert seconds < 5, seconds


def refusing_ulysses_chunk_case(rank, world, direction, refusing):
    """Two Ulysses head chunks on a throw-away 2-D grid (Ulysses groups {0, 1} and {2, 3}, ring groups {0, 2} and
    {1, 3}, timeout 2 s) whose backend (:func:`_narrow_backend`) refuses ``direction`` on the ranks ``refusing``
    (None: all), in the first chunk, with the second chunk's exchange posted.  (error type, message, seconds) of
    that call, of the module's next call and of a call of a new module on this rank's Ulysses group alone."""
    from fa4dist.context_parallel import make_plan
    from fa4dist.context_parallel.ulysses import CHUNKS_ENV
    from fa4dist.modules import FA4ContextParallelAttention

    groups, mine = [], {}  # broken by this test on purpose; nothing else uses them
    for name, sets in (("ulysses", ([0, 1], [2, 3])), ("ring", ([0, 2], [1, 3]))):
        for ranks in sets:
            groups.append(fresh_group(ranks))
            if rank in ranks:
                mine[name] = groups[-1]
    q, k, v, _ = cp_cases.global_inputs(0, 40, 4, 4, 16, torch.float64, batch=1)  # 2 heads a member: 2 chunks
    with _narrow_backend(direction, refusing) as backend, cp_cases.environment({CHUNKS_ENV: 2}):
        module = FA4ContextParallelAttention(ulysses_group=mine["ulysses"], ring_group=mine["ring"],
                                             backend=backend, timeout=2)
        plan = module.make_plan(40)
        local = [plan.shard(t, rank=module.cp_rank).requires_grad_() for t in (q, k, v)]
        failed = _error(lambda: module(*local, plan=plan).sum().backward())
        again = _error(lambda: module(*local, plan=plan))
    torch.distributed.barrier()  # (every rank has failed: the failures it did not see are posted to it)
    alone = FA4ContextParallelAttention(mine["ulysses"], strategy="ulysses", backend="reference", timeout=2)
    plan = make_plan(40, 2)
    refused = _error(lambda: alone(*[plan.shard(t, rank=rank % 2) for t in (q, k, v)], plan=plan))
    _destroy(groups)
    return failed, again, refused


@pytest.mark.parametrize("direction, refusing", [("forward", None), ("backward", (1,))], ids=["all", "one"])
def test_a_failure_with_ulysses_head_chunks_in_flight_breaks_the_groups_at_once(pool, direction, refusing):
    """FA4DIST_ULYSSES_CHUNKS: a kernel's refusal in the first head chunk, with the second chunk's exchange posted,
    records the Ulysses group as out of step (the next call on it would pair with the unanswered messages): the
    next call raises GroupBroken at once, naming the refusal.  Where one rank alone refused, the others fail within
    their timeout, and a rank whose ring exchange timed out with its Ulysses chunks in flight (a 2-D grid) records
    its Ulysses group too (it recorded only the ring group: its Ulysses group was refused only through its
    partner's timeout)."""
    for rank, (failed, again, refused) in enumerate(pool.run(refusing_ulysses_chunk_case, direction=direction,
                                                             refusing=refusing, timeout=60)):
        name, message, seconds = failed
        if refusing is None or rank in refusing:
            assert name == "ValueError" and "cannot compute this call: head dim 16" in message, (rank, failed)
            assert seconds < 2, (rank, failed)  # (not after a timeout)
        else:
            assert name == "CommError" and "timeout 2s" in message, (rank, failed)
            assert seconds < 5, (rank, failed)
        for name, message, seconds in (again, refused):
            assert name == "GroupBroken" and seconds < 0.5, (rank, name, message, seconds)
        assert "failed on this rank" in refused[1], (rank, refused)
        if refusing is None or rank in refusing:
            assert f"stopped its {direction} Ulysses head chunks with exchanges in flight: ValueError: backend " \
                   in again[1], (rank, again)


def threads_own_groups_case(rank, world):
    """Two threads per rank, each calling on a process group of its own (the same members), skewed: rank 0's second
    thread and rank 1's first start 3 s late (past the blocking part of the 8 s timeout).  Each thread: its error,
    or None."""
    import threading

    from fa4dist.context_parallel import make_plan
    from fa4dist.modules import FA4ContextParallelAttention

    groups = fresh_group([0, 1]), fresh_group([0, 1])
    if rank > 1:
        return None
    plan = make_plan(20, 2)
    inputs = _inputs(plan, rank)
    errors = [None, None]

    def work(index):
        time.sleep(3 if index != rank else 0)
        module = FA4ContextParallelAttention(groups[index], strategy="ring", backend="reference", timeout=8)
        errors[index] = _error(lambda: module(*inputs, plan=plan))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_threads_with_groups_of_their_own_may_be_skewed(pool):
    """What the one-thread-per-group refusal recommends: a thread per group. A thread's blocking store wait held the
    process's store client for the whole timeout, so the other thread could not post its row: skewed threads timed
    out. Past the blocking part the wait polls; and a rank with another thread that may call is never read as
    deadlocked (fa4dist.context_parallel.comm.sole_caller)."""
    for rank, errors in enumerate(pool.run(threads_own_groups_case, timeout=60)[:2]):
        assert errors == [None, None], (rank, errors)


def test_sole_caller_counts_live_caller_threads_by_object_not_ident():
    """A finished caller's ident can be reused by a later daemon thread (seen on gloo runs): counted by ident, that
    daemon read as a caller and switched the deadlock detection off for the rest of the process."""
    import threading

    from fa4dist.context_parallel import comm

    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    comm._CALLERS.add(done)  # a caller that finished
    release = threading.Event()
    helper = threading.Thread(target=release.wait, daemon=True)  # a live daemon that never called
    helper.start()
    try:
        assert comm.sole_caller()
        comm._CALLERS.add(helper)  # a live daemon that did call: this thread is no longer the only caller
        assert not comm.sole_caller()
    finally:
        comm._CALLERS.discard(helper)
        comm._CALLERS.discard(done)
        release.set()
        helper.join()
