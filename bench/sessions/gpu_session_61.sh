#!/usr/bin/env bash
# Sixty-first session's GPU calls (bench/RESULTS.md). Each part states its prediction.
# - scaled: gpu_session_60.sh scaled (the row max stored in log2 units, then on branch stored-max at a65c9e0, merged
#   after this call; needs pre_softmax.py).
# - inv_ev: the single device's cp_invariant backward (the int64 dQ written into a float dq) reading its step's lse2 /
#   dPsum early (backward.default_early_vectors, which kept every fixed-point call off). Needs pre_backward.py, the
#   backward.py before the change (untracked: `git show 4c88cd6^:fa4dist/kernels/cute/backward.py >
#   pre_backward.py`), for cp_invariant@baseline. Predicted: the cp_invariant step 1-3% faster at 32k (the plain
#   causal backward gained +1.6-2.6% at 8k-32k from it), the int64 kernel row with early_vectors=1 (accumulating,
#   as the ring's gather engine calls it) 1-3% below the row without; the bits tests pass (the loads only move).
#   The change is on branch s61 (commit 4c88cd6): run this part on a checkout of it; on main both sides are alike.
# - table: #11's table (gpu_session_59.sh table: stage.sh kernels_table; an H200, alone: 420 s), under the stored
#   max if it merged. Predicted: hdim-64 forward at 16k back at 0.97-0.98x flash-attn-4 (the fifty-ninth's H200
#   table before the lse fix), the other points as then.
# Run in the sixty-first (bench/RESULTS.md), on one H100: scaled (call 17; then the merge), inv_ev (call 18: 1.2-1.4%
#   slower, not merged), the 32k speed and the window / non-finite suites by hand (calls 19, 20). Not run: table.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_61.sh scaled; then inv_ev.
set -u
HERE="$(dirname "$0")"
for s in ${*:-scaled}; do
  case $s in
    scaled) bash "$HERE/gpu_session_60.sh" scaled ;;
    table) bash "$HERE/gpu_session_59.sh" table ;;
    inv_ev)
      source "$HERE/../stage.sh"
      pre="${PRE_BACKWARD:-pre_backward.py}"
      if [ -f "$pre" ]; then
        rm -rf /tmp/preinv && mkdir -p /tmp/preinv && cp -r fa4dist /tmp/preinv/ \
          && cp "$pre" /tmp/preinv/fa4dist/kernels/cute/backward.py
        base=(--baseline-dir /tmp/preinv)
      else
        echo "no $pre: cp_invariant@baseline skipped"; base=()
      fi
      TAIL_LINES=24 stage inv 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 32:8 --reps 5 --rounds 3 \
        --fixed-variants early_vectors=1 "${base[@]}" --out-dir "$OUT/inv"
      GPU_TEST_WORKERS=8 gpu_tests inv_tests 200 tests/cp/test_cp_gpu.py tests/kernels/test_cute_bwd_gpu.py \
        -k "invariant or fixed_point or early_vectors" ;;
    *) echo "unknown stage $s (scaled | inv_ev | table)"; exit 2 ;;
  esac
done
