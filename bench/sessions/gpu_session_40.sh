#!/usr/bin/env bash
# Fortieth session (2026-12-05): the ring's lse gradient through cute's work lists again (the shared query side
# dropped a unit-stride dlse: the thirty-ninth session's wrong ring dq; fixed, CuteSm90Backend.worklist_dlse on),
# then the GPU suite in two parts and the thirty-ninth session's benches.
# - lse_tests: the work-list dlse tests (launches and loop), the ring-step lists with dlse against the loop, the CP
#   lse tests on one GPU; predicted: all pass.
# - tests_kernels / tests_rest: the GPU suite (named failures: -rfE, one line each).
# - table / window / lse: as gpu_session_39.sh.
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_40.sh [stages]
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s40 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
stages=${*:-lse_tests tests_kernels}
for s in $stages; do
  case $s in
    lse_tests)
      TAIL_LINES=15 stage lse_tests 200 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu -n 14 \
        tests/kernels/test_worklist_gpu.py tests/cp/test_cp_gpu.py tests/kernels/test_backends_gpu.py -k "the_lse" ;;
    tests_kernels|tests_rest|table|window|lse|persistent)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_39.sh" "$s" ;;
    *) echo "unknown stage $s (lse_tests | tests_kernels | tests_rest | table | window | lse | persistent)"; exit 2 ;;
  esac
done
