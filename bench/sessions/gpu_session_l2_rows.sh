#!/usr/bin/env bash
# Is the causal forward's head grouping (FwdConfig.l2_rows: the K + V rows of a group of heads kept resident in L2
# together, 24 MB worth by default: 49152 rows at hdim 128, 98304 at hdim 64) right? Two leads (twelfth session,
# NOTES_FWD.md): the 4k causal merge costs ~49 us against ~20 us non-causal for the same bytes, perhaps because
# the running rows it streams push the group's K/V out of L2; and the plain causal forward at 16k trails
# flash-attn-4 (0.92x) where the non-causal one does not. One call, one run, ratios within it:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_l2_rows.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=14 stage plain_causal 220 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 --causal true \
  --directions fwd --backends cute flash_attn_4 --cute-variants fwd:l2_rows=12288 fwd:l2_rows=24576 \
  fwd:l2_rows=98304 fwd:l2_rows=196608 --rounds 3 --out-dir "$OUT/plain"
TAIL_LINES=6 stage merge_causal 150 python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal true \
  --directions fwd --backends cute --accumulate --accumulate-seqlens 4096 16384 --accumulate-variants \
  l2_rows=12288 l2_rows=24576 l2_rows=98304 --rounds 3 --out-dir "$OUT/merge"
