#!/usr/bin/env bash
# One H200, one call, for the forward's merge epilogue (running (out, lse) prefetched into L2 by the producer warp,
# every read issued before the first write) and the leaner key-block loop (one max.f32 per step of the row max's
# quad reduction, Q's K-block descriptors made once):
#   git archive <base> fa4dist | tar -x -C .kwt/head      # the checkout to compare against (carried: .kwt)
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_fwd_epilogue.sh
# The bench runs the base checkout's kernels as "cute@baseline" in the same interleaved rounds.
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=5 stage fwd_tests 200 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py
TAIL_LINES=4 stage nonfinite 100 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py
TAIL_LINES=4 stage worklist_fwd 90 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k "random_lists_equal_the_loop and not backward or ring_schedule_lists"
TAIL_LINES=60 stage kernels_bench 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false true --directions fwd --backends cute sdpa_cudnn flash_attn_4 --baseline-dir .kwt/head \
  --rounds 3 --warmup-ms 10 --rep-ms 30 --accumulate --accumulate-variants prefetch_running=true \
  prefetch_running=false --out-dir "$OUT"
