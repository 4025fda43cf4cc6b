#!/usr/bin/env bash
# Prepared in the thirty-fourth session (2026-12-04) for the next one (no device time was left):
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_36.sh 1    (flash-attn-4 carried: --with-fa4)
# 1: two compiled, unmeasured knobs of the backward's launch order (NOTES_BWD.md, thirty-fourth session).
#    (a) lpt_over_heads on deterministic configs: every head's shortest key tile first, then every head's next (the
#    tickets' waits stay on earlier launches; the same bits: the step-form test). flash-attn-4's deterministic
#    scheduler orders its L2 groups of heads so and runs 8 x 4k at 1.12x ours. Prediction: +8-15% at 8 heads of
#    4k / 8k (the head-major tail, as the non-deterministic order's +40% there, less the deterministic chains).
#    (b) lpt_group: the non-deterministic over-heads order within groups of 4 / 8 (batch, kv head) pairs on the
#    many-wave shapes where over every head lost (4 x 4k x 16: -12%, the #11 bench's 4k). Prediction: +0-3% against
#    head-major (its tail is a small share of 16 waves), so 1.00x flash-attn-4 there at best.
#    (c) lpt_over_heads on packed causal documents (key tile j of every sequence and head, then j + 1), mixed
#    lengths, beside the default and flash-attn-4 (bench/packed_tiles.py checks the gradients against the default
#    row). Prediction: +0-10% at few heads (the packed launch is head-major over sequences x heads today).
# 0: the thirty-fifth session's changes on the GPU (it had no device): the kernels' arguments by name
#    (FwdKernelArgs / BwdKernelArgs: every launch form once, the same launches recorded on the CPU), cp_invariant with
#    sinks on staged ranks, the work lists, the sdpa guard's dv rule; and the thirty-sixth's (no device either):
#    the differentiable lse through sdpa and cute (test_backends_gpu.py). Expect every test to pass.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s36 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
if [ "${1:-1}" = 0 ]; then
  TAIL_LINES=10 stage tests_launch_forms 240 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py \
    tests/kernels/test_cute_bwd_gpu.py -k "split or persistent or shared_queries or one_gradient or fixed_point or \
    accumulate or varlen or packed_random or expanded"
  TAIL_LINES=10 stage tests_worklists_invariant 240 $PYTEST tests/kernels/test_worklist_gpu.py \
    tests/cp/test_cp_gpu.py -k "worklist or invariant"
  # the guard's dv poisoning (sdpa backends) and the contract's result checks, on the fused ops
  TAIL_LINES=10 stage tests_guard_contract 150 $PYTEST tests/kernels/test_nonfinite.py tests/kernels/test_backends_gpu.py
  exit
fi
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=6 stage tests_bits 150 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py -k "step_forms"
  TAIL_LINES=14 stage det_over_heads 120 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 8192 \
    --total-tokens 8192 --model-dim 1024 --causal true --directions bwd --deterministic --backends cute \
    flash_attn_4 --rounds 3 --cute-variants "bwd-det:lpt_over_heads=true" --out-dir "$OUT/det_over_heads"
  for v in off g4 g8; do
    o=; [ "$v" = g4 ] && o=lpt_over_heads=1,lpt_group=4; [ "$v" = g8 ] && o=lpt_over_heads=1,lpt_group=8
    TAIL_LINES=8 FA4DIST_BWD_OVERRIDE=$o stage "groups_$v" 120 python3 bench/split_tail.py --direction bwd --causal \
      --headdim 128 --shapes 4x4096x16 2x8192x16 1x16384x16 --rounds 3 --out-dir "$OUT/groups_$v"
  done
  TAIL_LINES=10 stage packed_over_heads 150 python3 bench/packed_tiles.py --direction bwd --headdim 128 \
    --doclen 1024 2048 4096 --mixed --total-tokens 16384 --model-dim 1024 --variants lpt_over_heads=1
  exit
fi
