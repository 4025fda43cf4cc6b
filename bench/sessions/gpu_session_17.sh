#!/usr/bin/env bash
# Seventeenth session: long and short causal tiles interleaved in the launch order (interleave_lengths; tile_scheduler.
# causal_m_block: n-1, 0, n-2, 1, ... instead of longest first). The lead (NOTES_FWD.md, twelfth session): a causal
# merge at 4k costs ~49 us against ~20 us non-causal for the same bytes, i.e. its running-row traffic is not hidden,
# plausibly because longest-first runs the short tiles (mostly epilogue: memory-bound) together at the end.
# Prediction: the 4k causal merge's overhead over the plain forward +10-12% -> +3-5%, 16k within noise; the plain
# causal forward and the causal backward within +-2% (their short tiles move little data), perhaps + at 1k.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 1   # bits tests, merge / plain / bwd A/B
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 2   # short sequences again, 5 rounds
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 3   # suites under the new defaults; ncu
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 4   # the table under the final defaults
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 5   # Q's slices hoisted: bits, A/B, table
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 6   # the causal 4k backward: counters
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 7   # the persistent backward at 4k-16k
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 8   # SASS samples, causal 4k hdim-128 bwd
# Call 1: the merge lost (+15.7% against +12.9% at 4k causal), as did 4k / 16k and packed documents (-2 to -7%);
# 1k gained: forward hdim 128 +8%, backward +7-8% at both head dims (3 rounds). Call 2 asks whether 1k / 2k hold.
# They did (forward +10% / +3% at hdim 128, 0 / +6% at hdim 64 at 1k / 2k; backward +8% at 1k, -5% / 0 at 2k): the
# default for dense causal forwards of <= 2048 rows and backwards of <= 1024 keys (forward.interleaved_launch,
# backward.default_interleave_lengths). Call 3 runs the kernel suites under those defaults, and Nsight Compute's
# SASS samples of the hdim-128 non-causal forward at 16k after the descriptor hoist (the remaining 2-4% there).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s17 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
PYTEST="python3 -m pytest -x -q -p no:cacheprovider -rfE"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session17
  TAIL_LINES=4 stage bits 120 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_bwd_gpu.py \
    -k "(schedule_fields or step_forms) and interleave"
  TAIL_LINES=12 stage merge 150 python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal true \
    --directions fwd --backends cute --accumulate --accumulate-seqlens 4096 16384 --accumulate-variants \
    interleave_lengths=1 persistent_ctas=132 persistent_ctas=132,interleave_lengths=1 --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/merge.json" 2>/dev/null
  TAIL_LINES=30 stage ab 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 --causal true \
    --directions fwd bwd --backends cute sdpa_cudnn flash_attn_4 \
    --cute-variants fwd:interleave_lengths=1 bwd:interleave_lengths=1 --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/ab.json" 2>/dev/null
  for d in 128 64; do
    TAIL_LINES=8 stage packed_$d 90 python3 bench/packed_tiles.py --direction fwd --headdim $d --doclen 512 1024 2048 \
      --variants interleave_lengths=1 --rounds 3
  done
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 3 ]; then
  TAIL_LINES=6 stage suites 360 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_bwd_gpu.py \
    tests/kernels/test_cute_nonfinite_gpu.py tests/kernels/test_window_gpu.py
  ncu_sass_pair fwd:128:16384:full fa4dist flash_attn  # (bench/stage.sh)
  exit
fi
if [ "$1" = 5 ]; then
  # call 3's SASS samples: the QK wgmmas of a step wait on 28 split 64-bit adds (Q's K-block slices re-added to
  # the hoisted base every step, then K's). hoist_q_slices makes each of Q's slices its own loop-invariant
  # descriptor: 466 -> 450 instructions per step at hdim 128 (flash-attn-4 455), 482 -> 470 causal, hdim 64
  # 418 -> 406 / 427 -> 419, and the seven QK wgmmas issue back to back. Prediction: +1-2% forward at hdim 128.
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session17b
  TAIL_LINES=4 stage bits 100 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py -k "schedule_fields and hoist_q"
  TAIL_LINES=24 stage ab 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 32768 \
    --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:hoist_q_slices=false \
    --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/q-slices-ab.json" 2>/dev/null
  TAIL_LINES=30 stage table 230 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --backends cute sdpa_cudnn flash_attn_4 --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/table.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 6 ]; then
  # the largest backward gap left at >= 4k: causal 4k, 0.92x / 0.93x flash-attn-4 at hdim 128 / 64 (call 5's table)
  # where 16k is 1.02-1.03x. The persistent grid there (measured within 3% in the eleventh session, before the TMA
  # dK / dV stores) beside the default, then Nsight Compute's full set of both kernels
  TAIL_LINES=14 stage persistent 200 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 8192 --causal true \
    --directions bwd --backends cute flash_attn_4 --cute-variants bwd:persistent_ctas=132 --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/bwd-persistent-4k.json" 2>/dev/null
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  TAIL_LINES=8 stage ncu 240 "$NCU" --profile-from-start off --clock-control none --set full --import-source no \
    --export "$OUT/prof" -f python3 bench/ncu_kernels.py --cases bwd:128:4096:causal bwd:64:4096:causal
  "$NCU" --import "$OUT/prof.ncu-rep" --page raw --csv 2>&1 | gzip > "$OUT/raw.csv.gz"
  python3 bench/ncu_summary.py raw "$OUT/raw.csv.gz" --pairs 1:4 7:10 > "$OUT/ncu_summary.txt" 2>&1
  head -40 "$OUT/ncu_summary.txt"
  rm -f "$OUT"/*.png "$OUT/prof.ncu-rep"
  exit
fi
if [ "$1" = 7 ]; then
  # call 6: the persistent grid gave the causal backward +6% / +1.7% at hdim 64 4k / 8k, +0.6% / +2.3% at hdim 128
  # (5 rounds); it is the default only up to 2048 keys. Non-causal too, and 16k, before moving that bound
  TAIL_LINES=2 stage aot 120 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session17c
  TAIL_LINES=16 stage persistent 230 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 8192 16384 \
    --causal false true --directions bwd --backends cute flash_attn_4 --cute-variants bwd:persistent_ctas=132 \
    --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/bwd-persistent.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 8 ]; then
  # call 6's counters: at hdim 128 causal 4k our main kernel stalls 1.9x flash-attn-4's long scoreboard per issued
  # instruction (5.5 / 2.9) and 3.5x its short scoreboard, with the same shared-load counts: which instructions
  # wait (SASS-level samples of both main kernels, the new defaults: the persistent grid at 4k)
  ncu_sass_pair bwd:128:4096:causal FlashBwdSm90 FlashAttentionBackwardSm90
  exit
fi
if [ "$1" = 4 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session17
  TAIL_LINES=40 stage table 330 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute sdpa_cudnn flash_attn_4 --rounds 3 \
    --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/table.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 2 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session17
  TAIL_LINES=20 stage short 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 --causal true \
    --directions fwd bwd --backends cute sdpa_cudnn flash_attn_4 \
    --cute-variants fwd:interleave_lengths=1 bwd:interleave_lengths=1 --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/short.json" 2>/dev/null
  for d in 128 64; do
    TAIL_LINES=8 stage packed_bwd_$d 100 python3 bench/packed_tiles.py --direction bwd --headdim $d \
      --doclen 512 1024 2048 --variants interleave_lengths=1 --rounds 3
  done
  rm -f "$OUT"/*.png
  exit
fi
