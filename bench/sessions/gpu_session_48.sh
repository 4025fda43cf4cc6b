#!/usr/bin/env bash
# Prepared in the forty-fifth session (2026-12-05). A call returns few files: run stages alone or in pairs.
# - marks_tests: FwdConfig.defer_v_marks (a masked block's bad-V rows marked in the step that issues its PV, after
#   that step's V wait, instead of right after its softmax, where the consumer waited for the sanitizer before the
#   next block's S GEMM): the forward suite (the schedule fields' same-bits test covers the knob, with NaN / inf V
#   rows in the diagonal block and mid-sequence) and the non-finite suite.
# - marks_bench: the causal forward at 1k-16k against the knob off and the sanitizer off (its whole cost: the
#   twenty-ninth session read 313 / 426 against 322 / 442 TFLOP/s at 1k, hdim 64 / 128), cuDNN and flash-attn-4,
#   in device time. marks_packed: packed 512 / 1024-token documents (hdim 64, the two-CTA short kernels).
# - scratch_rest, handoff, scratch_host, fwd_long: as gpu_session_47.sh.
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_48.sh [marks_tests] [marks_bench] ...
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s48 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-marks_tests}; do
  case $s in
    marks_tests)
      TAIL_LINES=6 stage marks_tests 270 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_nonfinite_gpu.py
      pkill -f "pytest|xdist" 2>/dev/null ;;
    marks_bench)
      TAIL_LINES=40 stage marks_bench 270 python3 bench/kernels.py --headdims 128 64 \
        --seqlens ${MARKS_SEQLENS:-1024 2048 4096 16384} --causal true --directions fwd \
        --backends cute cudnn flash_attn_4 --cute-variants fwd:defer_v_marks=0 fwd:sanitize=0 --rounds 5 \
        --queue-ahead-ms 3 --out-dir "$OUT/marks_bench" ;;
    marks_packed)
      TAIL_LINES=12 stage marks_packed 150 python3 bench/packed_tiles.py --doclen 512 1024 --rounds 5 \
        --queue-ahead-ms 3 --variants defer_v_marks=0 ;;
    order)
      # FwdConfig.sanitized_v_first (the sanitizer's V tile loaded before the next block's K; commit fada1f0, removed
      # after this stage measured no gain): its same-bits test, then the short causal forward and packed documents
      # against the knob off
      TAIL_LINES=4 stage order_tests 200 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_cute_fwd_gpu.py -k "schedule_fields and (sanitized or defer)" tests/kernels/test_cute_nonfinite_gpu.py
      pkill -f "pytest|xdist" 2>/dev/null
      TAIL_LINES=12 stage order_bench 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 4096 \
        --causal true --directions fwd --backends cute cudnn --cute-variants fwd:sanitized_v_first=0 \
        fwd:sanitized_v_first=0,defer_v_marks=0 fwd:sanitize=0 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/order_bench"
      TAIL_LINES=6 stage order_packed 100 python3 bench/packed_tiles.py --doclen 512 1024 --rounds 5 \
        --queue-ahead-ms 3 --variants sanitized_v_first=0 ;;
    scratch_rest|handoff|scratch_host|fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_47.sh" "$s" ;;
    *) echo "unknown stage $s (marks_tests | marks_bench | marks_packed | order | scratch_rest | handoff | scratch_host | fwd_long)"; exit 2 ;;
  esac
done
