#!/usr/bin/env bash
# Prepared in the forty-fourth session (2026-12-05). A call returns few files: run stages alone or in pairs.
# - host_timeline: where the per-layer host cost of a chained backward sits. gpu_session_45.sh host_layers read
#   8 chained calls (launches no-op'd) at 3949 us with autograd's device thread against 2696 on the calling thread,
#   ~155 us more per layer, with the same 218 us backward body on either thread; bench/host_python.py --timeline
#   prints when each body starts and ends within the pass, so the gaps between bodies (or before the first / after
#   the last) show where it goes. Launches no-op'd and real, thread on and off.
# - thread_steps: bench/cuda_graphs.py --calling-thread: a short training step's attention (ours, flash-attn-4,
#   cuDNN) and ours in a QKV projection + attention + loss layer, eager with autograd's device thread against eager
#   with the backward on the calling thread (and against a CUDA graph's replay), queued back to back.
# - scratch_tests: the backward's GPU suites after its scratch became one carved allocation (lse2, dpsum, clean,
#   dQ accumulator, tickets, the tile counter and the split variant's parts: host.carve, backward.make_scratch).
# - scratch_host: the short step's host time before (.kwt/base: `git archive <commit> fa4dist bench`, this
#   session's host_python.py and cuda_graphs.py) and after, alternating: bench/host_python.py with real launches
#   (1 x 1k x 2 heads, host bound) and bench/cuda_graphs.py at 16 x 1k (eager against a CUDA graph's replay).
# - fwd_long (on the H200 if lent; as gpu_session_43.sh).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_46.sh [host_timeline] [thread_steps] [fwd_long]
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s46 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-host_timeline}; do
  case $s in
    host_timeline)
      for launches in no-op real; do
        for t in on off; do
          TAIL_LINES=3 stage "timeline_${launches}_thread_$t" 120 python3 bench/host_python.py --device cuda \
            --layers 8 --autograd-thread "$t" --launches "$launches" --calls 300 --loops 3 --timeline
        done
      done ;;
    thread_steps)
      TAIL_LINES=14 stage thread_steps 300 python3 bench/cuda_graphs.py --seqlens 1024 2048 --headdims 128 64 \
        --rounds 5 --calling-thread --out-dir "$OUT/thread_steps"
      TAIL_LINES=4 stage thread_layer 240 python3 bench/cuda_graphs.py --seqlens 1024 --headdims 128 --rounds 5 \
        --calling-thread --layer --out-dir "$OUT/thread_layer" ;;
    scratch_tests)
      TAIL_LINES=6 stage scratch_tests 360 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_worklist_gpu.py tests/cp/test_cp_gpu.py ;;
    scratch_host)
      pkill -f "pytest|xdist" 2>/dev/null; sleep 1  # (a timed-out test stage's workers would load the host)
      for round in 1 2; do
        for who in base new; do
          root=$PWD; [ $who = base ] && root=$PWD/.kwt/base
          TAIL_LINES=1 stage "host_${who}_$round" 120 bash -c "cd $root && python3 bench/host_python.py \
            --device cuda --launches real --calls ${HOST_CALLS:-500} --loops 5"
        done
      done
      for who in base new; do
        root=$PWD; [ $who = base ] && root=$PWD/.kwt/base
        TAIL_LINES=7 stage "graphs_$who" 150 bash -c "cd $root && python3 bench/cuda_graphs.py --seqlens 1024 \
          --headdims ${GRAPH_HEADDIMS:-128 64} --rounds 5 --out-dir $OUT/graphs_$who"
      done ;;
    fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_43.sh" fwd_long ;;
    *) echo "unknown stage $s (host_timeline | thread_steps | scratch_tests | scratch_host | fwd_long)"; exit 2 ;;
  esac
done
