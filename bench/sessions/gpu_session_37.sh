#!/usr/bin/env bash
# Thirty-seventh session (2026-12-05): the many-wave causal backward's launch order. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_37.sh     (flash-attn-4 carried: --with-fa4)
# gpu_session_36.sh 1 measured lpt_over_heads within groups of 4 (batch, kv head) pairs against head-major at hdim
# 128 (split_tail.py, device time): +4.5 / +4.6 / -0.1% at 4 x 4k x 16 / 2 x 8k x 16 / 16k x 16, so it became the
# default past the over-every-head bounds (backward.over_heads_group). Here: its bits against head-major (GPU test),
# the default against head-major at hdim 128 again, and groups of 4 against head-major at hdim 64 (4 x 4k x 32 lost
# 32% over every head; prediction +0-5% in groups of 4; head-major stays its default until measured), the #11 table's backward rows beside flash-attn-4, and the work-list / cp_invariant tests
# that ran past their stage limit single-process in gpu_session_36.sh 0; and the lse's gradient joined to the
# backward pass (attention_backward(dlse=), the cute preprocess), against the fp64 oracle, and its cost
# (bench/lse_grad.py: predicted within 1-2% of the out-only backward on cute, ~1.8-2x on sdpa's two passes).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s37 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
# in order of need (a call may be cut short by the session's device time)
TAIL_LINES=8 stage tests_lse_order 180 $PYTEST -n 6 tests/kernels/test_backends_gpu.py tests/kernels/test_cute_bwd_gpu.py \
  -k "lse_gradient or grouped_over_heads"
TAIL_LINES=8 stage lse_grad 120 python3 bench/lse_grad.py --seqlens 4096 16384 --rounds 2 --out-dir "$OUT/lse_grad"
for d in 64 128; do
  [ "$d" = 128 ] && shapes="4x4096x16 2x8192x16 1x16384x16 8x2048x16" || shapes="4x4096x32 2x8192x32 1x16384x32"
  # hdim 128: the default (groups of 4) against head-major; hdim 64 (head-major by default, unmeasured): groups of 4
  for v in default alt; do
    o=; [ "$v" = alt ] && { [ "$d" = 128 ] && o=lpt_over_heads=0 || o=lpt_over_heads=1,lpt_group=4; }
    TAIL_LINES=6 FA4DIST_BWD_OVERRIDE=$o stage "order_d${d}_$v" 100 python3 bench/split_tail.py --direction bwd \
      --causal --headdim "$d" --shapes $shapes --rounds 3 --out-dir "$OUT/order_d${d}_$v"
  done
  [ "$d" = 64 ] && TAIL_LINES=14 stage table_bwd 150 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 8192 \
    16384 --causal true --directions bwd --backends cute sdpa_cudnn flash_attn_4 --rounds 3 --out-dir "$OUT/table_bwd"
done
TAIL_LINES=10 stage tests_worklists_invariant 120 $PYTEST -n 8 tests/kernels/test_worklist_gpu.py \
  tests/cp/test_cp_gpu.py -k "worklist or invariant"
