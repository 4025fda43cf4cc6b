#!/usr/bin/env bash
# Prepared in the forty-third session (2026-12-05). A call returns few files: run stages alone or in pairs.
# - fwd_knobs: the #11 forward at S >= 4k (device time, 7 interleaved rounds) with the two schedule fields that
#   read +0-1.9% at hdim 64 in the thirtieth session (chained_max; late_pv_wait, off by default at hdim 64 causal)
#   beside the defaults, flash-attn-4 and cuDNN. Schedule fields give the same bits, so a default may follow them.
# - fwd64_grid: hdim 64 at 4k / 16k with one CTA per tile and with the static persistent walk beside the default
#   dynamic one: ptxas places the PV wait after ~11 exp2 in those (as in flash-attn-4's SASS), before the first in
#   the default (bench/sass_softmax.py on the CPU; Nsight Compute's samples of call 4: MUFU mio / wait +12.5k).
# - window_tests: the window GPU suites (run in call 6 on the one-edge window masks, since reverted).
# - window_edges: bench/window.py's causal and window rows at W 4096 and 1024 (WINDOWS=...) with a baseline
#   package in .kwt/base (carried; `git archive <commit> fa4dist | tar -x -C .kwt/base`, plus this window.py) and
#   with the working tree's, each beside flash-attn-4 (call 6: the one-edge masks, no change; RESULTS.md).
# - fwd_long / parts / stacks: as gpu_session_43.sh. table / window: as gpu_session_40.sh.
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_44.sh [fwd_knobs] [...]
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s44 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-fwd_knobs}; do
  case $s in
    fwd_knobs)
      TAIL_LINES=30 stage fwd_knobs 420 python3 bench/kernels.py --headdims 64 128 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute cudnn flash_attn_4 --rounds 7 --queue-ahead-ms 3 \
        --cute-variants "fwd:chained_max=1" "fwd:chained_max=1,late_pv_wait=1" --out-dir "$OUT/fwd_knobs" ;;
    fwd64_grid)
      TAIL_LINES=16 stage fwd64_grid 300 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute cudnn flash_attn_4 --rounds 5 --queue-ahead-ms 3 \
        --cute-variants "fwd:persistent_ctas=0" "fwd:dynamic_tiles=0" "fwd:persistent_ctas=0,late_pv_wait=1" \
        --out-dir "$OUT/fwd64_grid" ;;
    window_tests)
      TAIL_LINES=6 stage window_tests 300 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_window_gpu.py tests/kernels/test_cute_nonfinite_gpu.py
      TAIL_LINES=6 stage window_tests_cp 240 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_worklist_gpu.py tests/cp/test_cp_gpu.py tests/kernels/test_backends_gpu.py -k window ;;
    window_edges)
      # .kwt/base: the previous commit's fa4dist (git archive of it) and this window bench, run from its own root
      for w in ${WINDOWS:-4096 1024}; do
        for who in base new; do
          root=$PWD; [ $who = base ] && root=$PWD/.kwt/base
          TAIL_LINES=12 stage "window_${w}_$who" 240 bash -c "cd $root && python3 bench/window.py --window $w \
            --cases causal window --rounds 5 --queue-ahead-ms 5 --out-dir $OUT/window_${w}_$who"
        done
      done ;;
    fwd_long|parts|stacks)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_43.sh" "$s" ;;
    table|window)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_40.sh" "$s" ;;
    *) echo "unknown stage $s (fwd_knobs | fwd64_grid | window_tests | window_edges | fwd_long | parts | stacks | table | window)"; exit 2 ;;
  esac
done
