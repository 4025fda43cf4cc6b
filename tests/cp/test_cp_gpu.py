"""Context parallelism with CUDA tensors: several ranks sharing one GPU over gloo (the transport stages through
pinned host memory), fp64 exactness with the reference backend and bf16 precision with the fused backends."""

import pytest

from cp_cases import random_docs, run_case
from cp_harness import shared_pool
from test_cp_attention import check_precision, precision_case
from test_cp_invariant import invariant_case

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def pool():
    return shared_pool(4)


FP64_CASES = [  # (also tests/cp/test_peer_gpu.py's, through the copy-engine transport)
    ("ring", dict(cp=4, seqlen=301, heads=(4, 2))),
    ("ring", dict(cp=3, docs=random_docs(7, 9, 60), heads=(4, 1))),
    ("ulysses", dict(cp=4, seqlen=130, heads=(8, 2))),
    ("hybrid", dict(cp=4, seqlen=130, heads=(4, 1), ulysses_degree=2, plan_u=2)),
]


@pytest.mark.parametrize("strategy, kw", FP64_CASES)
def test_cuda_fp64_exact(pool, strategy, kw):
    for r in pool.run(run_case, strategy=strategy, device="cuda:0", **kw):
        if r is not None:
            assert max(r[n] for n in ("out", "dq", "dk", "dv")) < 1e-10, r


@pytest.mark.parametrize("strategy, kw", [
    ("ring", dict(total=4096, heads=(8, 2), d=64)),
    ("ring", dict(total=3001, heads=(4, 4), d=128, batch=2)),  # strided blocks (batch 2), a short last chunk
    ("ring", dict(docs=random_docs(3, 10, 800, allow_empty=False), heads=(8, 8), d=64)),
    ("ulysses", dict(total=4096, heads=(8, 8), d=128)),
    ("hybrid", dict(total=4096, heads=(8, 2), d=64)),
    ("ring", dict(total=3000, heads=(6, 2), d=96)),  # hdim 96: the work lists' forward and backward
])
def test_cuda_bf16_fused_backend_precision(pool, strategy, kw):
    report = check_precision(pool.run(precision_case, strategy=strategy, device="cuda:0", backend="auto", **kw))
    print(strategy, {k: f"{a:.2e} (cp=1 {b:.2e})" for k, (a, b) in report.items()})


@pytest.mark.parametrize("packed, heads, head_dim, sinks, window", [
    (False, (4, 2), 128, False, (-1, -1)), (True, (4, 1), 128, False, (-1, -1)), (True, (4, 2), 96, False, (-1, -1)),
    (True, (4, 2), 128, True, (-1, -1)),
    (True, (4, 2), 128, False, (300, -1)),  # a window's lower edge: the dq bounds' sparse-table path
])
def test_cuda_cp_invariant_bitwise_across_layouts(pool, packed, heads, head_dim, sinks, window):
    """cp_invariant with the fastest backend that guarantees it, bf16, several ranks on one GPU: the same bytes at
    cp 1-4, ring, Ulysses and hybrid as one device (with sinks: their gradient summed over the ranks too; with a
    sliding window, the dq bound of each row from the keys inside it)."""
    import torch

    layouts = [(1, "ring", "lpt", None), (2, "ring", "lpt", None), (3, "ring", "zigzag", None),
               (4, "ulysses", "lpt", None), (4, "hybrid", "lpt", 2)]
    docs = [0, 700, 701, 1900, 3000]
    for per_rank in pool.run(invariant_case, layouts=layouts, dtype=torch.bfloat16, packed=packed, heads=heads,
                             device="cuda:0", backend="auto", head_dim=head_dim, docs=docs, total=2048, timeout=280,
                             sinks=sinks, window=window):
        for cp, strategy, balancer, u, same in per_rank:
            assert len(same) == 4 + sinks and all(same), \
                f"cp={cp} {strategy} {balancer} u={u}: out/dq/dk/dv(/dsinks) bytes equal: {same}"


