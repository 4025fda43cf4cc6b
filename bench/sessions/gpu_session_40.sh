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
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
stages=${*:-lse_tests tests_kernels}
for s in $stages; do
  case $s in
    lse_tests)
      TAIL_LINES=15 stage lse_tests 200 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu -n 14 \
        tests/kernels/test_worklist_gpu.py tests/cp/test_cp_gpu.py tests/kernels/test_backends_gpu.py -k "the_lse" ;;
    sinks)  # the sinks' gradient's row sums in one kernel (cute/row_dot.py; the torch form's ~14 fp32 passes cost
      # +5% of a forward+backward at 32k): its tests, the sinks tests, then window.py's sinks row; predicted: the
      # sinks' forward+backward cost against causal from +6% to +1-2%
      TAIL_LINES=15 stage sinks_tests 200 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu -n 14 \
        tests/kernels/test_row_dot_gpu.py tests/kernels/test_window_gpu.py tests/cp/test_cp_gpu.py \
        tests/kernels/test_backends_gpu.py -k "row_dot or sink or invariant_bitwise or the_lse"
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_39.sh" window ;;
    short)  # causal 1k / 2k: device time (queued behind a spin) against do_bench's, and the host time per call;
      # the #11 table's causal-1k cute/cuDNN forward is 0.85-0.86 in do_bench while the twenty-fourth session's
      # kernel times had hdim 128 at 1.03x cuDNN: predicted, host time (past do_bench's L2 flush) is most of it
      for t in device do_bench; do
        q=0; [ $t = device ] && q=3
        TAIL_LINES=14 stage "short_$t" 120 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 \
          --causal true --directions fwd bwd --backends cute cudnn flash_attn_4 --rounds 3 --queue-ahead-ms $q \
          --out-dir "$OUT/short_$t"
      done
      for d in 128 64; do
        TAIL_LINES=30 stage "host_$d" 90 python3 bench/host_profile.py --headdim $d --heads $((2048 / d)) --calls 50 --cudnn \
          --top 12 --out-dir "$OUT/host_$d"
      done ;;
    tests_kernels|tests_rest|table|window|lse|persistent)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_39.sh" "$s" ;;
    *) echo "unknown stage $s (lse_tests | sinks | short | tests_kernels | tests_rest | table | window | lse | persistent)"; exit 2 ;;
  esac
done
