#!/usr/bin/env bash
# Prepared in the forty-first session (2026-12-05) for the next one (one call each; a call returns few files, so the
# stages that write folders run alone or in pairs):
# - host: bench/host_profile.py at 16 x 1k causal, hdim 128 / 64, cumulative cProfile, torch profile with CUDA API
#   rows, launch times per compiled kernel. The forty-first session trimmed our Python (~600 -> 485 calls per
#   forward+backward on the CPU, bench/host_python.py); on the H100 the step's host time was 1030 / 1280 us against
#   flash-attn-4's 505 / 432 with 758 calls against its 407. Predicted after the trims: -15-20% host time.
# - layer: bench/cuda_graphs.py --layer --compiled at 1k (each point compiles four graphs): ours in a QKV
#   projection + attention + loss, eager against torch.compile(mode="reduce-overhead"), where torch's graphs copy
#   only x (the attention-alone form copied q, k, v and dout, 256 MB a replay, and gained nothing: 1023 against
#   1042 us). Predicted at 1k hdim 128: ~1.3x.
# - short: gpu_session_40.sh short (causal 1k / 2k, device time and do_bench, with the host profile).
# - table: gpu_session_40.sh table (the #11 table on the H200).
# - layer_profile (added in the forty-second session, after call 3 found the hdim-64 layer slower under
#   torch.compile's reduce-overhead than eager, 3150 against 2755 us, and the attention alone too, 1089 against 868):
#   torch.profiler tables of 5 eager and 5 compiled steps at hdim 64 and 128 (kernels by GPU time, graph launches,
#   inductor's cudagraph counters).
# - host_cuda: bench/host_python.py on CUDA tensors (torch's allocations, fills and gradient adds real, our kernels'
#   launches no-op'd), cProfile by own time: with the choice stage's CPU-tensor row and the host stage's real one,
#   where the ~840 us between the no-op'd Python (~250 us) and the real step's host time (~1090 us) goes.
# - stacks: py-spy --native samples of 2000 forward+backward calls at 16 x 1k (bench/host_stacks.py), ours and
#   cuDNN's, summarized per thread: which of torch's C++ frames hold the ~560 us of host_cuda's torch part.
# - choice: bench/host_python.py on the GPU machine (the cute backend's remembered supports / available against
#   computed, then the Python host cost with launches no-op'd).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_42.sh [host] [layer] [short] [table]
#   [layer_profile] [choice]
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s42 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
for s in ${*:-host layer}; do
  case $s in
    host)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_41.sh" host ;;
    layer)
      TAIL_LINES=20 stage layer 300 python3 bench/cuda_graphs.py --seqlens ${LAYER_SEQLENS:-1024} --headdims 128 64 \
        --rounds 3 --layer --compiled --out-dir "$OUT/layer" ;;
    layer_profile)
      TAIL_LINES=8 stage layer_profile 300 python3 bench/cuda_graphs.py --seqlens 1024 --headdims 64 128 --rounds 2 \
        --layer --profile --out-dir "$OUT/layer_profile" ;;
    choice)
      TAIL_LINES=4 stage choice 120 python3 bench/host_python.py ;;
    host_cuda)
      TAIL_LINES=70 stage host_cuda 120 python3 bench/host_python.py --device cuda --calls 500 --loops 5 \
        --profile tottime ;;
    stacks)  # (needs py-spy in .devwheels/extra; the call carried it in place of flash-attn-4's wheels)
      pyspy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
      for b in cute cudnn; do
        TAIL_LINES=3 stage "stacks_$b" 180 "$pyspy" record --native --threads --idle --format raw --rate 1000 \
          -o "$OUT/stacks_$b.txt" -- python3 bench/host_stacks.py --calls 2000 --backend $b
        python3 bench/host_stacks.py --summarize "$OUT/stacks_$b.txt" --top 45 > "$OUT/stacks_${b}_summary.txt" 2>&1
        gzip -f "$OUT/stacks_$b.txt"
        head -60 "$OUT/stacks_${b}_summary.txt"
      done ;;
    short|table)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_40.sh" "$s" ;;
    *) echo "unknown stage $s (host | layer | short | table | layer_profile | choice | host_cuda | stacks)"; exit 2 ;;
  esac
done
