#!/usr/bin/env bash
# Prepared in the twenty-third session (2026-12-03), results in bench/results/2026-12-03-twenty-third-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_24.sh 1
# 1: where the cp_invariant step's time outside its kernels goes. The twenty-second session's profile of one step
#    at 32k, 32 / 32 heads: 57.5 ms of GPU kernels against 60.0 ms timed per step (a synchronize after each), while
#    plain's kernels add up to its timed step. Host time per call (queued, synced, host-only), the stacks of every
#    synchronizing operation, a cProfile of the calls, and the GPU span against the kernels' busy time of one call.
#    Prediction: a host synchronization or a long host stretch of ~2-2.5 ms inside the cp_invariant step.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
if [ "${1:-1}" = 1 ]; then
  for mode in cp_invariant plain; do
    for kv in 32 8; do
      TAIL_LINES=8 stage "host_${mode}_${kv}" 200 python3 bench/host_profile.py --seqlen 32768 --batch 1 --heads 32 \
        --kv-heads $kv --mode $mode --calls 10 --top 30 --sync-debug --out-dir "$OUT/host_${mode}_${kv}"
      TAIL_LINES=14 stage "breakdown_${mode}_${kv}" 120 python3 bench/kernel_breakdown.py --seqlen 32768 --batch 1 \
        --heads 32 --kv-heads $kv --mode $mode --calls 5 --out-dir "$OUT/breakdown_${mode}_${kv}"
    done
  done
  exit
fi
# 2: call 1 found no host gap in the cp_invariant step (0 synchronizing operations; 2.3 ms of host per step against
#    58.9 ms of kernels with no idle span): its cost is the backward kernel (44.7 ms against plain's 35.7). Here, the
#    short causal forward against cuDNN (#11: hdim 64 causal 1k at 0.90-0.92x cuDNN). bench/kernels.py times each call
#    between two events after triton's L2 flush, so host time before a launch beyond the flush shows as GPU idle.
#    Host time per forward call (the contract's attention_forward as kernels.py calls it, fa4dist.attention and
#    flash-attn-4), the GPU kernels' own time per call, and the bench row. Prediction: ours ~200 us of host per
#    forward against cuDNN's ~40, and kernel time alone within 3% of cuDNN's timed row.
if [ "$1" = 2 ]; then
  for d in 64 128; do
    TAIL_LINES=4 stage "host_fwd_1k_d$d" 150 python3 bench/host_profile.py --seqlen 1024 --batch 16 --heads $((2048 / d)) \
      --headdim $d --contract --calls 50 --top 40 --out-dir "$OUT/host_fwd_1k_d$d"
    grep "us/call" "$OUT/host_fwd_1k_d$d.log"
    TAIL_LINES=16 stage "breakdown_1k_d$d" 120 python3 bench/kernel_breakdown.py --seqlen 1024 --batch 16 \
      --heads $((2048 / d)) --headdim $d --calls 20 --out-dir "$OUT/breakdown_1k_d$d"
  done
  TAIL_LINES=12 stage kernels_1k 200 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 --causal true \
    --directions fwd --backends cute cudnn sdpa_flash flash_attn_4 --rounds 5 --out-dir "$OUT/kernels_1k"
  exit
fi
# 3: call 2 found the hdim-64 causal 1k forward kernel itself at 225 us against cuDNN's timed 212 (host is not
#    what the bench row lacks), but forward+backward through autograd host-bound at 1k: 958 us of host per call
#    against 929 us of GPU kernels (flash-attn-4: 599 us of host). The backward now remembers its configs and
#    compiled kernels per distinct call (backward._compiled_configs; make_configs alone is ~50 us of Python on a slow
#    CPU). Host time of the contract's backward alone and of fa4dist.attention forward+backward, with torch.profiler's
#    CPU table, this tree against the commit before it (.kwt/base: its fa4dist, these bench scripts). Prediction:
#    -30 to -60 us per backward; the rest of the ~760 us is to be found in the tables. Then the backward GPU suites.
if [ "$1" = 3 ]; then
  for tree in . .kwt/base; do
    tag=$([ "$tree" = . ] && echo new || echo base)
    TAIL_LINES=0 stage "host_1k_d64_$tag" 150 python3 "$tree/bench/host_profile.py" --seqlen 1024 --batch 16 \
      --heads 32 --headdim 64 --contract --calls 50 --top 30 --torch-profile --out-dir "$OUT/host_1k_$tag"
    grep "us/call" "$OUT/host_1k_d64_$tag.log"
  done
  TAIL_LINES=6 stage tests_bwd 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_backends_gpu.py
  exit
fi
# 4: the GPU suites the backward's remembered configs touch (launch_steps: fresh, accumulating, shared rows, fixed
#    point), after the hardening commits: the CP GPU tests (staged ranks, shared query side), the work lists, the
#    backward kernels, the backends.
if [ "$1" = 4 ]; then
  TAIL_LINES=4 stage tests_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/cp/test_cp_gpu.py
  TAIL_LINES=4 stage tests_worklist 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_worklist_gpu.py
  TAIL_LINES=4 stage tests_bwd 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_cute_bwd_gpu.py
  exit
fi
