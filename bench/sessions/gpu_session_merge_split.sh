#!/usr/bin/env bash
# Where the merge's cost goes (twelfth session): the plain forward runs on the persistent grid by default and a
# merge on one CTA per tile, so the accumulate overhead mixes the grid's gain with the merge's own bytes. Part 1
# times merges on both grids against the plain forward on both grids (FA4DIST_FWD_OVERRIDE=persistent_ctas=0 makes
# the plain side one CTA per tile too; the run recorded in bench/RESULTS.md also had tma_merge rows, a knob since
# removed); part 2 is gpu_session_persistent_bwd2.sh's packed backward rows. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_merge_split.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
common=(python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal true --directions fwd --backends cute
  --accumulate --accumulate-seqlens 4096 16384 --rounds 3)
TAIL_LINES=5 stage merge_default_grid 150 "${common[@]}" --out-dir "$OUT/default_grid" \
  --accumulate-variants persistent_ctas=132 persistent_ctas=132,exact_merge=true
FA4DIST_FWD_OVERRIDE=persistent_ctas=0 TAIL_LINES=5 stage merge_one_cta 120 "${common[@]}" --out-dir "$OUT/one_cta" \
  --accumulate-variants prefetch_running=false
OUT=$OUT bash "$(dirname "$0")/gpu_session_persistent_bwd2.sh" 2  # the packed backward rows
