"""Random context-parallel cases (tests/cp/fuzz_cp.py) on the pool of four gloo ranks: every option the public API
takes, drawn together, exact against the fp64 oracle or refused alike on every rank with a clear error; one module
per set of options serves every later case with them (other shapes, plans and dtypes than its earlier calls'); and
random ``cp_invariant=True`` layouts, the single device's bytes or refused alike."""

import pytest

from cp_harness import shared_pool
from fuzz_cp import draw_case, draw_invariant_case, fuzz_case, fuzz_invariant_case, judge, judge_invariant, tolerance

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
