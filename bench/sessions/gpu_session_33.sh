#!/usr/bin/env bash
# Prepared in the thirty-second session (2026-12-04), results in bench/results/2026-12-04-thirty-second-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_33.sh 1    (flash-attn-4 carried: --with-fa4)
# 1: the sliding window at 32k (W = 4096, #15's target: forward and forward+backward >= 1.0x flash-attn-4; last
#    measured 0.94-1.05 / 0.95-0.98). A windowed tile is mostly full key blocks, as a long non-causal one, yet two
#    knobs measured faster there are off for windows by default: the chained row max in the forward (+1-2% at
#    hdim-128 non-causal 16k / 32k, eighteenth session) and the early lse2 / dPsum reads in the backward (+0-4%
#    non-causal, fourteenth session; off for causal non-deterministic, where it lost 2% at 4k). Both give the same
#    bits. Prediction: each +0-2% on its direction's window row; the causal row within noise.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s33 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
WIN="python3 bench/window.py --rounds 5 --queue-ahead-ms 5"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=14 stage window_default 150 $WIN --out-dir "$OUT/window_default"
  TAIL_LINES=14 stage window_chained 150 env FA4DIST_FWD_OVERRIDE=chained_max=1 $WIN --out-dir "$OUT/window_chained"
  TAIL_LINES=14 stage window_early 150 env FA4DIST_BWD_OVERRIDE=early_vectors=1 $WIN --out-dir "$OUT/window_early"
  exit
fi
# 2: call 1 (bench/RESULTS.md, thirty-second session): neither knob moves the window rows. Now the last partial
#    wave split over its tiles' key blocks (FwdConfig.split_tail, forward.split_plan; dense non-causal fresh
#    launches on the dynamic grid): the bench's hdim-128 shapes have 15.52 waves of 128-row tiles (68 tail tiles on
#    132 SMs, split in 3 at 4k and 5 at 16k), hdim 64's 21.3 / 20.8 waves of 192-row tiles (44 tail tiles in 3 at
#    4k; 112 at 16k: no split). (a) the forward GPU tests (the split tiles against the oracle, the unsplit launch's
#    bytes elsewhere, run-to-run bytes, NaN rows; the dense, persistent and schedule-field suites) and the window /
#    sinks suite with this session's sink change; (b) the non-causal forward with the split and without it
#    (fwd:split_tail=0) beside flash-attn-4 in the same rounds. Prediction: +1-2% at hdim 128 4k / 16k and hdim 64
#    4k, nothing at hdim 64 16k (no split there).
if [ "$1" = 2 ]; then
  TAIL_LINES=6 stage tests_fwd 200 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py \
    -k "split or dense or persistent or schedule or accumulate"
  TAIL_LINES=10 stage bench_split 170 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 --causal false \
    --directions fwd --backends cute flash_attn_4 --cute-variants fwd:split_tail=0 --rounds 7 --out-dir "$OUT/bench_split"
  TAIL_LINES=6 stage tests_window 190 $PYTEST -n 8 tests/kernels/test_window_gpu.py -k "sink or softcap"
  exit
fi
# 3: the session's host-side changes that the GPU paths run: non-finite sinks merged as a non-finite score
#    (kernels/merge.py), the cu_seqlens caches, the thread guard on the loss exchanges, the cp = 1 plan's segments;
#    every backend through the contract, the non-finite suites, the staged-rank CP suite.
if [ "$1" = 3 ]; then
  TAIL_LINES=6 stage tests_backends 220 $PYTEST -n 8 tests/kernels/test_backends_gpu.py tests/kernels/test_nonfinite.py \
    tests/kernels/test_cute_nonfinite_gpu.py tests/integrations/test_hf_integration.py
  TAIL_LINES=6 stage tests_cp 160 $PYTEST -n 8 tests/cp/test_cp_gpu.py
  TAIL_LINES=6 stage tests_window_rest 150 $PYTEST -n 8 tests/kernels/test_window_gpu.py -k "not sink and not softcap"
  exit
fi
# 4: call 2: the split measured -0.9 / -0.6% at hdim 128 4k / 16k (the bench's 0.52-wave tails), +1.2% at hdim 64
#    4k, against the same kernel unsplit in the same rounds (prediction +1-2%: wrong at hdim 128). Whether the
#    mechanism pays where the tail is most of the launch: shapes of 1.2-1.5 waves (one head group per GPU, as under
#    tensor parallelism), hdim 128 at 4k and 8k (160 and 192 tiles: the plan splits 28 tiles in 4, 60 in 2) and
#    hdim 64 at 4k (198 tiles of 192 rows, 66 in 2). Prediction: +20-30% there if the parts and merge cost what the
#    model says; near 0 if a partial wave is cheap on this GPU (the idle SMs' power raising the others' clock).
if [ "$1" = 4 ]; then
  K="python3 bench/kernels.py --causal false --directions fwd --backends cute flash_attn_4 --cute-variants fwd:split_tail=0 --rounds 7"
  TAIL_LINES=6 stage few_waves_128 100 $K --headdims 128 --seqlens 4096 --total-tokens 4096 --model-dim 640 \
    --out-dir "$OUT/few_waves_128"
  TAIL_LINES=6 stage few_waves_128_8k 100 $K --headdims 128 --seqlens 8192 --total-tokens 8192 --model-dim 384 \
    --out-dir "$OUT/few_waves_128_8k"
  TAIL_LINES=6 stage few_waves_64 100 $K --headdims 64 --seqlens 4096 --total-tokens 4096 --model-dim 576 \
    --out-dir "$OUT/few_waves_64"
  exit
