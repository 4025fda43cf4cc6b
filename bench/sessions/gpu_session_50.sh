#!/usr/bin/env bash
# Prepared in the forty-seventh session (2026-12-05) for the next one; the forty-eighth (2026-12-06) got no device
# time (every start refused) and added pdl; the forty-ninth ran pdl, cp_tests and groups_cp8 (bench/RESULTS.md) and
# added bwd_ab; the fiftieth ran bwd_ab (no regression), steady, bwd_groups, steady_profile and fused_returns (whose
# simulated reading was too good: the partials shared one buffer, fixed since). A call returns few files and has at
# most 600 s: run stages alone or in pairs. Next: `fused_returns` (the honest reading), then `steady` on an H200.
# If fwd_pdl wins and fwd_pdl_events keeps the gain, the real ring's remote launches can take overlap_previous (a
# two-GPU check); if fwd_pdl_events loses it, the transfer waits must move ahead of the previous launch first.
# - cp_tests: tests/cp/test_cp_gpu.py (the forty-seventh session's member_backward_steps, CPU-tested only).
# - groups (#12, the simulated forward at cp = 8 / 4): launch groups of half the remote steps. One launch for all
#   remote steps read 0.928 against 0.908 one launch per step (H100, forty-seventh session; H200 0.940 / 0.905), but a
#   group waits for all of its transfers. With two groups (--steps-per-launch 4 at cp = 8, 2 at cp = 4) the first
#   group's transfers (4 x 128 MiB at cp = 8, ~1.2 ms over the 450 GB/s a GPU's NVLinks carry together) still land
#   under the own step's ~1.8 ms, and the second's under the first group's compute. Predicted: cp = 8 fwd/4 within
#   0.005 of fwd/all. If so, a default of ceil((cp - 1) / 2) steps per launch is worth a two-GPU check. The table's
#   "+xfer" column models the transfers each row's groups would leave exposed (cp_sim.exposed_transfer_ms; from the
#   H100 numbers: fwd/all at cp = 8 ~0.58 ms exposed, 0.928 -> ~0.89; fwd/4 none).
# - pdl (#12): the ring forward's remote launches each started while the one before it finishes (programmatic
#   dependent launch, MemberForward's overlap_launches; cp_sim direction fwd_pdl): its GPU test (the bytes of calls in
#   turn), then cp = 8 beside one launch per step, and with a complete event's wait before each remote launch
#   (fwd_pdl_events, as the ring's transfer waits). Predicted (NOTES_FWD.md, forty-eighth session): fwd_pdl within
#   0.01 of fwd/all (0.928-0.940 at cp = 8), i.e. +2-3% over fwd (0.905-0.908).
# - steady (#12, fiftieth session): the forty-ninth session's logs showed the whole-sequence call and the ranks timed
#   at different clocks (the first ranks after the whole-sequence call up to 12% slower than the round's last ones,
#   the first whole-sequence call 5-9% slower than the last): cp_sim --steady times each in a block of its own
#   continuous load. Predicted: eff~ (slowest rank's median) 0.93-0.95 forward, 0.91-0.93 backward at cp = 8.
# - bwd_groups (#12, fiftieth session): the ring backward's remote steps in launch groups (one key buffer and one
#   call per group, each step's rows of the partial returned to their owner). Predicted at cp = 8: bwd/4 0.95 +-
#   0.01 against bwd 0.92 (steady timing), the modeled transfers hidden.
# - steady_profile (#12, fiftieth session): the last steady round under torch.profiler, each call's kernels split by
#   the probe spins: is a rank's steady-state excess (~3 ms of 39 at cp = 8 backward) in its kernels (busy) or
#   between them (span - busy, elapsed - span)? Predicted: busy, the main backward kernel slower per tile than the
#   whole-sequence call's.
# - fused_returns (#12, fiftieth session): the returned partials of a launch group added in one pass per stretch of
#   rows (kernels/cute/sum_into.py): its GPU tests, then the steady profile. Predicted at cp = 8: the adds 1.39 ->
#   ~0.75 ms with groups of four (two fused sums of 4 and 3 returns), bwd/4 +1.5 points.
# - bwd_spread (#12): the cp = 8 simulated backward with the ring's own order (MemberBackward) three times in a row,
#   on the H200 if lent: the H100 read 0.921 and 0.878 five minutes apart (forty-seventh session).
# - marks_192, marks_packed_h200, scratch_host, handoff, fwd_long: as gpu_session_49.sh.
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_50.sh [groups] [bwd_spread] ...
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s50 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
for s in ${*:-groups}; do
  case $s in
    cp_tests)
      TAIL_LINES=3 stage cp_tests 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cp/test_cp_gpu.py ;;
    groups|groups_cp8)
      TAIL_LINES=14 stage groups_cp8 200 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions fwd --steps-per-launch 1 4 0 --reps 6 --queue-ahead-ms 8 --back-to-back --tag groups_cp8
      [ "$s" = groups ] || continue ;&
    groups_cp4)
      TAIL_LINES=14 stage groups_cp4 200 python3 bench/cp_sim.py --seqlens 131072 --cp 4 --balancers lpt \
        --directions fwd --steps-per-launch 1 2 0 --reps 6 --queue-ahead-ms 8 --back-to-back --tag groups_cp4 ;;
    pdl)
      TAIL_LINES=3 stage pdl_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_worklist_gpu.py \
        -k overlapped
      TAIL_LINES=10 stage pdl_cp8 240 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions fwd fwd_pdl fwd_pdl_events --reps 6 --queue-ahead-ms 8 --back-to-back --tag pdl ;;
    bwd_ab)  # the member backward before 2b0418d (member_backward_steps) beside today's, interleaved; needs
      # `git archive 2b0418d^ fa4dist bench/cp_sim.py bench/timing.py | tar -x -C .kwt/old` here and .kwt/old carried
      for r in 1 2; do
        TAIL_LINES=1 stage "bwd_old_$r" 100 python3 .kwt/old/bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
          --directions bwd --reps 4 --queue-ahead-ms 8 --back-to-back --tag "bwd_old_$r"
        TAIL_LINES=1 stage "bwd_new_$r" 100 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
          --directions bwd --reps 4 --queue-ahead-ms 8 --back-to-back --tag "bwd_new_$r"
      done ;;
    steady)  # the fiftieth session: whole-sequence call and ranks each timed in a block of its own load
      TAIL_LINES=16 stage steady_cp8 240 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions fwd bwd --steps-per-launch 1 4 0 --reps 3 --queue-ahead-ms 8 --steady 2 --tag steady_cp8 ;;
    bwd_groups)  # the fiftieth session: the ring backward in launch groups (as the forward's), steady timing
      TAIL_LINES=12 stage bwd_groups 240 python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt \
        --directions bwd --steps-per-launch 1 2 4 0 --reps 3 --queue-ahead-ms 8 --steady 2 --tag bwd_groups ;;
    steady_profile)  # the fiftieth session: where a rank's time goes in the steady stream (kernels, gaps)
      TAIL_LINES=24 stage steady_profile 240 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions fwd bwd --steps-per-launch 1 4 --reps 2 --queue-ahead-ms 8 --steady 2 --profile-steady \
        --tag steady_profile ;;
    fused_returns)  # the fiftieth session: a launch group's returned partials summed in one pass (sum_into)
      TAIL_LINES=3 stage fused_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_sum_into_gpu.py \
        tests/cp/test_cp_gpu.py -k "sum or returns or launch_groups"
      TAIL_LINES=12 stage fused_sim 150 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions bwd --steps-per-launch 1 4 0 --reps 2 --queue-ahead-ms 8 --steady 2 --profile-steady \
        --tag fused_returns ;;
    bwd_spread)
      for i in 1 2 3; do
        TAIL_LINES=3 stage "bwd_spread_$i" 120 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
          --directions bwd --reps 4 --queue-ahead-ms 8 --back-to-back --tag "bwd_spread_$i"
      done ;;
    marks_192|marks_packed_h200|scratch_host|handoff|fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_49.sh" "$s" ;;
    *) echo "unknown stage $s (cp_tests | groups | groups_cp8 | groups_cp4 | pdl | bwd_ab | steady | bwd_groups | steady_profile | fused_returns | bwd_spread | marks_192 | marks_packed_h200 | scratch_host | handoff |" \
         "fwd_long)"; exit 2 ;;
  esac
done
