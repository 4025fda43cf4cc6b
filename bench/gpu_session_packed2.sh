#!/usr/bin/env bash
# Packed 16-bit forward launches on the dynamic persistent grid by default: the packed forward tests.
#   source .devwheels/install.sh && bash bench/gpu_session_packed2.sh
set -u
source "$(dirname "$0")/stage.sh"
TAIL_LINES=4 stage packed_fwd 75 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  tests/kernels/test_cute_nonfinite_gpu.py tests/kernels/test_window_gpu.py \
  -k "test_varlen or gqa_rows_equal and packed or forward_packed or cute_windowed_packed or packed_windows and cute"
