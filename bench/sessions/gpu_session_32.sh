#!/usr/bin/env bash
# Prepared in the thirty-first session (2026-12-04), results in bench/results/2026-12-04-thirty-first-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_32.sh 1    (flash-attn-4 carried: --with-fa4)
# 1: does the last partial wave cost the long non-causal forward what the wave count says? The bench shapes (B =
#    16384/S, H = 2048/D) give hdim 128 2048 query tiles of 128 rows at every S: 15.52 waves of 132 CTAs, so half
#    the SMs idle for the last half wave (-3% if the clock stayed put). The same forward on shapes of whole waves
#    (2112 tiles = 16 waves; 1980 = 15 at S = 4224) beside the bench shape, cute and flash-attn-4 and cuDNN in the
#    same rounds. Prediction: TFLOP/s of the whole-wave shapes 2-3% above the 15.52-wave shape for every backend
#    that runs 128-row tiles (less if the clock rises when half the SMs idle).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s32 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
BK="python3 bench/kernels.py --headdims 128 --causal false --directions fwd --backends cute cudnn flash_attn_4"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=6 stage waves_bench 120 $BK --seqlens 4096 16384 --rounds 7 --out-dir "$OUT/waves_bench"
  TAIL_LINES=6 stage waves_16 120 $BK --seqlens 4096 --total-tokens 8192 --model-dim 4224 --rounds 7 \
    --out-dir "$OUT/waves_16"
  TAIL_LINES=6 stage waves_15 120 $BK --seqlens 4224 --total-tokens 4224 --model-dim 7680 --rounds 7 \
    --out-dir "$OUT/waves_15"
  TAIL_LINES=6 stage waves_32 120 $BK --seqlens 16384 --total-tokens 16384 --model-dim 4224 --rounds 7 \
    --out-dir "$OUT/waves_32"
  exit
fi
# 2: call 1 (bench/RESULTS.md, thirty-first session): whole waves ran 1.2-2.6% faster per tile for every backend,
#    so a split tail could buy ~1.5%, not built. Now the backward at hdim 96 (Phi-3's head dim; the forward had it,
#    the backward fell back to SDPA): K and the dQ staging tile on 32-byte swizzle atoms (the dQ GEMM's 48 columns
#    per warpgroup), the preprocess's rows on 8 threads of 12 elements. (a) its GPU tests against the fp64 oracle
#    (dense, packed, GQA, accumulate, deterministic bytes, one-gradient variants, the fixed-point forms); (b) the
#    bench at Phi-3-mini's width (32 heads of 96) beside cuDNN and flash-attn-4. Prediction: correct; between the
#    hdim-64 and hdim-128 kernels' TFLOP/s, ~1.0-1.1x cuDNN.
if [ "$1" = 2 ]; then
  TAIL_LINES=6 stage tests_bwd96 240 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_backends_gpu.py \
    -k "96 or case7 or case8 or (test_dense and case6)"
  TAIL_LINES=14 stage bench_d96 200 python3 bench/kernels.py --headdims 96 --model-dim 3072 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute cudnn flash_attn_4 --rounds 3 \
    --out-dir "$OUT/bench_d96"
  exit
fi
# 3: call 2: hdim 96 ran 1.26-1.30x cuDNN forward+backward, 0.95-1.02x flash-attn-4 (deterministic 1.00-1.17x), but
#    11 of its 28 tests failed, all on dense fresh gradients: dV wrong (rel. error 1.27), dQ and dK right. Those go
#    out through TMA stores from one staging tile laid out as K (32-byte swizzle at hdim 96) while dV's TMA atom was
#    built on V's layout (64-byte): V now takes K's layout (the hdim 64 / 128 PTX is byte-identical). The same tests.
if [ "$1" = 3 ]; then
  TAIL_LINES=6 stage tests_bwd96 240 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_backends_gpu.py \
    -k "96 or case7 or case8 or (test_dense and case6)"
  exit
fi
# 4: call 3 passed the 28 hdim-96 tests. Now (a) the context-parallel GPU tests at hdim 96 (the ring's work lists,
#    and cp_invariant's bytes across layouts, which also run the int64 dQ at hdim 96) and the staged-rank suite;
#    (b) the hdim-96 bench again after the fix (V on K's 32-byte atoms now; call 2 ran V on 64-byte ones).
if [ "$1" = 4 ]; then
  TAIL_LINES=6 stage tests_cp 240 $PYTEST -n 8 tests/cp/test_cp_gpu.py
  TAIL_LINES=14 stage bench_d96 150 python3 bench/kernels.py --headdims 96 --model-dim 3072 --seqlens 4096 16384 \
    --causal false true --directions bwd --backends cute cudnn flash_attn_4 --rounds 5 --out-dir "$OUT/bench_d96"
  exit
fi
# 5: the forward at hdim 256 (Gemma 2 / 3; before, SDPA, or the reference when soft-capped): 128 x 64 tiles, two
#    K / V stages, O through Q's buffer (one CTA per tile: the persistent grid's own O tile does not fit), the merge
#    epilogue reading the running rows one at a time (all of them beside acc_O spilled). (a) its GPU tests (dense,
#    packed, merging, Gemma 2's window and cap, sinks, "auto" taking the backward elsewhere) and the hdim-96
#    cp_invariant case with its corrected heads; (b) the bench at Gemma-2-9B's width (16 heads of 256) beside
#    cuDNN and flash-attn-4, and the persistent grid with direct O stores as a variant. Prediction: correct;
#    500-600 TFLOP/s at 4k-16k (more GEMM per exponential than hdim 128), 0.9-1.0x flash-attn-4 (its own tiles).
if [ "$1" = 5 ]; then
  TAIL_LINES=6 stage tests_256 200 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_window_gpu.py \
    -k "256"
  TAIL_LINES=4 stage tests_inv96 150 $PYTEST tests/cp/test_cp_gpu.py -k "invariant and 96"
  TAIL_LINES=14 stage bench_d256 200 python3 bench/kernels.py --headdims 256 --model-dim 4096 \
    --seqlens 1024 4096 16384 --causal false true --directions fwd --backends cute cudnn flash_attn_4 --rounds 3 \
    --out-dir "$OUT/bench_d256" --cute-variants "fwd:persistent_ctas=132,tma_store_o=0"
  exit
fi
# 6: host-side changes of the session's helpers that the GPU paths run: a guard against two threads' calls on one
#    process group (per call: forward, refusal, backward), pickling refused with a clear error, the registry's and
#    the SDPA backend's new checks, the merges' checks. The staged-rank CP suite (the backends' GPU suite ran in
#    the helper's own call: 53 passed).
if [ "$1" = 6 ]; then
  TAIL_LINES=4 stage tests_cp 180 $PYTEST -n 8 tests/cp/test_cp_gpu.py
  exit
fi
# 7: the ring's work lists at hdim 256 (the work-list forward's merges, by row at hdim 256) against the per-item loop.
if [ "$1" = 7 ]; then
  TAIL_LINES=6 stage tests_worklist256 150 $PYTEST -n 4 tests/kernels/test_worklist_gpu.py -k "ring_schedule and 256"
  exit
fi
