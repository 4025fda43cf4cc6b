#!/usr/bin/env bash
# Second call for the merge epilogue: short tiles prefetch their running (out, lse) at their start
# (fwd_sm90.PREFETCH_LEAD_BLOCKS); the suites that merge (work lists, the ring) and the masked loops (windows).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_fwd_epilogue2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=30 stage accumulate_bench 100 python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal true \
  --directions fwd --backends cute --baseline-dir .kwt/head --rounds 5 --warmup-ms 10 --rep-ms 30 --accumulate \
  --accumulate-seqlens 4096 16384 --accumulate-variants prefetch_running=true prefetch_running=false --out-dir "$OUT"
TAIL_LINES=4 stage worklist_fwd 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k "random_lists_equal_the_loop and not backward or ring_schedule_lists"
TAIL_LINES=4 stage cp_tests 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py
TAIL_LINES=4 stage window_tests 160 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "cute or between"
