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
