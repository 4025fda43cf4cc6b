#!/usr/bin/env bash
# Third call for the dynamic walk, before it becomes the default of every persistent launch: non-causal grids
# (dynamic against the static walk and one CTA per tile), merges (persistent + exact_merge against one CTA per
# tile), and the work lists of a cp = 8 ring on it.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_dynamic_tiles3.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=10 stage fwd_bench_noncausal 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false --directions fwd --backends cute sdpa_cudnn flash_attn_4 \
  --cute-variants fwd:persistent_ctas=132,dynamic_tiles=1 fwd:persistent_ctas=0 --rounds 3 --out-dir "$OUT"
TAIL_LINES=6 stage accumulate 200 python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal true \
  --directions fwd --backends cute --accumulate --accumulate-seqlens 4096 16384 --accumulate-variants \
  exact_merge=1 persistent_ctas=132,dynamic_tiles=1,exact_merge=1 --rounds 3 --out-dir "$OUT/acc"
TAIL_LINES=12 stage worklist_fwd 150 python3 bench/worklist.py --tokens 131072 --cp 8 --directions fwd
FA4DIST_FWD_OVERRIDE=persistent_ctas=132,dynamic_tiles=1,exact_merge=1 TAIL_LINES=12 stage worklist_fwd_dynamic 150 \
  python3 bench/worklist.py --tokens 131072 --cp 8 --directions fwd
