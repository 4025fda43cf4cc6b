"""Random context-parallel cases (tests/cp/fuzz_cp.py) on the pool of four gloo ranks: every option the public API
takes, drawn together, exact against the fp64 oracle or refused alike on every rank with a clear error; one module
per set of options serves every later case with them (other shapes, plans and dtypes than its earlier calls')."""

import pytest

from cp_harness import shared_pool
from fuzz_cp import draw_case, fuzz_case, judge, tolerance

pytestmark = pytest.mark.timeout(300)

CASES = 150  # ~5 s; `python tests/cp/fuzz_cp.py --cases 3000 --reuse-modules` for a long run


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
