#!/usr/bin/env bash
# Prepared in the thirtieth session (2026-12-04), results in bench/results/2026-12-04-thirtieth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_31.sh 1    (flash-attn-4 carried: --with-fa4;
#   .kwt/base holds the previous commit's fa4dist, the baseline of the bits and timing comparisons)
# 1: the forward's deferred V marks (defer_v_marks): the overlapped consumer marks a masked block's rows that see a
#    non-finite V row after the block's PV instead of right after its softmax, where the wait for the V tile's
#    landing and the sanitizer's scan sat before the next S GEMM. The twenty-ninth session measured the sanitizer's
#    whole cost at 3-4% at 1k causal (fwd:sanitize=0), nothing at 4k. (a) the same bytes as the previous commit
#    (bench/bits_vs_baseline.py, clean and poisoned inputs); (b) the non-finite and forward GPU suites; (c) causal
#    1k / 4k forward, hdim 64 / 128, beside the previous commit (cute@baseline), cuDNN and flash-attn-4, 5 rounds;
#    prediction: +1-3% at 1k (up to the sanitize=0 figure), 0 at 4k.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s31 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=45 stage bits 140 python3 bench/bits_vs_baseline.py .kwt/base
  TAIL_LINES=4 stage tests_nonfinite 120 $PYTEST -n 8 tests/kernels/test_cute_nonfinite_gpu.py
  TAIL_LINES=14 stage fwd_marks 170 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 --causal true \
    --directions fwd --backends cute cudnn flash_attn_4 --baseline-dir .kwt/base --rounds 5 --out-dir "$OUT/fwd_marks"
  TAIL_LINES=4 stage tests_fwd 110 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py
  exit
fi
# 2: call 1: the same bytes (28 cases) and the suites passed, but the first form was slower than the previous commit:
#    hdim 64 causal 299 / 415 TFLOP/s against 313 / 432 at 1k / 4k, hdim 128 415 / 561 against 417 / 568 (cuDNN 331
#    / 411 / 412 / 521, flash-attn-4 260 / 438 / 401 / 560). Its plain steps each carried a runtime branch (mark the
#    previous block or not) between the PV wait and the stage release. Now the first plain step runs on its own and
#    the others carry none; prediction: no loss at 4k, the gain (if any) at 1k.
if [ "$1" = 2 ]; then
  TAIL_LINES=3 stage bits 140 python3 bench/bits_vs_baseline.py .kwt/base
  TAIL_LINES=3 stage tests_nonfinite 120 $PYTEST -n 8 tests/kernels/test_cute_nonfinite_gpu.py
  TAIL_LINES=8 stage fwd_marks 170 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 --causal true \
    --directions fwd --backends cute cudnn flash_attn_4 --baseline-dir .kwt/base --rounds 7 --out-dir "$OUT/fwd_marks"
  exit
fi
# 3: call 2: the peeled form was within noise of the previous commit (-1 to +1.2%): the mark's wait is not on the
#    critical path; both forms removed. Now the status against #11's targets under today's defaults (the last whole
#    table predates clean_tiles): (a) the table, 5 rounds, deterministic included; (b) hdim 64 forward at 4k / 16k
#    (non-causal 16k 0.98x and causal 4k 0.96-1.00x flash-attn-4 in recent runs) under its existing knobs: a third
#    K / V stage, 128-row tiles, the row sum's order, flash-attn-4's max and wait forms.
if [ "$1" = 3 ]; then
  TAIL_LINES=30 stage table 280 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute cudnn flash_attn_4 --rounds 5 \
    --out-dir "$OUT/table"
  TAIL_LINES=8 stage d64_knobs 200 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 --causal false true \
    --directions fwd --backends cute flash_attn_4 --rounds 5 --out-dir "$OUT/d64_knobs" \
    --cute-variants fwd:num_stages=3 fwd:tile_m=128 fwd:sum_from_old=0 fwd:chained_max=1 fwd:late_pv_wait=1
  exit
fi
# 4: call 3: the table (bench/RESULTS.md, thirtieth session). Host-side changes of this session that only a GPU runs:
#    the shared query side's checks against each work list's tensors (the ring's backward on the cute backend), the
#    contract's new checks (softcap range, Mask, the partial-block buffers), the compile reason. Their GPU suites.
#    Then (b) the hdim-128 causal backward at 1k / 4k (0.98x flash-attn-4 at both in call 3) under its knobs.
if [ "$1" = 4 ]; then
  TAIL_LINES=4 stage tests_worklist 120 $PYTEST -n 8 tests/kernels/test_worklist_gpu.py tests/kernels/test_backends_gpu.py
  TAIL_LINES=4 stage tests_cp 180 $PYTEST -n 8 tests/cp/test_cp_gpu.py
  TAIL_LINES=4 stage tests_misc 80 $PYTEST -n 8 tests/kernels/test_torch_compile.py tests/kernels/test_window_gpu.py \
    -k "compile or softcap or sinks"
  TAIL_LINES=6 stage bwd_knobs 150 python3 bench/kernels.py --headdims 128 --seqlens 1024 4096 --causal true \
    --directions bwd --backends cute flash_attn_4 --rounds 5 --out-dir "$OUT/bwd_knobs" --cute-variants \
    bwd:try_waits=1 bwd:persistent_ctas=0 bwd:interleave_lengths=1 bwd:masked_last=0 bwd:early_vectors=1 \
    bwd:tma_store_dkv=0
  exit
fi
# 5: the last helpers changed how the context-parallel records key process groups (name and world, not id) and the
#    agreement exchanges' numbering: the staged-rank GPU suite again.
if [ "$1" = 5 ]; then
  TAIL_LINES=4 stage tests_cp 180 $PYTEST -n 8 tests/cp/test_cp_gpu.py
  exit
fi