fi
# 5: call 3: on 1.2-1.5-wave shapes the split read +17% (hdim 128, 8k, 192 tiles, 60 split in 2) and +12% (hdim 64,
#    4k, 198 tiles, 66 in 2), but -40% at hdim 128 4k with 5 heads (160 tiles, 28 in 4: 223 against 368
#    TFLOP/s), where every row is host-bound (flash-attn-4 277). Device time against time from an idle device
#    (bench/split_tail.py), hdim 128 and 64, the bench shapes and the few-wave ones. Prediction: in device time
#    the 160-tile case gains as the model says (~+30%) and its loss is the host's (the scratch allocations and the
#    zeroed counters: ~20 us on a ~120 us call).
if [ "$1" = 5 ]; then
  TAIL_LINES=8 stage split_128 150 python3 bench/split_tail.py --headdim 128 --shapes 1x4096x5 1x8192x3 4x4096x16 \
    1x16384x16 --rounds 3 --out-dir "$OUT/split_128"
  TAIL_LINES=8 stage split_64 120 python3 bench/split_tail.py --headdim 64 --shapes 1x4096x9 4x4096x32 1x16384x32 \
    --rounds 3 --out-dir "$OUT/split_64"
  exit
fi
# 6: call 5 (device time): +29% / +20% / +20% on 1.2-1.5-wave shapes (hdim 128 160 and 192 tiles, hdim 64 198),
#    as predicted, but -1.2 / -0.4% on the bench's 15.5-wave hdim-128 shapes (predicted +1-2%) and +2.1% on hdim
#    64's 21.3 waves. So the gain fades with the whole waves before the tail (dynamic claims spread the CTAs'
#    finish times, so a late tail is already partly covered). Between: 3.4, 6.3 and 9.5 waves at hdim 128 4k
#    (448, 832, 1248 tiles; splits of 52 in 2, 40 in 3, 60 in 2), to choose how many whole waves the split may
#    follow. Then stage 3's suites on this session's host changes.
if [ "$1" = 6 ]; then
  TAIL_LINES=7 stage split_waves 120 python3 bench/split_tail.py --headdim 128 --shapes 1x4096x14 2x4096x13 3x4096x13 \
    --rounds 3 --out-dir "$OUT/split_waves"
  bash "$0" 3
  exit
fi
# 7: a non-deterministic GQA backward's CTAs are (key tile, kv head) pairs, each walking its group of query heads:
#    with one kv head (tensor parallelism: 4 query heads and 1 kv head per GPU) a 4k-16k call has 32-128 CTAs on
#    132 SMs. backward.nondeterministic_gqa_form expands K / V per query head where the rounds of one-head CTAs
#    (plus the copies and the group sum) come to at most 0.8 of the GQA launch's. (a) its GPU test (auto against
#    the explicit forms, dense / packed, causal or not, fresh and accumulating); (b) fwd+bwd with each form forced,
#    through the kernel entry points, beside flash-attn-4, batch 1. Prediction: the backward expanded 1.5-2.5x the
#    GQA form at 4k / 8k (32 / 64 CTAs: 1 / 2 rounds of one head against 4; the rule expands), the same at 16k
#    (128 CTAs: 4 rounds either way; the rule keeps the GQA kernel).
if [ "$1" = 7 ]; then
  TAIL_LINES=6 stage tests_gqa 150 $PYTEST -n 4 tests/kernels/test_cute_bwd_gpu.py -k "few_kv_tiles or expanded_heads"
  TAIL_LINES=12 stage bench_gqa 180 python3 bench/kernels.py --headdims 128 --seqlens 4096 8192 16384 \
    --total-tokens 4096 --model-dim 512 --kv-group 4 --causal false true --directions bwd --backends cute flash_attn_4 \
    --cute-variants bwd:gqa_form=gqa bwd:gqa_form=expanded --rounds 5 --out-dir "$OUT/bench_gqa"
  exit
fi
# 8: call 7's rule counted rounds and kept causal 16k on the GQA form (1.58x slower); the time model now expands
#    it. (a) the same GQA bench without variants (the contract's default at one kv head), prediction: causal 16k
#    ~540 TFLOP/s (was 348), the rest as the expanded column; (b) the causal forward on few-wave shapes (4 heads,
#    batch 1, 4k-16k: 128-512 tiles whose longest, n blocks, exceed the average per SM), beside flash-attn-4 and
#    cuDNN: the lead for splitting the longest causal tiles (not built). Prediction: ours 0.9-1.0x flash-attn-4
#    (both bound by the longest tiles).
if [ "$1" = 8 ]; then
  TAIL_LINES=10 stage bench_gqa_default 120 python3 bench/kernels.py --headdims 128 --seqlens 4096 8192 16384 \
    --total-tokens 4096 --model-dim 512 --kv-group 4 --causal false true --directions bwd --backends cute flash_attn_4 \
    --rounds 5 --out-dir "$OUT/bench_gqa_default"
  TAIL_LINES=8 stage bench_causal_few 120 python3 bench/kernels.py --headdims 128 --seqlens 4096 8192 16384 \
    --total-tokens 4096 --model-dim 512 --causal true --directions fwd --backends cute cudnn flash_attn_4 --rounds 5 \
    --out-dir "$OUT/bench_causal_few"
  exit
fi
