#!/usr/bin/env bash
# Prepared in the twenty-fifth session (2026-12-03), results in bench/results/2026-12-03-twenty-fifth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_26.sh 1
# 1: the twenty-fourth session found, behind an 8 ms device-side spin, every simulated rank's median within 4% of
#    T_full / cp (cp = 8, 128k, LPT: 0.987 forward, 0.958 backward at the slowest median) but in every round one rank
#    ~15% slower than its own median, which the reported efficiency (the median over rounds of each round's slowest
#    rank) takes: 0.866 / 0.938. Each timed call now records its place in the round, the host's time issuing it,
#    the spin before it and a 0.25 ms spin after it (a spin runs a fixed number of SM cycles, so its time reads the
#    clock). Prediction: the slow rank sits at one place (the first after the whole-sequence calls) and either its
#    host time exceeds the 8 ms spin (the device waited for launches) or its probes read a lower clock.
#    Then the twenty-fourth session's contract and CP fixes on the GPU paths (cu_seqlens on the CPU or strided,
#    packed checks under inference mode, the agreement's errors), which its refused calls never ran.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=45 stage cp_sim_places 220 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd bwd --reps 8 --queue-ahead-ms 8 --tag places
  TAIL_LINES=8 stage tests_cp 320 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/cp/test_cp_gpu.py tests/kernels/test_worklist_gpu.py "tests/kernels/test_backends_gpu.py::test_packed"
  exit
fi
# 2: call 1 found the round's slow rank always at place 1, right after the whole-sequence call, and the clock probes
#    say why: the spin before it read the SM clock ~17% low (10.0 ms for 8.3 nominal; the probe after T_full 0.31 ms
#    for 0.255), and the ranks' clocks recovered to the quiet device's by place 3-4. So calls timed one by one run at
#    a quiet device's clock, except the one after the 100 ms call, while T_full runs at the clock a continuous load
#    settles at: the ranks' medians were flattered (0.987) and the place-1 rank penalized (0.898 reported). A ring
#    rank's device is busy through its steps, so each round's calls are now queued back to back
#    (`--back-to-back`). Prediction: no place effect, the probes equal across places, efficiency between the two
#    readings: forward 0.93-0.96, backward 0.94-0.95. Then the same with a 4096-token window (#15's cp target in the
#    simulation: cp = 2 at >= 0.9, i.e. >= 1.8x one GPU) and the cute fixes' GPU paths (offsets as diagonals).
if [ "$1" = 2 ]; then
  TAIL_LINES=45 stage cp_sim_b2b 170 python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt \
    --directions fwd bwd --reps 8 --queue-ahead-ms 8 --back-to-back --tag b2b
  TAIL_LINES=45 stage cp_sim_b2b_window 130 python3 bench/cp_sim.py --seqlens 131072 --cp 2 8 --balancers lpt \
    --directions fwd bwd --reps 5 --queue-ahead-ms 8 --back-to-back --window 4096 --tag b2b-window
  TAIL_LINES=8 stage tests_offsets 270 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_backends_gpu.py tests/kernels/test_worklist_gpu.py tests/kernels/test_cute_bwd_gpu.py \
    tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_window_gpu.py -k "packed or offset or segment or list" \
    ${EXTRA_TESTS:-}
  exit
fi
# 3: back to back (call 2), the simulation's clocks settle as under a continuous load (every probe ~0.30-0.31 ms
#    against 0.255 on a quiet device) and the place effect is gone, but the readings are lower than either earlier
#    one: cp = 8 forward 0.910, backward 0.919 (cp = 4: 0.944 / 0.947), and with a 4096-token window at cp = 2 only
#    0.898 / 0.821 (1.67x one GPU forward+backward, #15 asks 1.8x). The forward's ranks without their merges
#    (separate per-item calls) read 0.982, so the ring's steps cost ~7% over their kernels. Where: each rank's
#    kernels, back to back, for the windowed cp = 2 backward (prediction: zero fills and fp32 passes ~1.5 ms of the
#    2 ms over T_full / 2) and the cp = 8 forward (prediction: the work-list launches with the merge epilogue
#    ~5% over the per-item kernels). Then the GPU test of NaN under a dominant sink.
if [ "$1" = 3 ]; then
  TAIL_LINES=30 stage cp_sim_window_profile 120 python3 bench/cp_sim.py --seqlens 131072 --cp 2 --balancers lpt \
    --directions fwd bwd --reps 3 --queue-ahead-ms 8 --back-to-back --window 4096 --profile-ranks 0 1 \
    --tag window-profile
  TAIL_LINES=30 stage cp_sim_fwd_profile 120 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd --reps 3 --queue-ahead-ms 8 --back-to-back --profile-ranks 0 3 --tag fwd-profile
  TAIL_LINES=8 stage tests_sink 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu ${SINK_TESTS:-}
  exit
fi
# 4: call 3 found the windowed cp = 2 backward's ranks at T_full / 2 in their main kernels (9.20 against 18.25 / 2)
#    but 1.40 ms in the dQ convert, where the whole-sequence call's takes 0.40 ms for twice the rows: the shared
#    query side's convert adds into the rank's fp32 dq from registers (8-byte pieces of 32-byte row segments, ~1.1
#    TB/s). It now stages the fragments in smem and adds each row with one bulk reduction. Prediction: the convert
#    0.3-0.4 ms, the windowed cp = 2 backward 0.82 -> 0.90, cp = 8 causal +1%. Then the GPU tests of every
#    accumulating convert (accumulate, fixed point, shared queries, work lists, cp_invariant).
if [ "$1" = 4 ]; then
  TAIL_LINES=20 stage cp_sim_window_convert 60 python3 bench/cp_sim.py --seqlens 131072 --cp 2 --balancers lpt \
    --directions bwd --reps 5 --queue-ahead-ms 8 --back-to-back --window 4096 --profile-ranks 0 --tag window-convert
  TAIL_LINES=20 stage cp_sim_b2b_convert 70 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions bwd --reps 4 --queue-ahead-ms 8 --back-to-back --tag b2b-convert
  TAIL_LINES=8 stage tests_convert 160 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_worklist_gpu.py tests/cp/test_cp_gpu.py \
    -k "accumulate or fixed_point or shared_queries or packed_per_segment or one_gradient or fp32_out or backward_ring or invariant"
  exit
fi
