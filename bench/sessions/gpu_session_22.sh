#!/usr/bin/env bash
# Prepared in the twenty-first session (2026-12-03), results in bench/results/2026-12-03-twenty-first-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_22.sh 1   # int64 dQ probes, merge samples
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_22.sh 2   # int64 dQ samples
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_22.sh 3|4 # forms, dq_pair: 3 ran on a working
#     state with fixed_convert_first (never committed), 4 on f04cf4e (dq_pair, removed since)
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_22.sh 5   # the early scales, five rounds
# 1: two diagnostics.
#    a) Where the int64 fixed-point dQ's cost goes (cp_invariant's backward kernel is 1.19-1.27x the fp32 dQ one):
#       the conversion (F2I.S64, 16 / clk / SM like the exp2s) against the doubled smem and L2 reduce bytes, by
#       timing probes that remove one or the other. The probes were a temporary patch, not committed (wrong dq by
#       design): a BwdConfig field dq_fixed_probe = "bitcast" (the scaled fp32 tile's bits sign-extended to int64
#       instead of F2I.S64), "half" (the writer's bulk reduce given half the chunk's bytes) or "both", timed by a
#       script (probe_int64.py) calling backward.backward(..., dq_scale=) per form after backward.set_override.
#       Prediction: half the bytes recovers most of it (the bulk reduce's smem read gates the dQ buffer's reuse).
#    b) Where the 4k causal merge's ~49 us go (+9.6% over the plain forward on the same one-CTA grid, against
#       +2.1% non-causal): Nsight Compute's SASS samples of the merge beside the plain one-CTA forward, causal and
#       not (bench/ncu_kernels.py merge / fwd1 cases; bench/ncu_summary.py compare).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
ncu_pair() {  # ncu_pair NAME KERNEL_REGEX CASE_A CASE_B: SASS samples of our kernel in two cases, compared
  local name=$1 kernel=$2 ncu c
  shift
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for c in "$2" "$3"; do
    TAIL_LINES=2 stage "ncu_${c//:/_}" 150 "$ncu" --profile-from-start off --clock-control none \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables \
      --import-source no -k regex:$kernel --launch-count 1 --export "/tmp/src_${c//:/_}" -f \
      python3 bench/ncu_kernels.py --cases "$c" --backends cute
    "$ncu" --import "/tmp/src_${c//:/_}.ncu-rep" --page source --csv --print-source sass 2>&1 \
      | gzip > "$OUT/sass_${c//:/_}.csv.gz"
    "$ncu" --import "/tmp/src_${c//:/_}.ncu-rep" --page details > "$OUT/details_${c//:/_}.txt" 2>&1
  done
  python3 bench/ncu_summary.py compare "$OUT/sass_${2//:/_}.csv.gz" "$OUT/sass_${3//:/_}.csv.gz" \
    > "$OUT/ncu_compare_$name.txt"
  head -45 "$OUT/ncu_compare_$name.txt"
}
if [ "${1:-1}" = 1 ]; then
  # (the probe stage: `python3 bench/sessions/probe_int64.py`, with the patch above; removed with it)
  ncu_pair merge_causal FlashFwdSm90 merge:128:4096:causal fwd1:128:4096:causal
  ncu_pair merge_full FlashFwdSm90 merge:128:4096:full fwd1:128:4096:full
  grep -h -E "Duration|DRAM Throughput|L2 Cache Throughput|Memory Throughput" "$OUT"/details_*.txt | head -24
  rm -f "$OUT"/*.png
  exit
fi
# 2: the int64 dQ's remaining cost. Call 1's probes (32k causal / 16k non-causal, hdim 128): int64 1.30 / 1.45x the
#    fp32 dQ kernel; without the F2I.S64 conversion 1.24 / 1.31x, with half the reduce bytes 1.20 / 1.42x, both
#    1.16 / 1.25x. So ~16-25% is neither: SASS samples of the int64 kernel beside the fp32 one (16k non-causal) say
#    where (the int64 smem stores and their bank pattern, the rows' scales, the DQ_EMPTY wait, registers).
if [ "$1" = 2 ]; then
  ncu_pair fixed_full FlashBwdSm90 bwdfixed:128:16384:full bwdacc:128:16384:full
  grep -h -E "Duration|Shared|Bank" "$OUT"/details_*.txt | head -30
  exit
fi
# 3: after 2's samples (the first scaling multiply waiting on the rows' scale loads: 5% of the int64 kernel's
#    samples; F2I 10%, behind the buffer's empty barrier), two knobs, both default on: fixed_scales_early (the scales
#    loaded at the start of the step, 64-row tiles) and fixed_convert_first (the tile converted before the empty
#    barrier); and dq_pair (default off): clusters of two CTAs whose shared query tiles' int64 tiles are summed in
#    shared memory and added to global memory once (half the reduce bytes of the "half" probe). Bits first (every
#    form against both knobs off; the cp_invariant layouts with the pairs on), then the int64 kernel rows.
#    Predictions: each knob -3..-6% of the int64 kernel at hdim 128 (hdim 64 only converts first: ~-2%); dq_pair
#    -5..-8% at 32k causal (the probe's half-bytes row: -8%), whole cp_invariant step -3..-5% with it.
if [ "$1" = 3 ]; then
  # the forms' bits first, on a short limit: a pair protocol that hangs must not eat the call
  TAIL_LINES=4 stage tests_forms 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 \
    tests/kernels/test_cute_bwd_gpu.py -k "fixed_point_dq_forms"
  PAIR=dq_pair=1
  grep -q " passed" "$OUT/tests_forms.log" && ! grep -q "failed" "$OUT/tests_forms.log" || PAIR=
  TAIL_LINES=4 stage tests 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/kernels/test_cute_bwd_gpu.py \
    -k "fixed_point and not forms"
  TAIL_LINES=14 stage fixed_128 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 --headdim 128 \
    --reps 5 --rounds 3 --fixed-variants fixed_scales_early=0 fixed_convert_first=0 \
    fixed_scales_early=0,fixed_convert_first=0 $PAIR --out-dir "$OUT"
  mv "$OUT/$(date +%F)-invariant.json" "$OUT/invariant-fixed-forms-d128.json"
  TAIL_LINES=4 stage tests_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py -k invariant
  [ -n "$PAIR" ] || exit
  FA4DIST_BWD_OVERRIDE=dq_pair=1 TAIL_LINES=10 stage invariant_pair 200 python3 bench/invariant.py --tokens 32768 \
    --heads 32:32 --reps 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-invariant.json" "$OUT/invariant-pair.json"
  FA4DIST_BWD_OVERRIDE=dq_pair=1 TAIL_LINES=4 stage tests_cp_pair 200 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/cp/test_cp_gpu.py -k invariant
  TAIL_LINES=14 stage fixed_64 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 --headdim 64 \
    --reps 5 --rounds 2 --fixed-variants fixed_scales_early=0,fixed_convert_first=0 dq_pair=1 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-invariant.json" "$OUT/invariant-fixed-forms-d64.json"
  exit
fi
# 4: after 3: converting before the empty barrier measured +8% beside the early scales (removed); the early scales
#    alone -8% (default). dq_pair's first form was right (bits) but 2.3x slower: its writer waited on the other CTA
#    half by half with a cluster fence after each wait, ~5 us of handshakes per step against ~2.4 us of step. Now
#    both halves are offered before either is waited for, and the waits acquire at cluster scope instead of the
#    fence. Prediction: dq_pair within +-5% of the default (the handshake still serializes the even CTA's writer);
#    a gain needs it below the step time.
if [ "$1" = 4 ]; then
  TAIL_LINES=4 stage tests_forms 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 \
    tests/kernels/test_cute_bwd_gpu.py -k "fixed_point"
  PAIR=dq_pair=1
  grep -q " passed" "$OUT/tests_forms.log" && ! grep -q "failed" "$OUT/tests_forms.log" || PAIR=
  TAIL_LINES=14 stage fixed_128 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 --headdim 128 \
    --reps 5 --rounds 3 --fixed-variants fixed_scales_early=0 $PAIR --out-dir "$OUT"
  mv "$OUT/$(date +%F)-invariant.json" "$OUT/invariant-fixed-forms-d128-4.json"
  exit
fi
# 5: call 3 measured the early scales -8% on the int64 kernel, call 4 +2.7%: five interleaved rounds at hdim 128,
#    and at hdim 64, where the knob changes nothing (128-row tiles keep the late loads): the two hdim-64 rows are
#    the same kernel, so their gap is this run's noise.
if [ "$1" = 5 ]; then
  for d in 128 64; do
    TAIL_LINES=12 stage "fixed_$d" 240 python3 bench/invariant.py --tokens 32768 --heads 32:32 --headdim $d \
      --reps 5 --rounds 5 --fixed-variants fixed_scales_early=0 --out-dir "$OUT"
    mv "$OUT/$(date +%F)-invariant.json" "$OUT/invariant-scales-d$d.json"
  done
  exit
fi
# 6: where the cp_invariant step's time goes after 0599382 (int64 dq converted straight into the float dq) and the
#    early scales: torch.profiler's GPU kernels of one step, 32 / 32 and 32 / 8 heads (the 32 / 8 step also expands
#    K / V per query head and sums dK / dV per group).
if [ "$1" = 6 ]; then
  TAIL_LINES=80 stage profile 240 python3 bench/invariant.py --tokens 32768 --heads 32:32 32:8 --reps 3 --profile \
    --out-dir "$OUT"
  mv "$OUT/$(date +%F)-invariant.json" "$OUT/invariant-profile.json"
  exit
fi
