#!/usr/bin/env bash
# Prepared in the fortieth session (2026-12-05) for the next one:
# - host: where our host time goes at short sequences. The fortieth session's bench/host_profile.py (1k, 16 heads
#   of 128, causal, B 16) read 998 us per forward+backward queued back to back with 1125 us of host time: host
#   bound (the kernels take ~640 us), where flash-attn-4 read 780 / 616 and cuDNN 843 / 338 (the third session's
#   run: ours 925 / 578, flash-attn-4 785 / 466: ours has grown). The forward alone 199 / 202 (flash-attn-4 164 /
#   152). A no-op backend through the contract and autograd costs ~120 us per forward+backward on the CPU here (a
#   bare autograd Function 38), and the cute backend's own Python with its launches replaced by no-ops (CPU tensors,
#   host.get_compiled patched) 36 us forward, 103 us backward: ~260 us of Python in all. The rest of the 1125 us is
#   the launches (tvm-ffi calls of the compiled kernels, their argument conversion), the CUDA allocations and
#   memsets, and the autograd engine's CUDA work. This stage lists it by cumulative time and by torch op.
# - graphs: the attention step captured in a CUDA graph (tests/kernels/test_cuda_graphs_gpu.py: replays give the
#   eager call's bytes, dense and packed; never run yet), then bench/cuda_graphs.py: per step eager against replayed,
#   ours / flash-attn-4 / cuDNN. Predicted: ours replays at ~0.65 ms at 16 x 1k hdim 128 (the kernels), eager ~1.0 ms.
# - graphs_tests: the graph tests alone.
# - short: as gpu_session_40.sh short, again after whatever the host stage leads to.
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_41.sh [host] [graphs] [graphs_tests] [short]
# Run in the forty-first session on one H100 (bench/RESULTS.md): the graphs pass (our capture, and torch.compile's
# reduce-overhead once a counter pool was reverted); the host stage's folders did not come back (a call returns few
# files: run host alone, or with graphs_tests).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s41 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
stages=${*:-host graphs}
for s in $stages; do
  case $s in
    host)
      for d in 128 64; do
        TAIL_LINES=4 stage "host_cum_$d" 120 python3 bench/host_profile.py --headdim $d --heads $((2048 / d)) \
          --calls 30 --top 45 --sort cumulative --torch-profile --sync-debug --launch-times --out-dir "$OUT/host_cum_$d"
      done ;;
    graphs)
      TAIL_LINES=15 stage graphs_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu -n 4 \
        tests/kernels/test_cuda_graphs_gpu.py
      TAIL_LINES=16 stage graphs 200 python3 bench/cuda_graphs.py --seqlens 1024 2048 4096 --headdims 128 64 \
        --rounds 3 --compiled --out-dir "$OUT/graphs" ;;
    graphs_tests)
      TAIL_LINES=15 stage graphs_tests 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu -n 4 \
        tests/kernels/test_cuda_graphs_gpu.py ;;
    short)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_40.sh" short ;;
    *) echo "unknown stage $s (host | graphs | graphs_tests | short)"; exit 2 ;;
  esac
done
