#!/usr/bin/env bash
# Prepared in the twenty-eighth session (2026-12-03), results in bench/results/2026-12-03-twenty-eighth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_29.sh 1     (flash-attn-4 carried: --with-fa4)
# 1: (a) the dense forward's GPU tests at hdim 64 under the defaults: short causal launches (<= 1024 rows) now take
#    two 64-row CTAs per SM by default (forward.short_two_ctas), measured so far only as an override.
#    (b) the two-CTA short causal forward's remaining knobs at hdim 64, 512 / 1k rows, beside cuDNN (0.93x at 1k)
#    and flash-attn-4. Counted: a CTA holds Q 8 KB, K / V 2 x 32 KB per stage pair, O's staging 8 KB; a third
#    stage fits only without O's TMA staging (115.7 KB a CTA at two per SM). Predictions: num_stages=3 0-3% (the
#    other CTA already covers the loads), tile_n=64 -5..+3% (5.5% fewer masked scores on the diagonal, twice the
#    steps), interleave_lengths / late_pv_wait / sum_from_old within +-2%.
#    (c) the deterministic hdim-64 causal 1k backward (0.87x flash-attn-4's deterministic in the nineteenth
#    session's table) on its other orders / grids. (d) windows, sinks, softcap at 32k beside flash-attn-4.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s29 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=4 stage tests_fwd_d64 150 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py -k "64"
  TAIL_LINES=22 stage fwd_short_knobs 200 python3 bench/kernels.py --headdims 64 --seqlens 512 1024 --causal true \
    --directions fwd --backends cute cudnn flash_attn_4 --rounds 5 --out-dir "$OUT/short" --cute-variants \
    "fwd:num_stages=3,tma_store_o=0" "fwd:tma_store_o=0" "fwd:tile_n=64,num_stages=3" "fwd:tile_n=64,num_stages=4" \
    "fwd:tile_n=96,num_stages=3" "fwd:interleave_lengths=1" "fwd:late_pv_wait=1" "fwd:sum_from_old=0"
  TAIL_LINES=10 stage bwd_det_short 120 python3 bench/kernels.py --headdims 64 --seqlens 1024 --causal true \
    --directions bwd --deterministic --backends cute flash_attn_4 --rounds 5 --out-dir "$OUT/det" \
    --cute-variants "bwd-det:det_resident=1" "bwd-det:persistent_ctas=0"
  TAIL_LINES=16 stage window 150 python3 bench/window.py --rounds 3 --out-dir "$OUT/window"
  exit
fi
# 2: the whole table under today's defaults (the nineteenth session's was the last): hdim 128 / 64, 1k / 4k / 16k,
#    causal or not, forward, backward, deterministic backward, cuDNN and flash-attn-4 in the same rounds.
if [ "$1" = 2 ]; then
  TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set table
  TAIL_LINES=40 stage table 380 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute sdpa_cudnn flash_attn_4 --rounds 3 \
    --out-dir "$OUT/table"
  exit
fi
# 3: calls 1-2: the dense short causal forward's knobs change nothing at 1k (tile_n=64 +4% at 512 only), and the
#    table's remaining gaps are within the machine's spread. Packed short documents (the issue's "short documents in
#    packed batches") still take 192-row tiles at hdim 64: 205 / 278 TFLOP/s at 512 / 1024-token documents (ninth
#    session) against 226 / 306 for the dense two-CTA forward now. Prediction: two 64-row CTAs per SM on packed
#    launches +8-15% at 512 / 1024-token documents, a loss at 2048 (as dense). hdim 128: two 64-row CTAs need
#    64-key tiles to fit (96 KB a CTA): a first look at dense 512 / 1k / 2k and packed 512 / 1024.
if [ "$1" = 3 ]; then
  FA4DIST_FWD_OVERRIDE=tile_m=64,ctas_per_sm=2 TAIL_LINES=4 stage tests_packed_two_ctas 100 $PYTEST -n 8 \
    tests/kernels/test_cute_fwd_gpu.py -k "test_varlen and 64"
  TAIL_LINES=12 stage packed_d64 150 python3 bench/packed_tiles.py --headdim 64 --doclen 512 1024 2048 --rounds 5 \
    --variants "tile_m=64,ctas_per_sm=2" "tile_m=128"
  TAIL_LINES=8 stage packed_d64_mixed 60 python3 bench/packed_tiles.py --headdim 64 --doclen 512 --mixed --rounds 5 \
    --variants "tile_m=64,ctas_per_sm=2" "tile_m=128"
  TAIL_LINES=8 stage packed_d128 80 python3 bench/packed_tiles.py --headdim 128 --doclen 512 1024 --rounds 5 \
    --variants "tile_m=64,ctas_per_sm=2,tile_n=64"
  TAIL_LINES=10 stage dense_d128_two_ctas 100 python3 bench/kernels.py --headdims 128 --seqlens 512 1024 2048 \
    --causal true --directions fwd --backends cute cudnn flash_attn_4 --rounds 5 --out-dir "$OUT/d128" \
    --cute-variants "fwd:tile_m=64,ctas_per_sm=2,tile_n=64"
  exit
