"""Random context-parallel cases against the fp64 oracle, on a pool of four gloo ranks (CPU, reference backend).

Each case draws every option the public API takes (strategy and topology, cp size, GQA heads, head dims, dense or
packed documents, causal, window, softcap, sinks, balancer, chunk count, alignment, a loss of the lse, the ring's
launch groups and range messages, Ulysses head chunks). A case either matches the oracle within 1e-10 on every
rank, or is refused on every rank with a ValueError / TypeError that says what was wrong; anything else (another
exception, a refusal on some ranks only, a hang) is a failure.

``--invariant``: random ``cp_invariant=True`` layouts, whose out, lse, dq, dk, dv and summed sink gradient must be
the single device's bytes.  ``--disagree``: one rank's call differs from the others' in one option, shape or plan,
and every rank must stop with an error (none may hang or return).

    python tests/cp/fuzz_cp.py --cases 300 --seed 0     # prints each failure with the case that reproduces it

``test_cp_fuzz.py`` runs a fixed handful of these cases in the suite.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

from cp_cases import random_docs, run_case  # noqa: E402

CLEAR_REFUSALS = (ValueError, TypeError)


def draw_case(seed: int) -> dict:
    """One random case for run_case on a pool of four ranks."""
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 2, 3, 4, 4])
    topology = "group"
    if cp == 4 and rng.random() < 0.25:
        topology = rng.choice(["mesh", "groups"])
    if topology == "group":
        strategy = rng.choice(["auto", "ring", "ring", "ulysses", "hybrid"])
    else:
        strategy = rng.choice(["auto", "hybrid"])
    ulysses_degree = None
    if topology == "group" and strategy in ("auto", "hybrid") and rng.random() < 0.6:
        ulysses_degree = rng.choice([d for d in range(1, cp + 1) if cp % d == 0])
    heads_kv = rng.choice([1, 2, 3, 4])
    heads_q = heads_kv * rng.choice([1, 1, 2, 3])
    if strategy != "ring" and rng.random() < 0.7:  # mostly head counts a Ulysses degree can split
        heads_kv = rng.choice([1, 2, 4])
        heads_q = heads_kv * rng.choice([1, 2, 4]) * (3 if cp == 3 else 1)
    case = dict(cp=cp, strategy=strategy, topology=topology, ulysses_degree=ulysses_degree,
                heads=(heads_q, heads_kv), head_dim=rng.choice([4, 8, 16]), seed=seed,
                causal=rng.random() < 0.7, balancer=rng.choice(["lpt", "lpt", "zigzag", "contiguous"]),
                plan_u=rng.choice([1, None, None]))
    if rng.random() < 0.2:
        case["head_dim_v"] = rng.choice([4, 8, 12])
    if rng.random() < 0.45:
        case["docs"] = random_docs(seed, rng.randint(1, 7), rng.choice([5, 20, 60]))
    else:
        case["seqlen"] = rng.randint(1, 160)
        case["batch"] = rng.choice([1, 1, 2])
    if rng.random() < 0.35:
        case["window"] = (rng.choice([-1, 0, 1, 3, 17, 50]), rng.choice([-1, 0, 2, 9, 40]))
    if rng.random() < 0.25:
        case["softcap"] = rng.choice([0.5, 3.0, 30.0])
    case["sinks"] = rng.random() < 0.25
    if rng.random() < 0.2:
        case["num_chunks"] = cp * rng.choice([1, 2, 3, 5])
    if rng.random() < 0.15:
        case["align"] = rng.choice([2, 4, 8])
    if rng.random() < 0.3:
        case["lse_loss"] = rng.choice(["and", "only"])
    if rng.random() < 0.25:
        case["ring_steps_per_launch"] = rng.choice([0, 1, 2, "auto"])
    if rng.random() < 0.2:
        case["ulysses_chunks"] = rng.choice([1, 2, 3])
    if rng.random() < 0.15:
        case["ring_max_range_messages"] = rng.choice([1, 2])
    if rng.random() < 0.25:  # the reference in fp32 (its accumulation dtype paths) against the fp64 oracle
        case["dtype"] = torch.float32
    return case


def tolerance(case: dict) -> float:
    """The largest error allowed against the fp64 oracle: fp64 rounding, or fp32's for fp32 inputs (values and
    gradients here are O(1) to O(10), sums over at most a few hundred terms)."""
    return 1e-4 if case.get("dtype") == torch.float32 else 1e-10


def draw_invariant_case(seed: int) -> dict:
    """One random layout for ``cp_invariant=True`` (test_cp_invariant.invariant_case's arguments): its out, lse,
    dq, dk, dv and summed sink gradient must be the single device's bytes."""
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 3, 4])
    strategy = rng.choice(["ring", "ring", "ulysses", "hybrid"]) if cp > 1 else "ring"
    u = None
    if strategy == "hybrid":
        u = rng.choice([d for d in range(1, cp + 1) if cp % d == 0])
    heads_kv = rng.choice([1, 2, 4])
    case = dict(layouts=[(cp, strategy, rng.choice(["lpt", "zigzag", "contiguous"]), u)],
                dtype=rng.choice([torch.float32, torch.bfloat16]), packed=rng.random() < 0.5,
                heads=(heads_kv * rng.choice([1, 2]) * (3 if cp == 3 and rng.random() < 0.7 else 1), heads_kv),
                head_dim=rng.choice([8, 16]), sinks=rng.random() < 0.3, lse_loss=rng.random() < 0.3)
    if case["packed"]:
        case["docs"] = random_docs(seed, rng.randint(1, 7), rng.choice([10, 40, 90]))
    else:
        case["total"] = rng.randint(1, 300)
    if rng.random() < 0.3:
        case["window"] = (rng.choice([-1, 0, 5, 33, 130]), rng.choice([-1, 0, 7]))
    if rng.random() < 0.25:
        case["softcap"] = rng.choice([0.7, 5.0])
    if rng.random() < 0.3:
        case["chunks_per_rank"] = rng.choice([1, 2, 3, 4])
    if rng.random() < 0.2:
        case["ulysses_chunks"] = rng.choice([1, 2])
    return case


