#!/usr/bin/env bash
# One call on one H200 for the mask options in the CuTe kernels: a quick forward check (bench/window_debug.py),
# the window GPU tests (cute cases: windows, the softcap kernels, sinks in the forward epilogue), the non-finite
# suite (sanitizer), bench/window.py beside flash-attn-4, and the windowed backward without the sanitizer (what
# the masked-step guarantee costs at W = 4096).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_window.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=3 stage debug_fwd4096 50 python3 bench/window_debug.py fwd4096
TAIL_LINES=15 stage window_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "cute or between"
TAIL_LINES=4 stage nonfinite 70 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_cute_nonfinite_gpu.py
TAIL_LINES=9 stage window_bench 100 python3 bench/window.py --out-dir "$OUT"
FA4DIST_BWD_OVERRIDE="sanitize=0" TAIL_LINES=7 stage window_bench_nosanitize 100 python3 bench/window.py \
  --out-dir "$OUT/nosanitize"
