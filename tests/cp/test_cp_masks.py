"""Sliding windows, softcap and sinks through context parallelism: ring, Ulysses and hybrid on 2-4 gloo ranks,
forward and backward (the sinks' gradient summed over the ranks) in fp64 against the independent oracle at 1e-10;
bitwise determinism; ranks that disagree on the options fail clearly; the schedule computes every visible pair
exactly once, sends only the key rows that are read and skips the steps nobody needs.

One worker pool serves the module (tests/cp_harness.py); cp < 4 cases run on a subgroup of it."""

import itertools

import pytest
import torch

import cp_cases
from cp_cases import case_kwargs, check_results, random_docs, run_case
from cp_harness import GROUPS, shared_pool
from fa4dist.context_parallel import Schedule, make_plan
from fa4dist.kernels.mask import Mask

pytestmark = pytest.mark.timeout(240)

TOL = 1e-10


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


# (id, kwargs); every case runs at cp 2, 3 and 4.  Windows shorter than a chunk skip steps; longer ones do not.
RING = [
    ("causal-w5-sinks-gqa-b2-contiguous", dict(seqlen=61, batch=2, window=(5, -1), sinks=True, balancer="contiguous")),
    ("causal-w9-softcap-lpt-4c", dict(seqlen=64, window=(9, -1), softcap=2.0, chunks_per_rank=4)),
    ("full-w4,3-sinks-softcap-zigzag", dict(seqlen=48, causal=False, window=(4, 3), sinks=True, softcap=1.5,
                                            balancer="zigzag", heads=(2, 2))),
    ("full-right2-mqa", dict(seqlen=40, causal=False, window=(-1, 2), heads=(4, 1))),
    ("causal-self-only", dict(seqlen=30, window=(0, -1), sinks=True)),
    ("causal-w100-is-causal", dict(seqlen=45, window=(100, -1), sinks=True, balancer="zigzag")),
    ("packed-causal-w6-sinks", dict(docs=random_docs(1, 8, 24), window=(6, -1), sinks=True)),
    ("packed-full-w3,5-softcap", dict(docs=random_docs(2, 6, 30), causal=False, window=(3, 5), softcap=3.0,
                                      heads=(2, 1))),
]
ULYSSES = [
    ("causal-w5-sinks-softcap", dict(seqlen=50, heads=(12, 12), window=(5, -1), sinks=True, softcap=2.0)),
    ("full-w3,3-gqa", dict(seqlen=37, batch=2, causal=False, heads=(12, 6), window=(3, 3))),
    ("packed-causal-w6-sinks-mqa", dict(docs=random_docs(3, 9, 20), heads=(12, 1), window=(6, -1), sinks=True)),
]
HYBRID = [
    ("causal-w7-sinks-gqa", dict(seqlen=57, heads=(4, 2), window=(7, -1), sinks=True)),
    ("packed-full-w4,2-softcap-sinks", dict(docs=random_docs(4, 8, 30), causal=False, heads=(4, 1), window=(4, 2),
                                            softcap=2.5, sinks=True)),
]


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("name, case", RING, ids=[c[0] for c in RING])
def test_ring(pool, cp, name, case):
    check_results(pool.run(run_case, cp=cp, strategy="ring", **case_kwargs(cp, case)), "ring")


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("name, case", ULYSSES, ids=[c[0] for c in ULYSSES])
def test_ulysses(pool, cp, name, case):
    from fa4dist.context_parallel import HeadSplit

    heads = case["heads"]
    if HeadSplit.problem(heads[0], heads[1], cp) is not None:
        pytest.skip("head split impossible at this degree (see test_cp_errors)")
    check_results(pool.run(run_case, cp=cp, strategy="ulysses", **case_kwargs(cp, case)), "ulysses")


@pytest.mark.parametrize("topology", ["group", "mesh"])
@pytest.mark.parametrize("name, case", HYBRID, ids=[c[0] for c in HYBRID])
def test_hybrid(pool, topology, name, case):
    extra = dict(ulysses_degree=2) if topology == "group" else {}
    check_results(pool.run(run_case, cp=4, strategy="hybrid", topology=topology, plan_u=2, **extra, **case), "hybrid")


# ---- determinism, agreement -------------------------------------------------------------------------------------


