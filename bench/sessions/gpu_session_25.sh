#!/usr/bin/env bash
# Prepared in the twenty-fourth session (2026-12-03), results in bench/results/2026-12-03-twenty-fourth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_25.sh 1
# 1: where the ring simulation at cp = 8 loses (#12: 128k tokens, LPT, forward 0.90-0.95 and backward 0.80-0.88
#    against 0.97 / 0.95). Every simulated rank's kernels and the whole-sequence call's, by device time
#    (`cp_sim.py --profile-ranks`): whether the slowest rank's main kernels alone exceed T_full / cp (the per-step
#    launches' waves and tails) or the kernels around them (zero fills of the dK / dV partials, dQ scratch,
#    preprocess, convert) make the difference. Prediction: the backward's main kernels within 5% of T_full / 8 and
#    the zero fills 2-3% of a rank's time. Then the short causal forward's peer: cuDNN's kernel names and launch
#    shapes at 1k (#11: hdim 64 causal 1k at 0.92x cuDNN), beside ours and flash-attn-4.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=30 stage cp_sim_profile 330 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd bwd --reps 3 --profile-ranks 0 1 2 3 4 5 6 7 --tag profile
  for d in 64 128; do
    TAIL_LINES=40 stage "breakdown_1k_d$d" 150 python3 bench/kernel_breakdown.py --seqlen 1024 --batch 16 \
      --heads $((2048 / d)) --headdim $d --calls 10 --cudnn --launch-shapes --out-dir "$OUT/breakdown_1k_d$d"
  done
  exit
fi
# 2: call 1 found the ranks' kernels at T_full / cp or better (forward: 12.2-13.2 ms against 107.0 / 8 = 13.4;
#    backward: 34.0-37.2 against 281.9 / 8 = 35.2, i.e. 0.95 at the kernels), while the timed slowest rank took
#    15.3 / 39.8 ms (efficiency 0.857 / 0.892). So 2-2.6 ms per rank is outside the kernels. Each rank's device span
#    against its kernels' busy time, its host time and its synchronizing operations (torch's sync debug mode), five
#    rounds. Prediction: a span ~2 ms longer than the busy time (the device idle between launches) and either a
#    synchronizing operation per step or a host time per rank call near the timed one. Then the GPU suites that
#    call 4 of the twenty-third session did not reach (the forward, windows, non-finite inputs).
if [ "$1" = 2 ]; then
  TAIL_LINES=40 stage cp_sim_spans 300 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd bwd --reps 5 --profile-ranks 0 3 5 6 --tag spans
  TAIL_LINES=6 stage tests_fwd 270 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_window_gpu.py tests/kernels/test_cute_nonfinite_gpu.py
  exit
fi
# 3: call 2 found no device idle to speak of inside a rank's call (span - busy 0.4-0.75 ms) and no synchronizing
#    operation, but the timed rank 1.1 ms longer than its profiled span, as was the whole-sequence call (107.09 timed
#    against a 105.94 ms span): the host's time before a call's first launch, which an idle device waits for, counts
#    in every timed call, ~8% of a rank's and ~1% of the whole sequence's. Also, calls 1 and 2 profiled the ranks in
#    index order, and their kernel times grew with it (forward 12.2 -> 13.1 ms, all ranks running the same item
#    shapes): the clocks drift as the device heats within a round, and the slowest rank picks that up. The rounds now
#    time T_full before and after the ranks and rotate the ranks' order per round. The same simulation timed both
#    ways in one call: from an idle device (as before) and behind an 8 ms device-side spin (`--queue-ahead-ms 8`:
#    launch latency hidden, device time), with cProfile's table of one rank's call. Prediction: forward 0.87 ->
#    0.93-0.95, backward 0.90 -> 0.92-0.93 behind the spin; host per rank call 2-4 ms, spread over the launches.
# the cp = 8 simulation timed behind an 8 ms device-side spin, then from an idle device with rank 6 profiled;
# each stage limited to $1 seconds
simulations() {
  for ahead in 8 0; do
    TAIL_LINES=40 stage "cp_sim_ahead$ahead" "$1" python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
      --directions fwd bwd --reps 5 --queue-ahead-ms $ahead --tag "ahead$ahead" \
      $([ $ahead = 0 ] && echo --profile-ranks 6 --cprofile 30)
  done
}
if [ "$1" = 3 ]; then
  simulations 200
  # the session's contract and CP fixes (cu_seqlens on the CPU or strided, packed checks under inference mode, the
  # agreement's errors) on the GPU paths
  TAIL_LINES=6 stage tests_cp 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/cp/test_cp_gpu.py tests/kernels/test_worklist_gpu.py "tests/kernels/test_backends_gpu.py::test_packed"
  exit
fi
# 4: stage 3's two simulations alone (the device time left after refused calls did not cover its tests; stage 3
#    itself never ran: its calls were refused or the machine was taken back).
if [ "$1" = 4 ]; then
  simulations 120
  exit
fi
