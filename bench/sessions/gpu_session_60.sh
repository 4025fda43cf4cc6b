#!/usr/bin/env bash
# Prepared in the sixtieth session (2026-12-07): gpu_session_59.sh's lse_fix part split in two calls, so that each
# fits one 600 s call with room (its four stages' limits add to 870 s).
# - lse_check: split_error, the long-row test and the whole forward suite, after the online softmax's rescale fix
#   (21da903). Predicted: the unsplit rows' max lse error at 16500 / 32768 keys from 1.5e-5 / 2.8e-5 to < 5e-6,
#   every split test and the long-row test pass.
# - speed_window: the forward's speed after the fix beside flash-attn-4 (within +-0.5% of the fifty-ninth's
#   ratios), then the window and non-finite suites.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_60.sh lse_check; then speed_window.
set -u
HERE="$(dirname "$0")"
for s in ${*:-lse_check}; do
  case $s in
    lse_check)
      bash "$HERE/gpu_session_59.sh" split_error
      source "$HERE/../stage.sh"
      TAIL_LINES=8 stage long_rows 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider -rfE \
        tests/kernels/test_cute_fwd_gpu.py -k long_rows
      grep "lse max" "$OUT/long_rows.log"
      gpu_tests fwd_tests 280 tests/kernels/test_cute_fwd_gpu.py ;;
    speed_window)
      source "$HERE/../stage.sh"
      TAIL_LINES=26 stage fwd_speed 200 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 32768 \
        --causal false true --directions fwd --backends cute flash_attn_4 --rounds 5 --queue-ahead-ms 3 \
        --out-dir "$OUT/fwd_speed"
      bash "$HERE/gpu_session_59.sh" window_tests ;;
    *) echo "unknown stage $s (lse_check | speed_window)"; exit 2 ;;
  esac
done
