#!/usr/bin/env bash
# One call on one H200: the window/softcap/sinks bench beside flash-attn-4, the HF recipe at 32k, and the ring
# simulation at cp = 8 (with and without a window).  source .devwheels/install.sh && bash bench/sessions/gpu_session_1.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=8 stage window 110 python3 bench/window.py --out-dir "$OUT"
TAIL_LINES=6 stage hf_one 85 bash bench/hf_gpu.sh one
TAIL_LINES=8 stage cp_sim 60 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --reps 2
TAIL_LINES=6 stage cp_sim_window 40 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --reps 2 \
  --window 4096