def fuzz_invariant_case(rank, world, *, case):
    """test_cp_invariant.invariant_case on this rank, a refusal caught: ("ok", [(cp, strategy, balancer, u, [bytes
    equal per tensor])]) or ("refused", exception type, message)."""
    from test_cp_invariant import _sync_world, invariant_case

    try:
        return ("ok", invariant_case(rank, world, **case))
    except CLEAR_REFUSALS as err:
        _sync_world()  # (the ranks outside the layout wait there for the refusing ones)
        return ("refused", type(err).__name__, str(err))


def judge_invariant(results) -> str | None:
    """None when every rank that ran the layout got the single device's bytes (or every rank refused alike)."""
    kinds = {r[0] for r in results if r[0] == "refused" or r[1]}
    if kinds <= {"refused"}:
        return None
    if kinds != {"ok"}:
        return f"refused on some ranks only: {results}"
    differ = [(rank, layout) for rank, r in enumerate(results) for *layout, same in r[1] if not all(same)]
    return f"bytes differ from the single device's: {differ} ({results})" if differ else None


# one rank's call differs from the others' in one of these (the call's options, its inputs' shapes, its plan)
PERTURBATIONS = ("causal", "window", "softcap", "sinks", "heads", "head_dim", "dtype", "seqlen", "docs", "balancer",
                 "num_chunks", "strategy", "lse_loss", "ulysses_chunks", "ring_steps_per_launch", "transport")


