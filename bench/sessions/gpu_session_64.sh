#!/usr/bin/env bash
# Sixty-fourth session's GPU calls (bench/RESULTS.md). Each part states its prediction.
# - inv_bounds: cp_invariant's fixed-point dq bound per row (fixed_point.visible_key_bounds: each row's document
#   keys up to the last it sees, not the head's whole tensor). GPU tests: the staged-rank cp_invariant layouts
#   (tests/cp/test_cp_gpu.py -k invariant) and the single device's bf16 independence of keys a row cannot see
#   (tests/kernels/test_invariant_gpu.py). Then its cost: bench/invariant.py at 32k tokens beside the package at the
#   session's start (.kwt/base: `git archive 237f516 fa4dist | tar -x -C .kwt/base`, carried), cp_invariant@baseline.
#   Predicted: every test passes; the cp_invariant step within +-0.5% of the baseline's (a cummax and a gather over
#   tokens x heads, ~0.1-0.3 ms of a ~60 ms step).
# - suites: the GPU suites the session's host changes reach (the reference forward's per-row overflow guard and its
#   blocked non-finite sums on CUDA tensors, the bounds through the staged ranks). Predicted: all pass.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_64.sh inv_bounds; then suites.
set -u
HERE="$(dirname "$0")"
source "$HERE/../stage.sh"
for s in ${*:-inv_bounds}; do
  case $s in
    inv_bounds)
      gpu_tests inv_tests 300 tests/cp/test_cp_gpu.py tests/kernels/test_invariant_gpu.py -k "invariant or keys_it"
      base=()
      if [ -d .kwt/base/fa4dist ]; then base=(--baseline-dir .kwt/base); else echo "no .kwt/base: no baseline"; fi
      TAIL_LINES=14 stage inv_cost 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 32:8 --reps 5 \
        --rounds 3 "${base[@]}" --out-dir "$OUT/inv" ;;
    suites)
      gpu_tests suites 560 tests/kernels/test_backends_gpu.py tests/kernels/test_nonfinite.py tests/cp/test_cp_gpu.py \
        tests/kernels/test_invariant_gpu.py ;;
    *) echo "unknown stage $s (inv_bounds | suites)"; exit 2 ;;
  esac
done
