#!/usr/bin/env bash
# Fifty-first session (2026-12-06). The fiftieth's queued stages ran first (gpu_session_50.sh fused_returns steady
# cp_tests: bench/RESULTS.md). With the returns summed in one pass the simulated backward at cp = 8 read bwd/all
# 0.953-0.955 against bwd/4 0.926-0.939, but the model leaves bwd/all's last returns exposed (7 returns under half
# the own step: 0.898 with them). Groups of six and one ([6, 1]) hide them by the same model (the last group's one
# return under half the own step, the first group's six under the last group's step) and keep six of seven steps in
# one launch; the forward's [6, 1] leaves 0.28 ms of its first group's keys exposed, [4, 3] none.
# - sizes (#12): cp = 8 forward and backward at 1 / 4 / 5 / 6 / all steps per launch, steady timing.
#   Predicted: bwd/6 within 0.005 of bwd/all (0.95), fwd/6 near fwd/all (0.96) before its modeled transfers.
# - cp2 (#12's two-GPU targets, 0.97 at 32k and 0.98 at 128k tokens per GPU): what the kernels alone leave at cp = 2
#   (32 / 8 heads of 128, 64k and 256k tokens), steady timing with the last round profiled: a rank's kernels against
#   half the whole-sequence call's. Predicted: 0.95-0.97 at 64k (its two rank launches' tails and the returned
#   partial's add), 0.97-0.98 at 256k.
# - tiles64 (#11: hdim 64 at 16k, 0.97-0.98x flash-attn-4): two consumer warpgroups of a 128-row tile over 192 or
#   160 keys per block. 128 x 192 compiles spill-free on the CPU (566 SASS instructions per 192-key step, 2.95 a key
#   against ~3.2 for today's 192 x 128); 128 x 128 lost 10-14% (thirtieth session: two warpgroups overlap the
#   softmax and the GEMMs worse than three). Predicted: 128 x 192 -3 to -8% against the default, so not a default
#   unless it reads >= +2% at 16k.
# Ran (bench/RESULTS.md, fifty-first session): sizes, cp2, tiles64 on an H100. Next: on two GPUs,
# gpu_session_x2.sh cp (the cp = 2 kernels alone read ~1.0 here, so its profile shows what the transfers cost); on an
# H200, `sizes` again (the H100's group sizes 4-6 lay within its spread).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_51.sh sizes
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s51 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
for s in ${*:-sizes}; do
  case $s in
    sizes)
      TAIL_LINES=12 stage sizes_cp8 300 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions bwd fwd --steps-per-launch 1 4 5 6 0 --reps 3 --queue-ahead-ms 8 --steady 2 --tag sizes_cp8 ;;
    cp2)
      TAIL_LINES=20 stage cp2 300 python3 bench/cp_sim.py --seqlens 65536 262144 --cp 2 --heads 32 --kv-heads 8 \
        --balancers lpt --directions fwd bwd --reps 3 --queue-ahead-ms 8 --steady 2 --profile-steady --tag cp2 ;;
    tiles64)
      TAIL_LINES=14 stage tiles64 300 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 --causal false true \
        --directions fwd --backends cute flash_attn_4 --cute-variants fwd:tile_m=128,tile_n=192 \
        fwd:tile_m=128,tile_n=160 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT" ;;
    *) echo "unknown stage $s (sizes | cp2 | tiles64)"; exit 2 ;;
  esac
done
