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
