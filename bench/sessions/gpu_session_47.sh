#!/usr/bin/env bash
# Prepared in the forty-fourth session (2026-12-05) for the next one. A call returns few files: run stages alone or
# in pairs, and never start a stage after a timed-out test stage on the same warm machine without its pkill (a
# killed pytest's xdist workers kept compiling and loaded the host in the forty-fourth session's calls 8-9).
# - scratch_rest: the GPU suites the forty-fourth session's carved backward scratch has not met yet (its call 7 ran
#   239 of test_cute_bwd_gpu / test_worklist_gpu / test_cp_gpu before the limit, none failed): the backends'
#   autograd paths, CUDA graph capture (the carve and the counter's zeroing are captured), then the bwd tests of
#   the forms the carve touched most (split key tiles, fixed-point dQ, deterministic tickets, packed, shared rows).
# - scratch_host: as gpu_session_46.sh (the host A/B of the carve: .kwt/base holds 13dd93a's fa4dist, the last
#   one before the carve, with this session's host_python.py and cuda_graphs.py), on a fresh machine.
# - handoff: is the device thread's per-layer cost the two threads' alternation across cores? bench/thread_handoff.py
#   unpinned and pinned to one core (on the 2-core CPU machine: hand-offs 34 -> 10 us, the work 5% slower -> not),
#   then bench/host_python.py's 8-call chain with autograd's device thread, with and without `taskset -c 2` (the
#   whole process, its device thread included, on one core) and with the calling thread.
# - fwd_long (on the H200 if lent; as gpu_session_43.sh): #11's canonical numbers.
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_47.sh [scratch_rest] [fwd_long] ...
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s47 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-scratch_rest}; do
  case $s in
    scratch_rest)
      TAIL_LINES=6 stage scratch_rest 300 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_backends_gpu.py tests/kernels/test_cuda_graphs_gpu.py
      pkill -f "pytest|xdist" 2>/dev/null
      TAIL_LINES=6 stage scratch_bwd_tail 240 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_cute_bwd_gpu.py -k "fixed_point or split or deterministic or packed or shared or one_gradient"
      pkill -f "pytest|xdist" 2>/dev/null ;;
    handoff)
      TAIL_LINES=4 stage handoff_free 60 python3 bench/thread_handoff.py
      TAIL_LINES=4 stage handoff_pinned 60 python3 bench/thread_handoff.py --pin
      for how in "device" "pinned taskset -c 2" "calling"; do
        name=${how%% *} pre=${how#"$name"}
        thread=on; [ "$name" = calling ] && thread=off
        TAIL_LINES=2 stage "chain_$name" 120 $pre python3 bench/host_python.py --device cuda --layers 8 \
          --autograd-thread $thread --calls 300 --loops 5 --timeline
      done ;;
    scratch_host)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_46.sh" scratch_host ;;
    fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_43.sh" fwd_long ;;
    *) echo "unknown stage $s (scratch_rest | handoff | scratch_host | fwd_long)"; exit 2 ;;
  esac
done
