#!/usr/bin/env bash
# Prepared in the forty-second session (2026-12-05) for the next one. A call returns few files: run stages alone or
# in pairs.
# - parts: the short step's host time in its three parts in one process each, at bench/host_python.py's sizes (the
#   GPU keeps up with the host there): our Python alone (CPU tensors, launches no-op'd), plus torch's work on CUDA
#   tensors (launches no-op'd), plus the launches (the kernels run). The forty-second session read ~250 / ~810 /
#   ~1090 us per forward+backward, the last from bench/host_profile.py at 16 x 1k in another process.
# - stacks: py-spy --native attached (--pid) to a warm loop of ours and one of cuDNN's (bench/host_stacks.py), to
#   name the C++ frames of the CUDA-tensor part. Needs py-spy in .devwheels/extra (2.9 MB: carry it in place of
#   flash-attn-4's and quack's wheels, or the call passes 64 MiB). If attaching is refused (ptrace), the log says
#   so; the forty-second session's spawned, sampled-from-the-start run spent its time limit in imports.
# - fwd_long: the #11 forward at S >= 4k in device time, 5 interleaved rounds (fortieth session on the H200: within
#   1-3% of flash-attn-4 at five of eight points).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_43.sh [parts] [stacks] [fwd_long]
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s43 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-parts}; do
  case $s in
    parts)
      TAIL_LINES=3 stage parts_cpu 120 python3 bench/host_python.py
      TAIL_LINES=2 stage parts_cuda 120 python3 bench/host_python.py --device cuda
      TAIL_LINES=2 stage parts_real 180 python3 bench/host_python.py --device cuda --launches real ;;
    stacks)
      pyspy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
      for b in cute cudnn; do
        rm -f /tmp/ready
        python3 bench/host_stacks.py --backend $b --seconds 45 --ready-file /tmp/ready > "$OUT/loop_$b.log" 2>&1 &
        loop=$!
        for _ in $(seq 120); do [ -s /tmp/ready ] && break; sleep 1; done
        TAIL_LINES=3 stage "stacks_$b" 60 "$pyspy" record --pid "$(cat /tmp/ready)" --native --threads --idle \
          --format raw --rate 200 --duration 20 -o "$OUT/stacks_$b.txt"
        wait $loop
        python3 bench/host_stacks.py --summarize "$OUT/stacks_$b.txt" --top 45 > "$OUT/stacks_${b}_summary.txt" 2>&1
        gzip -f "$OUT/stacks_$b.txt"
        head -70 "$OUT/stacks_${b}_summary.txt"
      done ;;
    fwd_long)
      TAIL_LINES=14 stage fwd_long 240 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute cudnn flash_attn_4 --rounds 5 --queue-ahead-ms 3 \
        --out-dir "$OUT/fwd_long" ;;
    *) echo "unknown stage $s (parts | stacks | fwd_long)"; exit 2 ;;
  esac
done
