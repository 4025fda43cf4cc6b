#!/usr/bin/env bash
# Prepared in the forty-third session (2026-12-05) for the next one. A call returns few files: run stages alone or
# in pairs.
# - window_tests: the window GPU suites on today's kernels (test_window_gpu.py's three wide-window cases with the
#   key tile at the sequence end ran only on the one-edge masks, since reverted).
# - host_layers: the short step's host time per layer: bench/host_python.py on CUDA tensors (launches no-op'd) for
#   1 and 8 chained calls through one backward, with autograd's device thread and without. The forty-third session
#   read ~300 us of a one-call step as the device-thread path (RESULTS.md); a model pays its hand-off once per
#   backward, so the 8-call chain says what a layer pays.
# - fwd_long (on the H200 if lent; as gpu_session_43.sh).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_45.sh [window_tests] [host_layers]
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s45 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-window_tests host_layers}; do
  case $s in
    window_tests)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_44.sh" window_tests ;;
    host_layers)
      for layers in 1 8; do
        for t in on off; do
          TAIL_LINES=2 stage "host_l${layers}_thread_$t" 120 python3 bench/host_python.py --device cuda \
            --layers "$layers" --autograd-thread "$t" --calls 500 --loops 5
        done
      done ;;
    fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_43.sh" fwd_long ;;
    *) echo "unknown stage $s (window_tests | host_layers | fwd_long)"; exit 2 ;;
  esac
done