def perturbed(case: dict, what: str, rng: random.Random) -> dict:
    """`case` with `what` changed (to a value that changes the call)."""
    case = dict(case)
    if what == "causal":
        case["causal"] = not case.get("causal", True)
    elif what == "window":
        case["window"] = (7, -1) if case.get("window", (-1, -1)) != (7, -1) else (-1, -1)
    elif what == "softcap":
        case["softcap"] = 2.0 if case.get("softcap") is None else None
    elif what == "sinks":
        case["sinks"] = not case.get("sinks", False)
    elif what == "heads":
        hq, hkv = case["heads"]
        case["heads"] = (hq * 2, hkv * 2)
    elif what == "head_dim":
        case["head_dim"] = 2 * case["head_dim"]
    elif what == "dtype":
        case["dtype"] = torch.float32 if case.get("dtype", torch.float64) == torch.float64 else torch.float64
    elif what == "seqlen":
        if "seqlen" in case:
            case["seqlen"] += rng.randint(1, 9)
        else:
            case["docs"] = case["docs"][:-1] + [case["docs"][-1] + rng.randint(1, 9)]
    elif what == "docs":  # the same total, cut differently (or a dense batch of one more sequence)
        if "docs" in case:
            total = case["docs"][-1]
            case["docs"] = [0, total // 2, total] if case["docs"] != [0, total // 2, total] else [0, total]
        else:
            case["batch"] = case.get("batch", 1) + 1
    elif what == "balancer":
        case["balancer"] = "contiguous" if case.get("balancer", "lpt") != "contiguous" else "lpt"
    elif what == "num_chunks":
        case["num_chunks"] = case["cp"] * (4 if case.get("num_chunks") != case["cp"] * 4 else 6)
    elif what == "strategy":  # (no ulysses_degree, which would refuse the other strategy as the module is made)
        case["strategy"] = "ring" if case.get("strategy") != "ring" else "ulysses"
        case["ulysses_degree"] = None
    elif what == "lse_loss":
        case["lse_loss"] = None if case.get("lse_loss") else "and"
    elif what == "ulysses_chunks":
        case["ulysses_chunks"] = 2 if case.get("ulysses_chunks") != 2 else 1
    elif what == "ring_steps_per_launch":
        case["ring_steps_per_launch"] = 2 if case.get("ring_steps_per_launch") != 2 else 1
    elif what == "transport":  # (the peer copies need CUDA: this rank refuses its CPU inputs, through the check)
        case["transport"] = "peer"
    return case


def draw_disagreement(seed: int) -> tuple[dict, int, str]:
    """(case, the rank whose call differs, what differs): a case of :func:`draw_case` on two or more ranks."""
    rng = random.Random(10**6 + seed)
    case = draw_case(seed)
    case.update(cp=max(2, case["cp"]), topology="group")
    return case, rng.randrange(case["cp"]), rng.choice(PERTURBATIONS)


def fuzz_disagreeing_case(rank, world, *, case, odd_rank, what):
    """run_case with rank `odd_rank`'s call changed in `what`: ("ok", errors), ("refused", type, message) or
    ("error", type, message) for any other exception (all are results here: the judge wants every rank of the
    group to stop with an error, none to hang)."""
    mine = perturbed(case, what, random.Random(case["seed"])) if rank == odd_rank else case
    try:
        return ("ok", run_case(rank, world, **mine))
    except Exception as err:  # noqa: BLE001
        return ("refused" if isinstance(err, CLEAR_REFUSALS) else "error", type(err).__name__, str(err)[:2000])


def groups_out_of_step(results) -> bool:
    """Whether a rank's exchange failed in the case (an "error" result, such as the timeout beside a rank that
    refused before its call): the library then refuses every later call on that group (GroupBroken) until the
    group is made anew, so the next case needs a fresh pool."""
    return any(r is not None and r[0] == "error" for r in results)


def judge_disagreement(results, case: dict, what: str) -> str | None:
    """None when every rank of the group raised a clear error, or every rank finished with the oracle's results:
    an option that may differ per rank (the lse asked for by some ranks, the ring's launch groups, Ulysses chunks),
    or a change that left the call the same (causal with a window (w, 0), plans that cut alike, "auto" that is
    "ring")."""
    group = results[:case["cp"]]
    if all(r[0] == "ok" for r in group):
        return judge(results, tolerance(case))
    if all(r[0] == "refused" for r in group):
        return None
    # a rank refused before its call reached the library (its own make_plan or module), and the others timed out
    # waiting for it with an error that names the missed call: bounded and loud, all a library can do
    if all(r[0] == "refused" or (r[0] == "error" and r[1] == "CommError" and "did every rank call it?" in r[2])
           for r in group) and any(r[0] == "refused" for r in group):
        return None
    return f"the ranks did not all refuse (differing in {what}): {group}"


_MODULES: dict = {}  # (cp_module's arguments) -> (module, cp rank), with reuse_modules


def _reused_module(make):
    """cp_module, but one module per set of arguments, kept for later cases: a module called with other shapes,
    plans and dtypes than before must not reuse anything of an earlier call's."""
    def cached(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in _MODULES:
            _MODULES[key] = make(*args, **kwargs)
        return _MODULES[key]
    return cached


def fuzz_case(rank, world, *, case, reuse_modules=False):
    """run_case on this rank, with a refusal caught: ("ok", errors) or ("refused", exception type, message)."""
    import cp_cases

    make = cp_cases.cp_module
    if reuse_modules:
        cp_cases.cp_module = _reused_module(make)
    try:
        return ("ok", run_case(rank, world, **case))
    except CLEAR_REFUSALS as err:
        return ("refused", type(err).__name__, str(err))
    finally:
        cp_cases.cp_module = make


def judge(results, tol: float = 1e-10) -> str | None:
    """None when the case passed (exact on every rank, or refused alike on every rank), else what went wrong."""
    kinds = {r[0] for r in results if r != ("ok", None)}  # (("ok", None): a rank outside the case's group)
    if kinds == {"refused"} or not kinds:
        return None
    if kinds != {"ok"}:
        return f"refused on some ranks only: {results}"
    for r in results:
        errors = r[1]
        if errors is None:
            continue
        bad = {n: errors[n] for n in ("out", "dq", "dk", "dv", "lse") if errors.get(n, 0.0) >= tol}
        if bad:
            return f"errors past {tol:g}: {bad}"
    seen = [r[1] for r in results if r[1] is not None]
    if "dsinks" in seen[0]:
        total = torch.tensor([r["dsinks"] for r in seen], dtype=torch.float64).sum(0)
        want = torch.tensor(seen[0]["dsinks_ref"], dtype=torch.float64)
        if not torch.allclose(total, want, atol=tol, rtol=tol):
            return f"sinks' gradient summed over the ranks {total.tolist()} against {want.tolist()}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed; case i uses seed + i")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one case may take")
    parser.add_argument("--reuse-modules", action="store_true",
                        help="one module per set of module options, called by every later case that has them")
    parser.add_argument("--invariant", action="store_true",
                        help="cp_invariant=True layouts against the single device's bytes (fp32 and bf16)")
    parser.add_argument("--disagree", action="store_true",
                        help="one rank's call differs from the others' in one option, shape or plan")
    parser.add_argument("--verbose", action="store_true", help="print every case's outcome")
    args = parser.parse_args(argv)
    from cp_harness import DistPool

    pool = DistPool(4)
    failures, refused, start = [], 0, time.monotonic()
    for i in range(args.cases):
        results = []
        try:
            if args.disagree:
                case, odd, what = draw_disagreement(args.seed + i)
                results = pool.run(fuzz_disagreeing_case, timeout=args.timeout, case=case, odd_rank=odd, what=what)
                problem = judge_disagreement(results, case, what)
                case = dict(case, odd_rank=odd, what=what)
            elif args.invariant:
                case = draw_invariant_case(args.seed + i)
                results = pool.run(fuzz_invariant_case, timeout=args.timeout, case=case)
                problem = judge_invariant(results)
            else:
                case = draw_case(args.seed + i)
                results = pool.run(fuzz_case, timeout=args.timeout, case=case, reuse_modules=args.reuse_modules)
                problem = judge(results, tolerance(case))
            refused += any(r[0] == "refused" for r in results) and problem is None
        except AssertionError as err:  # a rank raised something other than a clear refusal, or the pool broke
            problem = str(err)
        if pool.broken or problem or groups_out_of_step(results):  # (fresh groups for the next case)
            pool.close()
            pool = DistPool(4)
        if args.verbose and not problem:
            shown = results if args.invariant else [
                r[:2] if r[0] != "ok" else r[1] and {n: r[1].get(n) for n in ("out", "dq", "strategy")}
                for r in results]
            print(f"seed={args.seed + i} {shown}")
        if problem:
            failures.append((case, problem))
            print(f"FAIL seed={args.seed + i} case={case}\n  {problem[:3000]}", flush=True)
    print(f"{args.cases} cases, {len(failures)} failures, {refused} refused alike, "
          f"{time.monotonic() - start:.0f} s")
    pool.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
