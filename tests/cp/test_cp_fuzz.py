"""Random context-parallel cases (tests/cp/fuzz_cp.py) on the pool of four gloo ranks: every option the public API
takes, drawn together, exact against the fp64 oracle or refused alike on every rank with a clear error; one module
per set of options serves every later case with them (other shapes, plans and dtypes than its earlier calls'); and
random ``cp_invariant=True`` layouts, the single device's bytes or refused alike; and one rank calling differently
from the others, refused on every rank."""

import pytest

from cp_harness import replace_shared_pool, shared_pool
from fuzz_cp import (draw_case, draw_disagreement, draw_invariant_case, fuzz_case, fuzz_disagreeing_case,
                     fuzz_invariant_case, groups_out_of_step, judge, judge_disagreement, judge_invariant, tolerance)

pytestmark = pytest.mark.timeout(300)

CASES = 100  # ~7 s; `python tests/cp/fuzz_cp.py --cases 3000 --reuse-modules` for a long run


def test_random_cases_are_exact_or_refused_alike():
    pool = shared_pool(4)
    failures, exact = [], 0
    for seed in range(CASES):
        case = draw_case(seed)
        results = pool.run(fuzz_case, case=case, reuse_modules=True)
        problem = judge(results, tolerance(case))
        if problem:
            failures.append(f"seed={seed} {case}: {problem}")
        exact += all(r[0] == "ok" for r in results) and any(r[1] is not None for r in results)
    assert not failures, "\n".join(failures)
    assert exact >= CASES // 2, f"only {exact} of {CASES} cases ran (the rest were refused): the draw is off"


INVARIANT_CASES = 40  # ~6 s; `python tests/cp/fuzz_cp.py --invariant --cases 2000` for a long run


def test_random_invariant_layouts_give_the_single_device_bytes_or_are_refused_alike():
    pool = shared_pool(4)
    failures, ran = [], 0
    for seed in range(INVARIANT_CASES):
        case = draw_invariant_case(seed)
        results = pool.run(fuzz_invariant_case, case=case)
        problem = judge_invariant(results)
        if problem:
            failures.append(f"seed={seed} {case}: {problem}")
        ran += all(r[0] == "ok" for r in results)
    assert not failures, "\n".join(failures)
    assert ran >= INVARIANT_CASES // 2, f"only {ran} of {INVARIANT_CASES} layouts ran (the rest were refused)"


DISAGREEMENTS = 40


def test_one_rank_calling_differently_is_refused_on_every_rank():
    """One rank's call differs in one option, shape or plan: every rank of the group stops with a clear error (or,
    where the change leaves the call the same or may differ per rank, every rank gets the oracle's results)."""
    pool = shared_pool(4)
    failures, refused = [], 0
    for seed in range(DISAGREEMENTS):
        case, odd_rank, what = draw_disagreement(seed)
        results = pool.run(fuzz_disagreeing_case, case=case, odd_rank=odd_rank, what=what, timeout=150)
        problem = judge_disagreement(results, case, what)
        if problem:
            failures.append(f"seed={seed} rank {odd_rank} differs in {what}, {case}: {problem}")
        refused += any(r[0] == "refused" for r in results)
        if groups_out_of_step(results):
            pool = replace_shared_pool(4)
    assert not failures, "\n".join(failures)
    assert refused >= DISAGREEMENTS // 2, f"only {refused} of {DISAGREEMENTS} disagreements were refused"
