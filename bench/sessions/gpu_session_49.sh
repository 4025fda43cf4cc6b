#!/usr/bin/env bash
# Prepared in the forty-fifth session (2026-12-05) for the next one. A call returns few files: run stages alone or
# in pairs.
# - marks_192: hdim 64's 192-row tiles with the deferred bad-V marks (FwdConfig.defer_v_marks, off there by default:
#   -1.2% at 4k and 16k in two H100 calls) on the H200 if lent, and the short kernels against the knob off again
#   (+1-2% on both cards): device time, beside cuDNN and flash-attn-4.
# - marks_packed_h200: packed 512 / 1024-token documents against the knob off (+2.0 / +1.6% on the H100).
# - reset_counter: FwdConfig.reset_counter (prepared in the forty-fifth session without a GPU: the forward's last
#   tile claim writes the counter back to 0 and the host reuses the stream's counter, no torch.zeros per call). Its
#   GPU tests (the stream counter reused and left at 0, another stream's own, a CUDA graph's capture; the schedule
#   fields' same-bits cases), then a copy of the package with it on by default (/tmp/reset_pkg) against this one:
#   do_bench at 1k-4k (host time shows there: our do_bench forward at 1k read 13-16 us per call further from device
#   time than cuDNN's, forty-fifth session) and bench/host_python.py with real launches. Predicted: ~15-20 us less
#   host per forward, do_bench's causal 1k forward +4-7%. If it holds and the tests pass, make it the default.
# - lanes: FA4DIST_RING_FORWARD_LANES (prepared in the forty-sixth session without a GPU: the ring forward's
#   consecutive launches merge into two running results on two streams, so one launch's last partial wave overlaps
#   the next). Its GPU tests (two streams against one stream's bytes, three runs; the staged-rank ring against the
#   oracle; the whole file, for the ring's new per-range sends), then the cp = 8 / 4 / 2 simulation with and
#   without it, one launch per step and all in one. Predicted: cp = 8 one launch per step 0.905 -> 0.93 (the
#   per-launch tails cost ~3.5%: item_forms, twenty-seventh session).
#   Then the simulated backward with the ring's own halves (MemberBackward).
# - scratch_host, handoff, fwd_long: as gpu_session_47.sh (scratch_host needs .kwt carried, a fresh machine).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_49.sh [reset_counter] [marks_192] ...
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s49 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
# the compound stages expand into their parts, which can also be named alone (a call has at most 600 s)
stages=$(echo " ${*:-marks_192} " | sed -e 's/ reset_counter / reset_tests reset_bench /g' \
  -e 's/ lanes / lanes_tests lanes_sim sim_bwd_halves /g')
for s in $stages; do
  case $s in
    marks_192)
      TAIL_LINES=20 stage marks_192 270 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:defer_v_marks=1 \
        --rounds 7 --queue-ahead-ms 3 --out-dir "$OUT/marks_192"
      TAIL_LINES=12 stage marks_short 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 \
        --causal true --directions fwd --backends cute cudnn flash_attn_4 --cute-variants fwd:defer_v_marks=0 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/marks_short" ;;
    marks_packed_h200)
      TAIL_LINES=8 stage marks_packed 150 python3 bench/packed_tiles.py --doclen 512 1024 --rounds 5 \
        --queue-ahead-ms 3 --variants defer_v_marks=0 ;;
    reset_tests)
      TAIL_LINES=6 stage reset_tests 240 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        tests/kernels/test_cute_fwd_gpu.py -k "reset_counter"
      pkill -f "pytest|xdist" 2>/dev/null ;;
    reset_bench)
      # (reset_counter is the default since the forty-seventh session: this A/B now compares the same package)
      rm -rf /tmp/reset_pkg && mkdir -p /tmp/reset_pkg && cp -r fa4dist bench /tmp/reset_pkg/
      sed -i 's/^    reset_counter: bool = False$/    reset_counter: bool = True/' /tmp/reset_pkg/fa4dist/kernels/cute/forward.py
      grep -q "^    reset_counter: bool = True$" /tmp/reset_pkg/fa4dist/kernels/cute/forward.py || echo "reset_pkg: NOT FLIPPED"
      TAIL_LINES=16 stage reset_bench 240 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 4096 \
        --causal false true --directions fwd --backends cute cudnn --baseline-dir /tmp/reset_pkg --rounds 5 \
        --out-dir "$OUT/reset_bench"
      for who in base reset; do
        root=$PWD; [ $who = reset ] && root=/tmp/reset_pkg
        TAIL_LINES=2 stage "reset_host_$who" 120 bash -c "cd $root && python3 bench/host_python.py --device cuda \
          --launches real --calls 500 --loops 5"
      done ;;
    lanes_tests)
      # the whole file: the ring's sends (one message pair per row range since the forty-sixth session, the default
      # path) through the staged transport on CUDA tensors, and the lanes' tests
      TAIL_LINES=8 stage lanes_tests 320 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cp/test_cp_gpu.py
      pkill -f "pytest" 2>/dev/null ;;
    lanes_sim)
      # (run in the forty-seventh session with --forward-lanes 1 2: the lanes read 3-5% lower and were removed)
      TAIL_LINES=24 stage lanes_sim 330 python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt \
        --directions fwd --steps-per-launch 1 0 --reps 6 --queue-ahead-ms 8 --back-to-back --tag lanes ;;
    sim_bwd_halves)
      # the simulated backward now splits the own keys' work in two halves as the ring does (MemberBackward,
      # forty-sixth session): one launch more per rank than the 0.950 recorded in the twenty-seventh session
      TAIL_LINES=8 stage sim_bwd_halves 200 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
        --directions bwd --reps 4 --queue-ahead-ms 8 --back-to-back --tag bwd_halves ;;
    scratch_host|handoff|fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_47.sh" "$s" ;;
    *) echo "unknown stage $s (marks_192 | marks_packed_h200 | reset_counter = reset_tests reset_bench | lanes =" \
         "lanes_tests lanes_sim sim_bwd_halves | scratch_host | handoff | fwd_long)"; exit 2 ;;
  esac
done
