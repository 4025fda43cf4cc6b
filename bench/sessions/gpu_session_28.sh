#!/usr/bin/env bash
# Prepared in the twenty-seventh session (2026-12-03), results in bench/results/2026-12-03-twenty-seventh-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_28.sh 1
# 1: the ring forward's remote steps in launch groups (ring_forward / Schedule.launch_groups: a group's received
#    key rows land in one buffer, its steps' items are coalesced into one work list, so a row's fully visible
#    blocks from several steps join into one item and merge once). The forward at cp = 8 reads 0.905 against 0.98
#    for its items as plain per-item calls; the merges of the running fp32 rows are the difference. Counted on the
#    CPU: merged rows 877k -> 606k (pairs) at cp = 8. Prediction: cp = 8 fwd/2 ~0.925, fwd/all ~0.95-0.97;
#    cp = 4 fwd/all +2-3%. First the ring on the GPU with every remote step in one launch (staged ranks, cute).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
if [ "${1:-1}" = 1 ]; then
  FA4DIST_RING_STEPS_PER_LAUNCH=0 TAIL_LINES=8 stage tests_ring_groups 150 python3 -m pytest -q -p no:cacheprovider \
    -rfE -m gpu tests/cp/test_cp_gpu.py -k "bf16 or fp64_exact"
  TAIL_LINES=12 stage cp_sim_groups_cp8 220 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd --steps-per-launch 1 2 3 0 --reps 6 --queue-ahead-ms 8 --back-to-back --tag groups-cp8
  TAIL_LINES=8 stage cp_sim_groups_cp4 120 python3 bench/cp_sim.py --seqlens 131072 --cp 4 --balancers lpt \
    --directions fwd --steps-per-launch 1 0 --reps 6 --queue-ahead-ms 8 --back-to-back --tag groups-cp4
  exit
fi
# 2: call 1 refuted it: fwd/2, fwd/3 and fwd/all read 0.910 / 0.916 / 0.922 against 0.919 for one launch per step
#    (cp = 4: 0.945 both), while the same items as plain calls read 0.991. With every remote step in one launch a
#    cp = 8 LPT member's remote work is ONE item (8192 query rows x 114688 keys, non-causal) merged once, so the
#    merges' count is not the gap: the work-list kernel itself runs that block slower than the plain kernel.
#    bench/item_forms.py times that block through every entry form (plain 16-bit out, dense merge, work list fresh
#    and merging, split in 7 key ranges) under the forward variants that differ between them: chained_max (the
#    plain call's default for >= 8192 keys), the persistent grid. Prediction: items_fresh ~0.95x plain by default,
#    ~0.98x with chained_max and the persistent grid. Then rank 0's kernels (cp_sim --profile-ranks 0).
if [ "$1" = 2 ]; then
  TAIL_LINES=26 stage item_forms_ring 200 python3 bench/item_forms.py --q-rows 8192 --k-rows 114688 --heads 16 \
    --split 7 --rounds 3 --reps 5 --variants default chained_max=1 persistent_ctas=132 \
    persistent_ctas=132,chained_max=1
  TAIL_LINES=12 stage cp_sim_profile 150 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd --steps-per-launch 1 0 --reps 3 --queue-ahead-ms 8 --back-to-back --profile-ranks 0 \
    --tag profile-cp8
  exit
