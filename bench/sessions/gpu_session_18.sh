#!/usr/bin/env bash
# Prepared in the seventeenth session for the next one (NOTES_FWD.md, seventeenth session: where flash-attn-4's
# forward warps wait instead). Two calls:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_18.sh 1   # chained_max: bits, A/B
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_18.sh 2   # permuted_vectors: suite, A/B
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 8   # SASS samples, causal 4k bwd
# 1: FwdConfig.chained_max, the row max as flash-attn-4 takes it (max.f32 in four interleaved linear chains
#    instead of the TensorSSA reduce's max.NaN.f32 tree). On the CPU (bench/sass_softmax.py --set chained_max=true)
#    the hdim-128 step keeps its 450 instructions and its PV wait moves from the 12th exp2 to the 15th (causal:
#    11th -> 13th); hdim 64 unchanged in count. Nsight Compute had our warps losing +6.1k dispatch / +4.7k
#    not_selected samples on FMNMX and +6.9k wait on MUFU against flash-attn-4. Prediction: +0-2% on the hdim-128
#    forward at 4k-32k; a loss means the max's form is not where the softmax's stalls come from.
# 2: BwdConfig.permuted_vectors, the lse2 / dPsum vectors stored permuted per query tile by the preprocess and read
#    four columns per 16-byte load (Nsight Compute, seventeenth session: at hdim 64 our backward executes 8x
#    flash-attn-4's shared loads, 32 LDS.64 per step; long / short scoreboard and MIO stalls 2-3x theirs). On the
#    CPU: 521 -> 505 instructions per step at hdim 64 (causal 516 -> 501), hdim 128 causal 352 -> 344; the
#    hdim-64 causal kernel of one CTA per tile spills 8 bytes instead of 4 (outside the loop). Prediction: hdim 64
#    backward +1-3%, hdim 128 within noise. First every backward variant's GPU tests under the override (a wrong
#    permutation anywhere shows there), then the A/B.
#    Run twice in the eighteenth session: first -10 to -15% at hdim 64 (call 3's counters: 16-way bank conflicts
#    on the 16-byte loads), then again after row_vector_layout interleaved a quad's groups (one wavefront per
#    quarter warp); the counters stage checks that. Neutral then: the knob was removed after this session, so
#    calls 2 and 3 run only on the commits that had it (584192f .. the layout fix).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s18 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
# `vector_counters FORM`: Nsight Compute's counters of every kernel of one hdim-64 4k backward call under
# FA4DIST_BWD_OVERRIDE=FORM ("default": none): bank conflicts, shared wavefronts, instructions, stalls.
vector_counters() {
  local ncu metrics=gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  metrics=$metrics,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
  metrics=$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__sass_inst_executed_op_shared_ld.sum
  metrics=$metrics,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  metrics=$metrics,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
  metrics=$metrics,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio
  TAIL_LINES=40 FA4DIST_BWD_OVERRIDE=${1/default/} stage "counters_${1%%=*}" 120 "$ncu" \
    --profile-from-start off --clock-control none --metrics "$metrics" \
    python3 bench/ncu_kernels.py --cases bwd:64:4096:full --backends cute
}
PYTEST="python3 -m pytest -x -q -p no:cacheprovider -rfE"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session18
  TAIL_LINES=4 stage bits 100 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py -k "schedule_fields and chained_max"
  TAIL_LINES=24 stage ab 240 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 32768 \
    --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:chained_max=true \
    --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/chained-max-ab.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 2 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session18
  TAIL_LINES=4 stage bits 100 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py -k "step_forms and permuted"
  FA4DIST_BWD_OVERRIDE=permuted_vectors=1 TAIL_LINES=6 stage suite 300 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py \
    tests/kernels/test_cute_nonfinite_gpu.py -k "not test_step_forms"
  vector_counters permuted_vectors=1
  TAIL_LINES=30 stage ab 240 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 \
    --causal false true --directions bwd --deterministic --backends cute flash_attn_4 \
    --cute-variants bwd:permuted_vectors=true --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/permuted-vectors-ab.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 3 ]; then
  # call 2 refuted permuted_vectors (hdim 64 backward -10 to -15% for 16 fewer instructions per step): where the
  # time went. Counters of the default and the knob's launches (bank conflicts, shared wavefronts, instructions,
  # every kernel of the call: preprocess, main, postprocess), then the SASS-level samples of both main kernels.
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session18
  for form in default permuted_vectors=1; do vector_counters "$form"; done
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for form in default permuted_vectors=1; do
    TAIL_LINES=2 FA4DIST_BWD_OVERRIDE=${form/default/} stage "sass_${form%%=*}" 120 "$ncu" --profile-from-start off \
      --clock-control none --section SourceCounters --section WarpStateStats --import-source no \
      -k regex:FlashBwdSm90 --launch-count 1 --export "/tmp/src_${form%%=*}" -f \
      python3 bench/ncu_kernels.py --cases bwd:64:4096:full --backends cute
    "$ncu" --import "/tmp/src_${form%%=*}.ncu-rep" --page source --csv --print-source sass 2>&1 \
      | gzip > "$OUT/sass_${form%%=*}.csv.gz"
  done
  python3 bench/ncu_summary.py compare "$OUT/sass_permuted_vectors.csv.gz" "$OUT/sass_default.csv.gz" \
    > "$OUT/ncu_compare.txt"
  head -60 "$OUT/ncu_compare.txt"
  exit
fi
if [ "$1" = 4 ]; then
  # call 5 (gpu_session_17.sh 8): at hdim 128 causal 4k the step's first P FFMAs wait ~10k samples on the lse2
  # shared load (short scoreboard; flash-attn-4's whole kernel 5.4k). early_vectors lost 2% there in the
  # fourteenth session, before the persistent grid reached 4k-8k: again, causal non-deterministic. And call 1's
  # chained_max gains at hdim 128 non-causal 16k / 32k (+1.1 / +1.6%) once more.
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session18
  TAIL_LINES=12 stage early 240 python3 bench/kernels.py --headdims 128 --seqlens 1024 4096 8192 16384 \
    --causal true --directions bwd --backends cute flash_attn_4 --cute-variants bwd:early_vectors=true \
    --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/early-vectors-causal.json" 2>/dev/null
  TAIL_LINES=10 stage chained 150 python3 bench/kernels.py --headdims 128 --seqlens 8192 16384 32768 \
    --causal false --directions fwd --backends cute flash_attn_4 --cute-variants fwd:chained_max=true \
    --rounds 7 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/chained-max-nc.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 5 ]; then
  # chained_max a third time, wider: non-causal 16k / 32k gained in calls 1 and 4; the causal and hdim-64 shapes
  # were mixed in call 1 (-1.6% causal 32k hdim 128).
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session18
  TAIL_LINES=16 stage chained 300 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 32768 \
    --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:chained_max=true \
    --rounds 7 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/chained-max-wide.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 6 ]; then
  # after chained_max became the default for dense non-causal hdim-128 launches of 8k+ keys: the default path
  # against flash-attn-4 (the compile log shows which configs the calls built)
  TAIL_LINES=10 stage default 200 python3 bench/kernels.py --headdims 128 --seqlens 4096 8192 32768 \
    --causal false --directions fwd --backends cute flash_attn_4 --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/chained-default.json" 2>/dev/null
  grep -c "chained_max=True" "$FA4DIST_CUTE_COMPILE_LOG"
  rm -f "$OUT"/*.png
  exit
fi
