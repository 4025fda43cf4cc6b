#!/usr/bin/env bash
# Third call: the persistent grid's bits (plain out / lse) for every case, the merge form within rounding, and the
# work-list forward tests (their per-item loop keeps one CTA per tile).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent3.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=8 stage persistent_bits 150 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_fwd_gpu.py -k persistent
TAIL_LINES=4 stage worklist_fwd 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k "random_lists_equal_the_loop and not backward or ring_schedule_lists"
