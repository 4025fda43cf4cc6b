"""GPU tests of the cute backend's work-list forward (few launches per list) against its own per-item loop and the
fp64 reference.

A list runs as launches of items with disjoint query rows (fa4dist.kernels.worklist.forward_launches), each one
kernel launch over an item table. Every row must get the loop's bytes (the same tiles from the same first key, the
same kernel math), on random lists with overlapping rows, fresh and running buffers, packed documents, dense
batches, GQA, windows and soft-capping, and on the lists of real ring schedules. Fresh inputs every case; fresh
outputs are poisoned with NaN.
"""

import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from fa4dist.context_parallel.plan import make_plan  # noqa: E402
from fa4dist.context_parallel.schedule import Schedule  # noqa: E402
from fa4dist.kernels import WorkItem, attention_forward_items  # noqa: E402
from fa4dist.kernels.cute import forward as cute_fwd  # noqa: E402
from fa4dist.kernels.cute.backend import CuteSm90Backend  # noqa: E402

if not cute_fwd.is_available():
    pytest.skip("cute backend not available", allow_module_level=True)

TOL = {torch.bfloat16: 2.5e-2, torch.float16: 4e-3}  # max abs error of out against the fp64 reference


def _run(q, k, v, items, out, lse, fresh, launches=None, **kw):
    """attention_forward_items on cute; ``launches``: a list that receives the one-launch calls' item counts."""
    if launches is None:
        return attention_forward_items(q, k, v, items, out, lse, fresh=fresh, backend="cute", **kw)
    real = cute_fwd.forward_worklist

    def counting(*a, **k2):
        launches.append(a[5].numel() // 5)
        return real(*a, **k2)

    cute_fwd.forward_worklist = counting
    try:
        return attention_forward_items(q, k, v, items, out, lse, fresh=fresh, backend="cute", **kw)
    finally:
        cute_fwd.forward_worklist = real


def _loop(monkeypatch, *args, **kw):
    """The same list through the per-item loop (the backend declines the one-launch path)."""
    with monkeypatch.context() as m:
        m.setattr(CuteSm90Backend, "forward_items", lambda self, *a, **k: None)
        return _run(*args, **kw)


def _buffers(q, fresh, packed, gen):
    shape = (*q.shape[:-1], q.shape[-1])
    lse_shape = (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
    if fresh:
        return (torch.full(shape, float("nan"), device="cuda"), torch.full(lse_shape, float("nan"), device="cuda"))
    out = torch.randn(shape, device="cuda", generator=gen)
    lse = torch.randn(lse_shape, device="cuda", generator=gen) + 3
    lse[..., ::7] = float("-inf")  # rows no earlier block reached hold the empty result (0, -inf)
    (out[::7] if packed else out[:, ::7]).zero_()
    return out, lse


def _random_items(rng, n_rows, n_keys, count, masks):
    items = []
    for _ in range(count):
        qa = rng.randrange(n_rows)
        ql = rng.randint(1, min(n_rows - qa, 700))
        ka = rng.randrange(n_keys)
        kl = rng.choice([0, rng.randint(1, n_keys - ka), rng.randint(1, min(n_keys - ka, 300))])
        items.append(WorkItem(qa, ql, ka, kl, rng.randint(0, 900), rng.randint(0, 900), **rng.choice(masks)))
    return items


@pytest.mark.parametrize("seed", range(10))
def test_random_lists_equal_the_loop(monkeypatch, seed):
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    d = rng.choice([64, 128])
    hk = rng.choice([1, 2])
    h = hk * rng.choice([1, 2, 4])
    packed = seed % 3 != 0
    n_rows, n_keys = rng.randint(100, 1500), rng.randint(100, 1500)
    masks = [dict(causal=True), dict(), dict(causal=True, window=(rng.randint(0, 400), -1))]
    lead = (n_rows,) if packed else (2, n_rows)
    klead = (n_keys,) if packed else (2, n_keys)
    q = torch.randn(*lead, h, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(*klead, hk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    items = _random_items(rng, n_rows, n_keys, rng.randint(1, 12), masks)
    fresh = seed % 2 == 0
    softcap = 30.0 if seed % 4 == 1 else None
    out0, lse0 = _buffers(q, fresh, packed, gen)
    out, lse = out0.clone(), lse0.clone()
    loop = out0.clone(), lse0.clone()
    launches = []
    _run(q, k, v, items, out, lse, fresh, launches, softcap=softcap)
    _loop(monkeypatch, q, k, v, items, *loop, fresh, softcap=softcap)
    if any(it.k_len for it in items):  # (a list without keys only clears its fresh rows: nothing to launch)
        assert launches, "the list ran through the loop, not the one-launch path"
    covered = torch.zeros(n_rows, dtype=torch.bool, device="cuda")
    for it in items:
        covered[it.q_start:it.q_start + it.q_len] = True
    rows = (lambda t: t[covered]) if packed else (lambda t: t[:, covered])  # noqa: E731
    assert torch.equal(rows(out), rows(loop[0])), "out differs from the per-item loop"
    assert torch.equal(lse[..., covered], loop[1][..., covered]), "lse differs from the per-item loop"
    assert torch.equal(rows(out).isnan().sum(), torch.tensor(0, device="cuda")), "a covered row stayed poisoned"
    # the value: the fp64 reference merging the same items into the same start
    ref = out0.double().clone(), lse0.double().clone()
    attention_forward_items(q.double(), k.double(), v.double(), items, *ref, fresh=fresh, backend="reference",
                            softcap=softcap)
    err = (rows(out).double() - rows(ref[0])).abs().max().item()
    assert err <= TOL[dtype], f"out error {err} against the fp64 reference"
    lse_err = (lse[..., covered].double() - ref[1][..., covered]).nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    assert lse_err <= 1e-3 * 4, f"lse error {lse_err}"
    assert torch.equal(lse[..., covered].isinf(), ref[1][..., covered].isinf())


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_ring_schedule_lists_equal_the_loop_in_few_launches(monkeypatch, packed, cp, d):
    """Every (member, source) list of a causal ring schedule: the loop's bytes, in at most as many launches as
    the list has waves and variants (one per step for zigzag's remote steps)."""
    gen = torch.Generator(device="cuda").manual_seed(cp * 10 + d)
    total = 4096 * cp
    docs = [0, 700, 3000, 3100, total - 1000, total] if packed else None
    plan = make_plan(torch.tensor(docs) if packed else total, cp, "zigzag" if not packed else "lpt")
    sched = Schedule(plan, 1, True)
    rows = plan.total_len // cp + 4096
    q = torch.randn(1, rows, 4, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, rows, 2, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    fewer = 0
    for member in range(cp):
        for step in range(cp):
            source = sched.source(member, step)
            items = sched.items(member, source)
            if not items:
                continue
            fresh = step == 0
            out, lse = _buffers(q, fresh, False, gen)
            loop = out.clone(), lse.clone()
            launches = []
            _run(q, k, v, list(items), out, lse, fresh, launches)
            _loop(monkeypatch, q, k, v, list(items), *loop, fresh)
            n_items = sum(1 for it in items if it.q_len and it.k_len)
            assert 1 <= len(launches) <= n_items
            fewer += n_items - len(launches)
            covered = torch.zeros(rows, dtype=torch.bool, device="cuda")
            for it in items:
                covered[it.q_start:it.q_start + it.q_len] = True
            assert torch.equal(out[:, covered], loop[0][:, covered]), (member, step)
            assert torch.equal(lse[..., covered], loop[1][..., covered]), (member, step)
    if packed:  # (a dense zigzag step has few items already: Schedule.items joins its fully visible blocks)
        assert fewer > 0, "no list ran in fewer launches than items"


@pytest.mark.parametrize("causal", [False, True])
def test_overlapped_calls_give_the_bytes_of_calls_in_turn(causal):
    """A ring member's forward: a list's calls merged in turn into one running result, each call after the first
    with overlap_previous=True (programmatic dependent launch: it may start while the call before it finishes, and
    must read the running rows only after that call's writes). Every call reads what the one before it wrote (the
    same rows each time), the first calls are long (their tails overlap), and NaN fills the fresh buffers: the
    bytes must be those of the calls without overlap, and the launches must have taken it."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows, keys, h, d = 4096, 16384, 8, 128
    q = torch.randn(1, rows, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, keys, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    mask = dict(causal=True) if causal else {}
    calls = [[WorkItem(0, rows, 0, keys // 2, 4 * keys, 0, **mask)],  # (a diagonal past every key: all visible)
             [WorkItem(0, rows, keys // 2, keys // 2, keys, keys // 2, **mask)],
             [WorkItem(0, rows // 2, 0, 1024, 0, 0, **mask), WorkItem(rows // 2, rows // 2, 1024, 2048, 0, 0, **mask)],
             [WorkItem(0, rows, 3072, 5000, rows, 0, **mask)]]
    results, taken = [], []
    real = cute_fwd.forward_worklist

    def recording(*a, **kw):
        taken.append(kw.get("overlap_previous", False))
        return real(*a, **kw)

    for overlap in (False, True, False, True):
        out, lse = _buffers(q, True, False, gen)
        cute_fwd.forward_worklist = recording
        taken.clear()
        try:
            for i, items in enumerate(calls):
                attention_forward_items(q, k, v, items, out, lse, fresh=i == 0, backend="cute",
                                        overlap_previous=overlap and i > 0)
        finally:
            cute_fwd.forward_worklist = real
        torch.cuda.synchronize()
        assert taken and any(taken) == overlap and not taken[0], taken
        results.append((out, lse))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    assert not results[0][0].isnan().any()


def test_declines_odd_layouts_and_falls_back(monkeypatch):
    """A list on tensors a launch cannot take as they are (a non-contiguous head dim) runs through the loop."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(300, 2, 128, 2, device="cuda", dtype=torch.bfloat16, generator=gen)[..., 0]
    k = torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = torch.zeros(300, 2, 128, device="cuda"), torch.full((2, 300), float("-inf"), device="cuda")
    launches = []
    _run(q, k, k, [WorkItem(0, 300, 0, 300, 0, 0, True)], out, lse, True, launches)
    assert not launches
    ref = torch.zeros_like(out).double(), torch.full_like(lse, float("-inf")).double()
    attention_forward_items(q.double(), k.double(), k.double(), [WorkItem(0, 300, 0, 300, 0, 0, True)], *ref,
                            fresh=True, backend="reference")
    assert (out - ref[0]).abs().max().item() <= TOL[torch.bfloat16]


# ---------------- backward ----------------

from fa4dist.kernels import attention_backward_items  # noqa: E402
from fa4dist.kernels.cute import backward as cute_bwd  # noqa: E402
from fa4dist.kernels.worklist import share_queries  # noqa: E402


def _run_bwd(args, grads, launches=None, loop=False, monkeypatch=None, shared=False, deterministic=False,
             fresh_dkv=False, **kw):
    """attention_backward_items on cute into ``grads`` (fp32 dq, dk, dv); ``shared``: through a shared query side
    as the ring runs it; ``launches`` receives the one-launch calls' item counts; ``loop``: the per-item loop."""
    dout, q, k, v, out, lse, items = args
    real = cute_bwd.backward_worklist

    def counting(*a, **k2):
        launches.append(a[9].numel() // 6)
        return real(*a, **k2)

    with monkeypatch.context() as m:
        if loop:
            m.setattr(CuteSm90Backend, "backward_items", lambda self, *a, **k2: None)
        if launches is not None:
            m.setattr(cute_bwd, "backward_worklist", counting)
        handle = (share_queries(dout, q, out, lse, deterministic=deterministic, backend="cute", **kw) if shared
                  else None)
        attention_backward_items(dout, q, k, v, out, lse, items, *grads, deterministic=deterministic,
                                 backend="cute", shared=handle, fresh_dkv=fresh_dkv, **kw)
        if handle is not None:
            handle.finish(grads[0])
    return grads


def _bwd_inputs(gen, packed, n_rows, n_keys, h, hk, d):
    """Random bf16 (dout, q, k, v), packed (tokens, heads, d) or dense batch 1."""
    lead, klead = ((n_rows,), (n_keys,)) if packed else ((1, n_rows), (1, n_keys))
    q = torch.randn(*lead, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(*klead, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn(*lead, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return dout, q, k, v


def _small_backward_case(base: int, seed: int, *extra_items):
    """(generator, dout, q, k, v, out, lse, items, softcap) of a small random backward list (seed 0: hdim 64, 1:
    dense, 2: soft-capped; GQA 4 / 2 heads; masks causal, full or windowed), ``extra_items`` appended; out and lse
    from the list's forward (rows no item covers: any finite values)."""
    rng = random.Random(base + seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d = (64, 128, 128)[seed]
    packed = seed != 1
    n_rows, n_keys = rng.randint(300, 1200), rng.randint(300, 1200)
    masks = [dict(causal=True), dict(), dict(causal=True, window=(rng.randint(0, 400), -1))]
    dout, q, k, v = _bwd_inputs(gen, packed, n_rows, n_keys, 4, 2, d)
    items = [it for it in _random_items(rng, n_rows, n_keys, rng.randint(3, 10), masks) if it.k_len]
    items += extra_items
    softcap = 30.0 if seed == 2 else None
    out, lse = _buffers(q, True, packed, gen)
    attention_forward_items(q, k, v, items, out, lse, fresh=True, backend="cute", softcap=softcap)
    return gen, dout, q, k, v, torch.nan_to_num(out).to(torch.bfloat16), torch.nan_to_num(lse, nan=0.0), items, softcap


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_backward_random_lists_equal_the_loop(monkeypatch, seed, deterministic):
    """Gradients of random lists (overlapping rows and keys, masks, GQA, packed and dense): the one-launch path
    equals the per-item loop up to the order of fp32 sums, and the fp64 reference at bf16 tolerance;
    deterministic, a second run gives the same bytes."""
    rng = random.Random(1000 + seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d = rng.choice([64, 128])
    hk = rng.choice([1, 2])
    h = hk * rng.choice([1, 2])
    packed = seed % 3 != 0
    n_rows, n_keys = rng.randint(100, 1200), rng.randint(100, 1200)
    masks = [dict(causal=True), dict(), dict(causal=True, window=(rng.randint(0, 400), -1))]
    dout, q, k, v = _bwd_inputs(gen, packed, n_rows, n_keys, h, hk, d)
    items = [it for it in _random_items(rng, n_rows, n_keys, rng.randint(2, 10), masks) if it.k_len]
    softcap = 30.0 if seed % 4 == 1 else None
    out, lse = _buffers(q, True, packed, gen)
    attention_forward_items(q, k, v, items, out, lse, fresh=True, backend="cute", softcap=softcap)
    out = torch.nan_to_num(out).to(torch.bfloat16)  # rows no item covers: any finite values
    lse = torch.nan_to_num(lse, nan=0.0)
    args = (dout, q, k, v, out, lse, items)
    zeros = lambda: [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]  # noqa: E731
    launches = []
    det = dict(deterministic=deterministic, softcap=softcap)
    got = _run_bwd(args, zeros(), launches, monkeypatch=monkeypatch, **det)
    loop = _run_bwd(args, zeros(), loop=True, monkeypatch=monkeypatch, **det)
    assert launches and len(launches) <= len(items)
    if deterministic:
        again = _run_bwd(args, zeros(), monkeypatch=monkeypatch, **det)
        for name, a, b in zip(("dq", "dk", "dv"), got, again):
            assert torch.equal(a, b), f"deterministic {name} differs between two runs"
    for name, a, b in zip(("dq", "dk", "dv"), got, loop):
        assert _rel(a, b) <= 1e-4, f"{name} differs from the loop by {_rel(a, b)}"
    ref = [torch.zeros(t.shape, device="cuda", dtype=torch.float64) for t in (q, k, v)]
    attention_backward_items(dout.double(), q.double(), k.double(), v.double(), out.double(), lse.double(), items,
                             *ref, backend="reference", softcap=softcap)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert _rel(a, b) <= 2e-2, f"{name} error {_rel(a, b)} against the fp64 reference"


@pytest.mark.parametrize("launches_take_dlse", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_backward_lists_with_the_lse_gradient(monkeypatch, seed, deterministic, shared, launches_take_dlse):
    """dlse= (a loss of out and lse) through a list on cute, with or without a shared query side, through the
    one-launch path (its preprocesses take dlse) or, with CuteSm90Backend.worklist_dlse off, the per-item loop:
    the gradients against the fp64 reference's at bf16 tolerance; a loss of the lse alone too (dout = 0, and
    dout=None)."""
    monkeypatch.setattr(CuteSm90Backend, "worklist_dlse", launches_take_dlse)
    gen, dout, q, k, v, out, lse, items, softcap = _small_backward_case(3000, seed)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    for d_out in (dout, torch.zeros_like(dout), None):
        args = (d_out, q, k, v, out, lse, items)
        kw = dict(monkeypatch=monkeypatch, shared=shared, deterministic=deterministic, softcap=softcap, dlse=dlse)
        launches = []
        got = _run_bwd(args, [torch.zeros(t.shape, device="cuda") for t in (q, k, v)], launches, **kw)
        if not launches_take_dlse:
            assert not launches
        elif not deterministic:
            assert launches
        ref = [torch.zeros(t.shape, device="cuda", dtype=torch.float64) for t in (q, k, v)]
        ref_dout = (d_out if d_out is not None else torch.zeros_like(dout)).double()
        attention_backward_items(ref_dout, q.double(), k.double(), v.double(), out.double(), lse.double(),
                                 items, *ref, backend="reference", softcap=softcap, dlse=dlse.double())
        for name, a, b in zip(("dq", "dk"), got, ref):
            assert _rel(a, b) <= 2e-2, f"{name} error {_rel(a, b)} against the fp64 reference"
        assert _rel(got[2], ref[2]) <= 2e-2 if d_out is dout else not got[2].any()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp, d", [(2, 128), (4, 128), (2, 64), (4, 64)])
def test_backward_ring_lists_equal_the_loop_in_few_launches(monkeypatch, packed, cp, d, deterministic):
    """A member's backward over all its ring steps, through the shared query side as the ring runs it: the
    loop's gradients (up to fp32 order), packed lists in fewer launches than items (a dense zigzag step's list is
    already joined by Schedule.items: at most one launch per item). (hdim 64 has 128-row query tiles, hdim 128
    64-row ones: the shared side takes different items.)"""
    gen = torch.Generator(device="cuda").manual_seed(cp)
    total = 4096 * cp
    docs = [0, 700, 3000, 3100, total - 1000, total] if packed else None
    plan = make_plan(torch.tensor(docs) if packed else total, cp, "lpt" if packed else "zigzag")
    sched = Schedule(plan, 1, True)
    total_items = total_launches = 0
    for member in range(cp):
        n = sched.members[member].length
        q, dout = (torch.randn(1, n, 4, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, n + 4096, 2, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        lists = [sched.items(member, sched.source(member, t)) for t in range(cp)]
        lists = [list(x) for x in lists if x]
        out = torch.randn(1, n, 4, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        lse = torch.randn(1, 4, n, device="cuda", generator=gen) + 8
        got, loop = ([torch.zeros(t.shape, device="cuda") for t in (q, k, v)] for _ in range(2))
        launches = []
        for items in lists:  # (every step against the same stand-in keys: the sums only need to agree)
            args = (dout, q, k, v, out, lse, items)
            _run_bwd(args, got, launches, monkeypatch=monkeypatch, shared=True, deterministic=deterministic)
            _run_bwd(args, loop, loop=True, monkeypatch=monkeypatch, shared=True, deterministic=deterministic)
        total_items += sum(len(x) for x in lists)
        total_launches += len(launches)
        assert launches
        for name, a, b in zip(("dq", "dk", "dv"), got, loop):
            assert _rel(a, b) <= 1e-4, f"member {member}: {name} differs from the loop by {_rel(a, b)}"
    assert total_launches < total_items if packed else total_launches <= total_items


@pytest.mark.parametrize("shared", [False, True])
def test_ring_lists_with_the_lse_gradient_equal_the_loop(monkeypatch, shared):
    """A member's ring-step lists (dense zigzag at cp 4, 1500 tokens) with dlse through the launches and the shared
    query side against the per-item loop (the thirty-ninth session's ring dq was wrong here: the shared side
    dropped a unit-stride dlse)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    plan = make_plan(1500, 4, "zigzag")
    sched = Schedule(plan, 1, True)
    longest = max(m.length for m in sched.members)
    for member in range(4):
        n = sched.members[member].length
        q, dout = (torch.randn(1, n, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, longest, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        out = torch.randn(1, n, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        lse = torch.randn(1, 4, n, device="cuda", generator=gen) + 8
        dlse = torch.randn(1, 4, n, device="cuda", generator=gen)
        got, loop = ([torch.zeros(t.shape, device="cuda") for t in (q, k, v)] for _ in range(2))
        lists = [list(sched.items(member, sched.source(member, t))) for t in range(4)]
        for items in [x for x in lists if x]:  # (every step against the same stand-in keys: the sums only agree)
            args = (dout, q, k, v, out, lse, items)
            _run_bwd(args, got, [], monkeypatch=monkeypatch, shared=shared, dlse=dlse)
            _run_bwd(args, loop, loop=True, monkeypatch=monkeypatch, shared=shared, dlse=dlse)
        for name, a, b in zip(("dq", "dk", "dv"), got, loop):
            assert _rel(a, b) <= 1e-4, f"member {member}: {name} differs from the loop by {_rel(a, b)}"


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_backward_fresh_dkv_gives_the_bytes_of_zero_filled_grads(monkeypatch, seed, deterministic, shared):
    """fresh_dkv=True over NaN-poisoned dk / dv (written by each key row's first launch as 0 + x, the rest added,
    rows no item has zeroed) gives the bytes of the same list into zero-filled buffers: dk / dv always (a key
    tile's sums are in registers, in launch order), dq too when deterministic; in fewer launches than items."""
    again = WorkItem(0, 64, 0, 128, 200, 0, True)  # keys 0-128 again: added after their first launch
    _, dout, q, k, v, out, lse, items, softcap = _small_backward_case(2000, seed, again)
    args = (dout, q, k, v, out, lse, items)
    kw = dict(monkeypatch=monkeypatch, shared=shared, deterministic=deterministic, softcap=softcap)
    launches = []
    poisoned = [torch.zeros(q.shape, device="cuda")] + [torch.full(t.shape, float("nan"), device="cuda")
                                                        for t in (k, v)]
    fresh = _run_bwd(args, poisoned, launches, fresh_dkv=True, **kw)
    zeros = _run_bwd(args, [torch.zeros(t.shape, device="cuda") for t in (q, k, v)], **kw)
    assert launches and len(launches) <= len(items) + 1
    for name, a, b in zip(("dk", "dv"), fresh[1:], zeros[1:]):
        assert torch.equal(a, b), f"{name}: fresh_dkv differs from the zero-filled run"
    if deterministic:
        assert torch.equal(fresh[0], zeros[0])
    else:
        assert _rel(fresh[0], zeros[0]) <= 1e-5
