#!/usr/bin/env bash
# Prepared in the fifty-sixth session (2026-12-06) for the next one: the rest of the defaults audit. The fifty-sixth
# found the backward's causal band order stale (masked_last, built before clean_tiles) and changed it with
# early_vectors (commit 40e5862), and the deterministic hdim-64 causal grid (78bfac0). Thresholds measured against
# the old order may have moved with it; and the forward's grid choices were last measured in the ninth session.
# - suites (first): the GPU suites the fifty-sixth session's new backward defaults did not run under: the windowed
#   kernels (non-deterministic windowed backwards now walk the deterministic ones' phase order, with early loads),
#   the work lists, the non-finite inputs and the context-parallel GPU tests (the ring's accumulating steps).
#   Predicted: all pass (the order is the deterministic one's, early_vectors only moves loads).
# - bwd_interleave: long and short key tiles alternated (interleave_lengths) at causal 1k (the default there,
#   measured with the band last in the seventeenth session: +7.6 / +8.4%) and at 2k (off: -4.6 / 0% then), both
#   sides. Predicted: still on at 1k (+3-8%), still off at 2k.
# - ring_sim: the ring's accumulating steps now visit their causal band first too (masked_last is off for every
#   variant). cp_sim at cp = 8, backward, one launch per step and groups of four. Predicted: within +-1% of the
#   fifty-first session's 0.926 / 0.941 (eff~), perhaps +1% (the diagonal steps' ascending order measured +1-4%).
#   Then the ring's accumulating steps with early_vectors (off for merges: never measured; spill-free there, ptxas on
#   the CPU), A / B / A / B through the override hook, one launch per step. Predicted: +1-3% on a rank's backward
#   (the fresh non-causal calls gained 0-13% in the fourteenth session), which would put it near #12's 0.95.
# - fwd_grid: the forward's persistent grid (default for every dense 16-bit forward since the ninth session) against
#   one CTA per tile at hdim 128, and split_tail off, at 4k / 16k. Predicted: the grid within +-1% at 16k, +1-3% at
#   4k; split_tail unchanged at 16k (no tail to split at 16 x 8 waves). And FA3's 128 x 176 tile without the O
#   staging tile (tile_n=176,tma_store_o=false: spill-free on today's kernel, ptxas on the CPU), last measured in
#   the sixteenth session (-3 to +0.5% non-causal), before the persistent grid's later changes and chained_max.
#   Predicted: -2 to +1% non-causal; its error against torch's flash kernel is printed (partial last key tiles).
# - softcap: the soft-capped hdim-128 backward with early_vectors (off for capped calls, never measured), now that
#   the band comes first. ptxas (CPU, fifty-sixth session): 248 / 264 bytes of spill stores at 4k / 16k against
#   the default's 16 / 20. Predicted: -3 to -8%; run to close the question, cheap.
# - bwd_grid: the hdim-128 causal backward's persistent grid beyond 8k (PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET) with
#   the new order and early loads (it read within +-0.3% at 16k before them, fifty-fifth session; the causal
#   persistent kernel now spills 4 bytes). Predicted: within +-1%.
# - short_fwd: #11's causal 1k forward at hdim 64 (0.96x cuDNN: two 64-row CTAs per SM, 128-key tiles, longest
#   tiles first) with the orders and tiles its family never took: long and short tiles alternated
#   (interleave_lengths, measured only on the old 128-row short tiles: -1.2 / -0.6%), 64-key tiles in three stages
#   (tiny_tiles' form, -2% at 1k in the twenty-eighth session, before defer_v_marks) and one CTA per tile.
#   Predicted: within +-2%, none reaching cuDNN.
# - table: #11's S >= 4k points (for an H200, when one comes).
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_57.sh suites (a call of its own);
#   then bwd_interleave fwd_grid bwd_grid softcap short_fwd;
#   then ring_sim ring_early; table on an H200
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-bwd_interleave}; do
  case $s in
    suites)
      TAIL_LINES=4 stage window_tests 280 python3 -m pytest -m gpu -x -q -p no:cacheprovider -rfE \
        tests/kernels/test_window_gpu.py tests/kernels/test_cute_nonfinite_gpu.py
      TAIL_LINES=4 stage worklist_tests 200 python3 -m pytest -m gpu -x -q -p no:cacheprovider -rfE \
        tests/kernels/test_worklist_gpu.py
      TAIL_LINES=4 stage cp_tests 280 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py ;;
    bwd_interleave)
      TAIL_LINES=8 stage bwd_interleave 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 \
        --causal true --directions bwd --backends cute flash_attn_4 --cute-variants bwd:interleave_lengths=0 \
        bwd:interleave_lengths=1 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/bwd_interleave" ;;
    ring_sim)
      TAIL_LINES=12 stage ring_sim 240 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions bwd --steps-per-launch 1 4 --reps 3 --queue-ahead-ms 8 --steady 2 --tag ring_sim ;;
    ring_early)
      for ab in a b a2 b2; do
        case $ab in a*) ov= ;; b*) ov=early_vectors=1 ;; esac
        export FA4DIST_BWD_OVERRIDE=$ov; TAIL_LINES=6 stage "ring_early_$ab" 150 python3 bench/cp_sim.py \
          --seqlens 131072 --cp 8 --balancers lpt --directions bwd --reps 3 --queue-ahead-ms 8 --steady 2 \
          --tag "ring_early_$ab"
      done
      export FA4DIST_BWD_OVERRIDE= ;;
    fwd_grid)
      TAIL_LINES=10 stage fwd_grid 200 python3 bench/kernels.py --headdims 128 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:persistent_ctas=0 \
        fwd:split_tail=0 fwd:tile_n=176,tma_store_o=false --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/fwd_grid" ;;
    softcap)
      TAIL_LINES=8 stage softcap 200 python3 bench/kernels.py --softcap 30 --headdims 128 --seqlens 4096 16384 \
        --causal true --directions bwd --backends cute flash_attn_4 --cute-variants bwd:early_vectors=1 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/softcap" ;;
    bwd_grid)
      TAIL_LINES=6 stage bwd_grid 150 python3 bench/kernels.py --headdims 128 --seqlens 16384 32768 --causal true \
        --directions bwd --backends cute flash_attn_4 --cute-variants bwd:persistent_ctas=132 --rounds 5 \
        --queue-ahead-ms 3 --out-dir "$OUT/bwd_grid" ;;
    short_fwd)
      TAIL_LINES=6 stage short_fwd 150 python3 bench/kernels.py --headdims 64 --seqlens 1024 --causal true \
        --directions fwd --backends cute cudnn flash_attn_4 --cute-variants fwd:interleave_lengths=1 \
        fwd:tile_n=64,num_stages=3 fwd:persistent_ctas=0 --rounds 7 --queue-ahead-ms 3 --out-dir "$OUT/short_fwd" ;;
    new_tests)  # (added in the fifty-seventh session) the suite of its new forward default (forward.wide_tiles_launch)
      TAIL_LINES=4 stage wide_tests 150 python3 -m pytest -m gpu -x -q -p no:cacheprovider -rfE \
        tests/kernels/test_cute_fwd_gpu.py -k "16500 or schedule_fields or split_tail or persistent_grid" ;;
    wide_ab)  # (fifty-seventh) the 176-key default against the 128-key tiles, a third run
      TAIL_LINES=8 stage wide_ab 150 python3 bench/kernels.py --headdims 128 --seqlens 8192 16384 32768 \
        --causal false --directions fwd --backends cute flash_attn_4 --cute-variants \
        fwd:tile_n=128,tma_store_o=true --rounds 7 --queue-ahead-ms 3 --out-dir "$OUT/wide_ab" ;;
    table)
      kernels_table ;;
    *) echo "unknown stage $s (suites | bwd_interleave | ring_sim | ring_early | fwd_grid | softcap | bwd_grid | short_fwd | new_tests | wide_ab | table)"; exit 2 ;;
  esac
done
