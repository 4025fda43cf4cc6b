#!/usr/bin/env bash
# Fifty-third session (2026-12-06). The two-GPU kind is still not lent.
# Ran (calls 1-2, an H100 came for nvidia-h200): gpu_session_52.sh peer_chunks and peer_cp on the peer-chunks
# branch, all green; merged. Its transport bench: 256 MiB in 1.97 ms against 0.83-1.07 ms with the unchunked slots.
# - chunks: why. Guess: two processes share this one GPU without MPS, so each chunk's handoff (sender's copy, then
#   the receiver's) is a switch between the two processes' GPU contexts; 8 chunks of 32 MiB make 16 switches where
#   the unchunked slots made 2. Predicted: 256 MiB chunks give ~1 ms again, 8 MiB chunks ~4-5 ms (a cost per chunk,
#   ~60-120 us), and 1 MiB / 64 MiB (one or two chunks at 32 and 256) alike. Between two GPUs no context switches.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_53.sh chunks
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-chunks}; do
  case $s in
    chunks)
      for c in 32 256 8; do
        TAIL_LINES=5 stage "transport_chunk$c" 90 python3 -m torch.distributed.run --nproc-per-node 2 \
          bench/transport.py --chunk-mib "$c" --out-dir "$OUT"
      done ;;
    *) echo "unknown stage $s (chunks)"; exit 2 ;;
  esac
done