fi
# 4: call 3: two 64-row CTAs per SM on packed hdim-64 causal launches: +4.7 / +7.9% at 512 / 1024-token documents,
#    +5.8% mixed (124-1017), -13% at 2048; at hdim 128 (64-key tiles to fit) -3 to -11%, dropped. Now the default for
#    packed documents of at most 1024 rows (forward.short_documents). The forward's GPU suites under the new default,
#    then packed_tiles again (the default row should now read the call-3 two-CTA row; 192-row tiles forced beside
#    it), and 64-key tiles with three stages for documents / sequences of at most 512 rows (call 1: +4% at 512
#    dense, -2% at 1k). Prediction: default +5-8% over tile_m=192 at <= 1024, equal at 2048; tile_n=64 +2-5% at
#    256 / 512.
if [ "$1" = 4 ]; then
  # (and the new compile cache on disk: a second process loads what the first compiled; the suites' workers share
  # one cache folder, so concurrent writes of one variant meet there)
  TAIL_LINES=4 stage tests_cache 120 $PYTEST tests/kernels/test_cute_compile_cache_gpu.py
  TAIL_LINES=4 stage tests_fwd 200 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_nonfinite_gpu.py
  TAIL_LINES=4 stage tests_packed_other 120 $PYTEST -n 8 tests/kernels/test_worklist_gpu.py tests/kernels/test_window_gpu.py \
    -k "packed or varlen"
  TAIL_LINES=8 stage packed_d64_default 100 python3 bench/packed_tiles.py --headdim 64 --doclen 256 512 1024 2048 \
    --rounds 5 --variants "tile_m=192,ctas_per_sm=1" "tile_n=64,num_stages=3"
  TAIL_LINES=8 stage dense_d64_short_n64 80 python3 bench/kernels.py --headdims 64 --seqlens 256 512 768 \
    --causal true --directions fwd --backends cute cudnn --rounds 5 --out-dir "$OUT/dense_n64" \
    --cute-variants "fwd:tile_n=64,num_stages=3"
  exit
fi
# 5: call 4 showed bench/timing.cuda_median_ms timing from an idle device: a call's time includes the host's work
#    before its launch, so a row run with overrides (make_config on every call) read 6% slower than the same kernel
#    through the default path at 2048-token documents (365 against 388 TFLOP/s, bytes equal), and flash-attn-4's
#    rows carry its Python overhead. cuda_median_ms(queue_ahead_ms=) now queues each call behind a device spin:
#    device time alone. Again with it: packed documents (the two-CTA default against 192-row tiles forced, and
#    flash-attn-4), the packed backward, and windows / sinks / softcap at 32k. Prediction: the two-CTA gain between
#    call 3's +5-8% and call 4's +25-32%; ratios against flash-attn-4 lower at short documents than from idle.
#    And 64-key tiles with three stages at <= 512 rows (dense +30% / +5% at 256 / 512 in call 4).
if [ "$1" = 5 ]; then
  TAIL_LINES=8 stage packed_d64_queued 100 python3 bench/packed_tiles.py --headdim 64 --doclen 256 512 1024 2048 \
    --rounds 5 --queue-ahead-ms 3 --variants "tile_m=192,ctas_per_sm=1" "tile_n=64,num_stages=3"
  TAIL_LINES=6 stage dense_d64_tiny 60 python3 bench/kernels.py --headdims 64 --seqlens 256 512 --causal true \
    --directions fwd --backends cute cudnn --rounds 5 --out-dir "$OUT/dense_tiny" --cute-variants "fwd:tile_n=64,num_stages=3"
  TAIL_LINES=6 stage packed_d64_bwd_queued 100 python3 bench/packed_tiles.py --headdim 64 --doclen 512 1024 \
    --direction bwd --rounds 5 --queue-ahead-ms 3
  TAIL_LINES=8 stage window_queued 150 python3 bench/window.py --rounds 3 --queue-ahead-ms 5 --out-dir "$OUT/window"
  exit
fi
# 6: call 5 (device time): the two-CTA packed default +54 / +12.5 / +14% over 192-row tiles at 256 / 512 / 1024-token
#    documents, equal at 2048 (410 both: the idle-device bias is gone); 64-key tiles in three stages on top +5 / +1.5 /
#    -3% packed, +8 / +4% dense at 256 / 512. Now the default at <= 512 rows (forward.tiny_tiles): its GPU tests
#    (new dense and packed cases of <= 512 rows) against the oracle.
if [ "$1" = 6 ]; then
  TAIL_LINES=4 stage tests_tiny 120 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py -k "(test_dense or test_varlen) and 64"
  exit
fi