fi
# 3: (a) the soft-capped backward's MUFU load: tanh and exp2 per score, 2 MUFU ops where the plain step has 1 (16 per
#    clock and SM: at hdim 128 that is 0.125 clk per score against 0.31 of tensor-core time, 0.16 at hdim 64).
#    BwdConfig.exp2_poly_every = k puts every k-th column's exp2 on the FMA pipe (a cubic, ~10 FMA / ALU ops),
#    which the forward measured slower without a cap (third session: its consumers were issue-bound). Prediction:
#    k = 4 (MUFU -12.5%) +2-4% on the capped backward at hdim 128, k = 2 (44 bytes of spills) no better. First the
#    capped kernels' tests with k = 2 (the oracle's tolerances; bytes repeat run to run).
#    (b) launch groups again, with more rounds: item_forms said one launch for the remote block is 3.5% faster
#    than its seven per-step launches (0.997 against 0.965 of the plain call), the simulation saw +0.3%.
if [ "$1" = 3 ]; then
  FA4DIST_BWD_OVERRIDE=exp2_poly_every=2 TAIL_LINES=6 stage tests_exp2_poly 120 python3 -m pytest -q \
    -p no:cacheprovider -rfE -m gpu tests/kernels/test_window_gpu.py -k "cute_softcap"
  TAIL_LINES=30 stage softcap_exp2_poly 240 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
    --causal true --directions bwd --softcap 30 --backends cute --rounds 3 \
    --cute-variants bwd:exp2_poly_every=2 bwd:exp2_poly_every=4 bwd:exp2_poly_every=8
  TAIL_LINES=4 stage cp_sim_groups_again 120 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd --steps-per-launch 1 0 --reps 10 --queue-ahead-ms 8 --back-to-back --tag groups-again
  exit
fi
# 4: call 3 put the ranks' medians side by side: the LPT work model is balanced (1.000), yet at cp = 8 rank 7 (its
#    two chunks adjacent: one own causal item of 16384 rows) runs 2-4% faster than ranks 0-6, whose own step is a
#    diagonal, a fully visible block and a second diagonal on the same rows as the block: two waves, two launches.
#    worklist.coalesce now joins a causal item with the fully visible item whose keys precede its own (the earlier
#    keys at virtual positions just below the diagonal: a causal mask sees only order), so every member's own step
#    is one launch. Prediction: cp = 8 forward +1-2% (0.91-0.93 -> ~0.94), backward within +-1%; the GPU bits of the
#    ring's lists (work list against loop) and the ring against the oracle first.
if [ "$1" = 4 ]; then
  TAIL_LINES=6 stage tests_worklist_ring 120 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/kernels/test_worklist_gpu.py -k "ring_schedule or backward_ring"
  TAIL_LINES=6 stage tests_cp_ring 70 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/cp/test_cp_gpu.py -k "bf16"
  # two independent 64-row tiles per SM (FwdConfig.ctas_per_sm = 2, tile_m = 64: 128 registers at launch, 24 / 232
  # after setmaxnreg, no spills), the shape of cuDNN's short causal forward (twenty-fourth session), against our
  # 128-row tiles at hdim 64 1k causal (0.91-0.92x cuDNN). Prediction: within +-5%, a first look only.
  TAIL_LINES=16 stage fwd_two_ctas 110 python3 bench/kernels.py --headdims 64 --seqlens 1024 2048 --causal true \
    --directions fwd --backends cute cudnn --rounds 5 --cute-variants "fwd:tile_m=64" \
    "fwd:tile_m=64,ctas_per_sm=2,persistent_ctas=0" "fwd:tile_m=64,ctas_per_sm=2,persistent_ctas=264"
  TAIL_LINES=4 stage cp_sim_joined_cp8 160 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd bwd --steps-per-launch 1 0 --reps 6 --queue-ahead-ms 8 --back-to-back --tag joined-cp8
  exit
fi
# 5: call 4's first look at two 64-row tiles per SM on the persistent grid (264 CTAs): hdim 64 causal 1k 315 against
#    298 TFLOP/s (+5.7%; cuDNN 335), 2k 357 against 380 (-6%). Again with 512 / 1k / 1.5k, and the dense forward's
#    tests at hdim 64 under it (the oracle's tolerances). Prediction: +3-6% at 512 / 1k, a loss from 1.5k.
if [ "$1" = 5 ]; then
  FA4DIST_FWD_OVERRIDE=tile_m=64,ctas_per_sm=2,persistent_ctas=264 TAIL_LINES=4 stage tests_two_ctas 80 \
    python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/kernels/test_cute_fwd_gpu.py -k "test_dense and 64"
  TAIL_LINES=14 stage fwd_two_ctas_again 80 python3 bench/kernels.py --headdims 64 --seqlens 512 1024 1536 \
    --causal true --directions fwd --backends cute cudnn --rounds 5 \
    --cute-variants "fwd:tile_m=64,ctas_per_sm=2,persistent_ctas=264"
  exit
fi