def determinism_case(rank, world, strategy):
    from fa4dist.modules import FA4ContextParallelAttention

    degree = 2 if strategy == "hybrid" else None
    module = FA4ContextParallelAttention(GROUPS[4], strategy=strategy, ulysses_degree=degree, causal=True,
                                         window=(11, -1), softcap=3.0, backend="reference", deterministic=True,
                                         timeout=60)
    plan = module.make_plan(150, "contiguous")
    q, k, v, dout = cp_cases.global_inputs(3, 150, 4, 2, 16, torch.float32, batch=2)
    sinks = torch.linspace(-1.0, 1.0, 4)
    runs = []
    for _ in range(2):
        local = [module.shard(t, plan).requires_grad_() for t in (q, k, v)]
        s = sinks.clone().requires_grad_()
        out = module(*local, plan=plan, sinks=s)
        out.backward(module.shard(dout, plan))
        runs.append([bytes(t.detach().contiguous().view(torch.uint8).flatten().tolist())
                     for t in [out, s.grad] + [x.grad for x in local]])
    return runs[0] == runs[1]


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_bitwise_deterministic(pool, strategy):
    assert all(pool.run(determinism_case, strategy=strategy))


def disagree_case(rank, world, kind):
    from fa4dist.modules import FA4ContextParallelAttention

    opts = dict(strategy="ring", causal=True, backend="reference", timeout=30, window=(6, -1))
    sinks = torch.zeros(4, dtype=torch.float64)
    if kind == "window" and rank == 1:
        opts["window"] = (7, -1)
    if kind == "softcap" and rank == 3:
        opts["softcap"] = 2.0
    if kind == "sinks" and rank == 2:
        sinks = None
    if kind == "sinks-shape" and rank == 0:
        sinks = torch.zeros(3, dtype=torch.float64)
    module = FA4ContextParallelAttention(GROUPS[4], **opts)
    plan = make_plan(40, 4, causal=True, window=(6, -1))
    q, k, v, _ = cp_cases.global_inputs(0, 40, 4, 2, 8, torch.float64, batch=1)
    try:
        module(*(plan.shard(t, rank=rank) for t in (q, k, v)), plan=plan, sinks=sinks)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("kind, error, pattern", [
    ("window", "ValueError", r"ranks disagree on forward call 1: mask: .*rank 1 'causal\+window=\(7, -1\)'"),
    ("softcap", "ValueError", "ranks disagree on forward call 1: softcap: .*rank 3 2.0"),
    ("sinks", "ValueError", "ranks disagree on forward call 1: sinks: .*rank 2 None"),
    ("sinks-shape", "ValueError", r"rank 0 rejected its inputs: ValueError: sinks must have shape \(4,\)"),
])
def test_ranks_that_disagree_on_the_options_all_fail(pool, kind, error, pattern):
    import re

    for rank, res in enumerate(pool.run(disagree_case, kind=kind, timeout=90)):
        assert res is not None, f"rank {rank} did not fail"
        assert res[0] == error and re.search(pattern, res[1]), (rank, res)


# ---- the schedule: exact coverage, minimal transfers, skipped steps (no processes) -------------------------------


def _explicit(q_pos, k_pos, mask: Mask):
    keep = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    d = torch.tensor(k_pos).view(1, -1) - torch.tensor(q_pos).view(-1, 1)
    if mask.causal:
        keep &= d <= 0
    if mask.window[0] >= 0:
        keep &= d >= -mask.window[0]
    if mask.window[1] >= 0:
        keep &= d <= mask.window[1]
    return keep