@pytest.mark.parametrize("strategy, kw", [
    ("ring", dict(cp=4, seqlen=301, heads=(4, 2), window=(40, -1), sinks=True, balancer="contiguous")),
    ("hybrid", dict(cp=4, docs=random_docs(5, 9, 60), heads=(4, 1), window=(9, 3), causal=False, sinks=True,
                    ulysses_degree=2, plan_u=2)),
])
def test_cuda_fp64_exact_with_a_window_and_sinks(pool, strategy, kw):
    import torch

    results = [r for r in pool.run(run_case, strategy=strategy, device="cuda:0", **kw) if r is not None]
    for r in results:
        assert max(r[n] for n in ("out", "dq", "dk", "dv")) < 1e-10, r
    total = torch.tensor([r["dsinks"] for r in results], dtype=torch.float64).sum(0)
    torch.testing.assert_close(total, torch.tensor(results[0]["dsinks_ref"], dtype=torch.float64), atol=1e-10,
                               rtol=1e-10)


@pytest.mark.parametrize("strategy, kw", [
    ("ring", dict(cp=4, seqlen=1500, heads=(4, 2))),
    ("hybrid", dict(cp=4, docs=random_docs(9, 6, 500, allow_empty=False), heads=(4, 1), ulysses_degree=2,
                    plan_u=2, sinks=True)),
])
def test_cuda_bf16_a_loss_of_the_lse(pool, strategy, kw):
    """return_lse=True and a loss of out and lse on the fastest backend, bf16, hdim 128: the context-parallel
    gradients (the lse's joined to the ring steps' row sums: the work lists' and the shared query side's
    preprocesses take dlse) within 2x the single device's error (whose backward takes it inside its one pass too)
    against the fp64 oracle, plus bf16's unit."""
    import torch

    common = dict(device="cuda:0", backend="auto", dtype=torch.bfloat16, head_dim=128, lse_loss="and")
    one = {name: value for name, value in kw.items() if name not in ("ulysses_degree", "plan_u")}
    single = [r for r in pool.run(run_case, strategy="ring", **dict(one, cp=1), **common) if r is not None]
    spread = [r for r in pool.run(run_case, strategy=strategy, **kw, **common) if r is not None]
    for name in ("out", "lse", "dq", "dk", "dv"):
        worst = max(r[name] for r in spread)
        assert worst <= 2 * single[0][name] + 2 ** -8, (name, worst, single[0][name])


def test_cuda_cp_invariant_a_loss_of_the_lse(pool):
    """cp_invariant with return_lse=True and a loss of out and lse, the fastest backend, bf16: out, lse, dq, dk,
    dv and the summed sink gradient the single device's bytes at cp 1-4, ring, Ulysses and hybrid."""
    import torch

    layouts = [(1, "ring", "lpt", None), (2, "ring", "lpt", None), (4, "ulysses", "lpt", None),
               (4, "hybrid", "lpt", 2)]
    for per_rank in pool.run(invariant_case, layouts=layouts, dtype=torch.bfloat16, packed=True, heads=(4, 2),
                             device="cuda:0", backend="auto", head_dim=128, docs=[0, 700, 701, 1900, 3000],
                             timeout=280, sinks=True, lse_loss=True):
        for cp, strategy, balancer, u, same in per_rank:
            assert len(same) == 6 and all(same), \
                f"cp={cp} {strategy} {balancer} u={u}: out/lse/dq/dk/dv/dsinks bytes equal: {same}"


@pytest.mark.parametrize("per_launch", [1, 0])
def test_cuda_ring_launch_groups(pool, per_launch):
    """The ring forward one launch per remote step and all remote steps in one (FA4DIST_RING_STEPS_PER_LAUNCH=0: the
    group's staged receives land in place in one buffer), several ranks on one GPU: on the fastest backend, bf16,
    hdim 128, within 2x the single device's error against the fp64 oracle plus bf16's unit; and fp64-exact on the
    reference backend with packed documents."""
    import torch

    kw = dict(cp=4, seqlen=1500, heads=(4, 2))
    common = dict(device="cuda:0", backend="auto", dtype=torch.bfloat16, head_dim=128)
    single = [r for r in pool.run(run_case, strategy="ring", **dict(kw, cp=1), **common) if r is not None]
    spread = [r for r in pool.run(run_case, strategy="ring", ring_steps_per_launch=per_launch, **kw, **common)
              if r is not None]
    for name in ("out", "dq", "dk", "dv"):
        worst = max(r[name] for r in spread)
        assert worst <= 2 * single[0][name] + 2 ** -8, (name, worst, single[0][name])
    for r in pool.run(run_case, strategy="ring", ring_steps_per_launch=per_launch, device="cuda:0", cp=3,
                      docs=random_docs(7, 9, 60), heads=(4, 1)):
        if r is not None:
            assert max(r[n] for n in ("out", "dq", "dk", "dv")) < 1e-10, r
