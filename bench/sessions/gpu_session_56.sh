#!/usr/bin/env bash
# Fifty-sixth session (2026-12-06). The fifty-fifth found a length-bounded default gone stale (the hdim-64 causal
# backward's persistent grid, +3% at 16k once measured again). This session measures the other defaults whose last
# reading predates the kernels' later changes (TMA dK / dV stores, hoisted descriptors, deferred V marks, the
# over-heads orders), at the #11 points that still miss.
# - stale_bwd: hdim 128, the knobs measured before the fifteenth session: early_vectors for causal non-deterministic
#   calls (-2% at 4k, 0 / -3% at 16k in the fourteenth session; the fifty-fourth's samples put +38k on the
#   exponent's lse2 wait at causal 16k, which early_vectors moves), try_waits (neutral in the fifteenth),
#   masked_last=0 (the plain tiles first, the default for non-deterministic causal), and the deterministic ticket
#   poll without its sleep (ticket_sleep_ns=0: neutral in the nineteenth); and the causal launch order of many-wave
#   launches (lpt_over_heads in groups of 4 (batch, kv head) pairs, thirty-fourth session) against head-major, all
#   heads at once and groups of 8. Predicted: early_vectors +0-2% at causal 16k, the others within +-1%.
# - det_persistent: the persistent grid for deterministic calls beyond 2k (PERSISTENT_MAX_SEQLEN_K: not measured
#   there before). Predicted: +2-5% causal at 4k (as the non-deterministic grid measured), within +-2% at 16k.
# - stale_fwd: the forward's schedule defaults by head dim, last measured in the fourteenth to eighteenth sessions:
#   chained_max at hdim 64 (+-1.5% then) and hdim-128 causal (-0.5 / 0% at 16k), sum_from_old at hdim 128 (-2 to
#   -5% then), late_pv_wait at hdim-64 causal (0 to -0.6%). Predicted: within +-1.5%, no default moves.
# - table: #11's S >= 4k points, as in the fifty-third to fifty-fifth sessions (for an H200, when one comes).
# Ran (all on one H100; nvidia-h200 was asked for first): call 1 stale_bwd det_persistent stale_fwd, call 2 confirm,
#   call 3 more, call 4 short, call 5 window, call 6 split (bench/results/2026-12-06-s56/). Together masked_last=0
#   and early_vectors=1 read +1.6 to +3.7% at hdim-128 causal 1k-32k, +1.1% windowed, +0.8-2% packed; they are the
#   defaults since commit 40e5862 (so the b rows of window and split, and the variants of confirm / short, are the
#   default now). The deterministic grid at hdim-64 causal +0.5-3.9% at 4k-16k: the default up to 16k (78bfac0).
#   The forward's knobs moved nothing (sum_from_old -2% at hdim-128 causal); early_vectors / try_waits /
#   ticket_sleep_ns / the lpt groups within +-1% except as said.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_56.sh stale_bwd det_persistent stale_fwd
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-stale_bwd}; do
  case $s in
    stale_bwd)
      TAIL_LINES=16 stage stale_bwd 300 python3 bench/kernels.py --headdims 128 --seqlens 4096 16384 \
        --causal false true --directions bwd --deterministic --backends cute flash_attn_4 \
        --cute-variants bwd:early_vectors=1 bwd:try_waits=1 bwd:masked_last=0 bwd:lpt_over_heads=0 \
        bwd:lpt_over_heads=1,lpt_group=0 bwd:lpt_over_heads=1,lpt_group=8 bwd-det:ticket_sleep_ns=0 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/stale_bwd" ;;
    det_persistent)
      TAIL_LINES=12 stage det_persistent 200 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
        --causal false true --directions bwd --deterministic --backends cute \
        --cute-variants bwd-det:persistent_ctas=132 --rounds 3 --queue-ahead-ms 3 --out-dir "$OUT/det_persistent" ;;
    stale_fwd)
      TAIL_LINES=12 stage stale_fwd 240 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute flash_attn_4 \
        --cute-variants d64:fwd:chained_max=1 d64:fwd:late_pv_wait=1 d128:fwd:chained_max=1 \
        d128:fwd:sum_from_old=1 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/stale_fwd" ;;
    confirm)
      # call 1's leads again, more rounds and lengths: the plain query tiles in launch order (masked_last=0) and
      # early_vectors for the hdim-128 causal backward (+1.7% / +1.7% at 4k, +0.8% / 0 at 16k in call 1), the
      # deterministic persistent grid at hdim-64 causal (+3.9% at 4k, +0.9% at 16k)
      TAIL_LINES=10 stage confirm_d128 240 python3 bench/kernels.py --headdims 128 --seqlens 4096 8192 16384 32768 \
        --causal true --directions bwd --backends cute flash_attn_4 --cute-variants bwd:masked_last=0 \
        bwd:early_vectors=1 bwd:masked_last=0,early_vectors=1 --rounds 7 --queue-ahead-ms 3 \
        --out-dir "$OUT/confirm_d128"
      TAIL_LINES=8 stage confirm_det64 150 python3 bench/kernels.py --headdims 64 --seqlens 4096 8192 16384 \
        --causal true --directions bwd --deterministic --backends cute flash_attn_4 \
        --cute-variants bwd-det:persistent_ctas=132 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/confirm_det64" ;;
    more)
      # where else the two hdim-128 forms might reach: hdim-64 causal (128-row tiles: masked_last only), packed
      # hdim-128 causal documents of 1-4k tokens
      TAIL_LINES=6 stage more_d64 150 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 --causal true \
        --directions bwd --backends cute --cute-variants bwd:masked_last=0 --rounds 5 --queue-ahead-ms 3 \
        --out-dir "$OUT/more_d64"
      TAIL_LINES=10 stage more_packed 200 python3 bench/packed_tiles.py --headdim 128 --doclen 1024 2048 4096 \
        --direction bwd --variants masked_last=0 early_vectors=1 masked_last=0,early_vectors=1 --rounds 5 \
        --queue-ahead-ms 3 ;;
    short)
      # the same forms on short causal backwards (1k is interleave_lengths' launch order, 2k longest first)
      TAIL_LINES=8 stage short 150 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 --causal true \
        --directions bwd --backends cute flash_attn_4 --cute-variants bwd:masked_last=0 \
        d128:bwd:masked_last=0,early_vectors=1 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/short" ;;
    window)
      # the windowed (W 4096) and causal 32k backward with both forms (every backward call of the process: the
      # override hook), A / B / A / B, each run's ratio to flash-attn-4 the comparison
      for ab in a b a2 b2; do
        case $ab in a*) ov= ;; b*) ov=masked_last=0,early_vectors=1 ;; esac
        export FA4DIST_BWD_OVERRIDE=$ov; TAIL_LINES=6 stage "window_$ab" 150 python3 bench/window.py --cases causal window \
          --rounds 3 --queue-ahead-ms 3 --out-dir "$OUT/window_$ab"
      done ;;
    split)
      # few-wave causal launches (backward.split_keys_variant, the longest key tiles in parts) with both forms, A / B
      # / A / B through the override hook (the split variant inherits the main config's fields)
      for ab in a b a2 b2; do
        case $ab in a*) ov= ;; b*) ov=masked_last=0,early_vectors=1 ;; esac
        export FA4DIST_BWD_OVERRIDE=$ov; TAIL_LINES=7 stage "split_$ab" 120 python3 bench/split_tail.py \
          --direction bwd --causal --headdim 128 --shapes 1x4096x4 1x16384x1 1x8192x4 --rounds 5 \
          --out-dir "$OUT/split_$ab"
      done ;;
    table)
      kernels_table ;;
    *) echo "unknown stage $s (stale_bwd | det_persistent | stale_fwd | confirm | more | short | window | split | table)"; exit 2 ;;
  esac
done