def _coverage(sched: Schedule):
    """(pairs computed per (query token, key token) over all calls, the explicit mask) on global token indices;
    packed documents see only themselves, at positions within the document."""
    plan = sched.plan
    total = plan.total_len
    docs = plan.cu_seqlens or (0, total)
    doc_of = [d for d in range(len(docs) - 1) for _ in range(docs[d + 1] - docs[d])]
    pos = [t - docs[doc_of[t]] for t in range(total)]
    want = torch.zeros(total, total, dtype=torch.int64)
    for d in range(len(docs) - 1):
        a, b = docs[d], docs[d + 1]
        want[a:b, a:b] = _explicit(pos[a:b], pos[a:b], sched.mask).long()
    got = torch.zeros_like(want)
    token_of = []  # per member: global token of each member-layout row
    for layout in sched.members:
        rows = [None] * layout.length
        for blk in layout.blocks:
            for i in range(blk.length):
                rows[blk.offset + i] = blk.start + i
        token_of.append(rows)
    for m, s in itertools.product(range(sched.ring_size), repeat=2):
        held = token_of[s] if m == s else [token_of[s][a + i] for a, n in sched.needed(m, s) for i in range(n)]
        used = set()
        for call in sched.calls(m, s):
            blk = sched.members[m].blocks[call.q_block]
            q_tok = [token_of[m][blk.offset + call.q_start + i] for i in range(call.q_len)]
            k_tok = held[call.k_row:call.k_row + call.k_len]
            used.update(range(call.k_row, call.k_row + call.k_len))
            segs = [(0, call.q_len, call.q_offset, call.k_offset)]
            if call.cu_seqlens is not None:
                cu = call.cu_seqlens
                segs = [(cu[i], cu[i + 1], call.q_offset[i], call.k_offset[i]) for i in range(len(cu) - 1)]
            for a, b, qo, ko in segs:
                n_k = len(k_tok) if call.cu_seqlens is None else b - a
                keys = k_tok if call.cu_seqlens is None else k_tok[a:b]
                keep = _explicit(list(range(qo, qo + b - a)), list(range(ko, ko + n_k)), call.mask)
                if call.mask.full:
                    keep = torch.ones(b - a, n_k, dtype=torch.bool)
                if b == a or n_k == 0:
                    continue
                got[torch.tensor(q_tok[a:b]).view(-1, 1), torch.tensor(keys).view(1, -1)] += keep.long()
        if m != s:
            assert used == set(range(len(held))), (m, s)  # every row sent is read
    return got, want


def _plans():
    yield make_plan(97, 4, "zigzag", window=(9, -1))
    yield make_plan(97, 4, "contiguous", window=(9, -1))
    yield make_plan(97, 4, "lpt", 16, window=(30, -1))
    yield make_plan(64, 4, "zigzag", causal=False, window=(5, 3))
    yield make_plan(64, 2, "lpt", causal=False)
    yield make_plan(random_docs(7, 10, 20), 4, window=(6, -1))
    yield make_plan(random_docs(8, 6, 30), 3, causal=False, window=(2, 7))


def test_schedule_computes_every_visible_pair_once_and_sends_only_what_is_read():
    for plan in _plans():
        for u in [d for d in range(1, plan.cp_size + 1) if plan.cp_size % d == 0]:
            for mask in {plan.mask, Mask(True, (3, -1)), Mask(False, (-1, 1)), Mask(True)}:
                got, want = _coverage(Schedule(plan, u, mask))
                assert torch.equal(got, want), (plan, u, mask)


def test_the_reports_counts_are_the_steps_transfers():
    """member_received / member_steps are counted from the key spans (no walk over every step at large cp): they
    must equal the per-step transfers the ring posts."""
    for plan in _plans():
        for u in [d for d in range(1, plan.cp_size + 1) if plan.cp_size % d == 0]:
            for mask in {plan.mask, Mask(True, (3, -1)), Mask(False, (-1, 1)), Mask(True)}:
                sched = Schedule(plan, u, mask)
                for m in range(sched.ring_size):
                    steps = range(1, sched.ring_size)
                    assert sched.member_received(m) == sum(sched.recv_len(m, t) for t in steps), (plan, u, mask, m)
                    assert sched.member_steps(m) == tuple(t for t in steps if sched.recv_len(m, t)), (plan, u, m)


def test_windows_skip_steps_and_the_report_says_so():
    cp, total = 8, 8 * 512
    plan = make_plan(total, cp, "contiguous", window=(255, -1))  # a 256-token window, chunks of 256
    report = plan.balance_report()
    assert report.steps_run == (1,)
    assert report.member_steps == ((),) + ((1,),) * (cp - 1)
    assert report.skipped_steps == (cp - 1,) + (cp - 2,) * (cp - 1)
    assert report.received == (0,) + (255,) * (cp - 1)  # only the window's keys travel
    assert "remote steps run [1] of 1..7" in str(report) and "skips 6 of 7" in str(report)
    assert report.imbalance < 1.04  # the first chunk's queries see fewer keys
    lpt = make_plan(total, cp, window=(255, -1)).balance_report()
    assert lpt.imbalance <= report.imbalance and lpt.steps_run == (1,)
    dense = make_plan(total, cp, "zigzag").balance_report()  # plain causal: every step runs, all keys travel
    assert dense.steps_run == tuple(range(1, cp)) and min(dense.received) >= total // cp
    assert report.as_dict()["skipped_steps"] == list(report.skipped_steps)
    # LPT's cost model counts the window: the pairs of a chunk are at most chunk x (window + 1)
    assert max(lpt.work) <= 2 * 256 * 256 and sum(lpt.work) == sum(plan.chunk_costs)
