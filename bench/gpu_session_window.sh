#!/usr/bin/env bash
# One call on one H200 for the sliding window in the CuTe kernels: a quick forward/backward check per case
# (bench/window_debug.py, one process each), the window GPU tests (cute cases, the softcap kernels among them),
# the non-finite suite (sanitizer), and bench/window.py beside flash-attn-4 (softcap timed on the cute kernels).
#   source .devwheels/install.sh && bash bench/gpu_session_window.sh
set -u
source "$(dirname "$0")/stage.sh"
TAIL_LINES=3 stage debug_fwd4096 50 python3 bench/window_debug.py fwd4096
TAIL_LINES=15 stage window_tests 150 python3 -m pytest -q tests/kernels/test_window_gpu.py -k "cute or between"
TAIL_LINES=4 stage nonfinite 70 python3 -m pytest -x -q tests/kernels/test_cute_nonfinite_gpu.py
FA4DIST_CUTE_SOFTCAP=1 TAIL_LINES=8 stage window_bench 100 python3 bench/window.py --out-dir "$OUT"
