#!/usr/bin/env bash
# The persistent backward grid (key tiles claimed from a counter, bwd_sm90.FlashBwdSm90.persistent) and the rotated
# deterministic order (det_resident): their variants compiled on the machine's 16 cores, the bits tests against one
# CTA per tile / the ascending order, the speed table beside flash-attn-4 and the defaults, the backward suite with
# every launch forced onto a 132-CTA grid, then the ring simulation's backward on it.
# Three device calls (each within the 600 s limit; the AOT stage skips objects a warm machine kept):
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent_bwd.sh 1   # bits tests, speed table
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent_bwd.sh 2   # suites, ring backward
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent_bwd.sh 3   # forward: merges, hdim 96
set -u
part=${1:-1}
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/persistent_bwd FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ "$part" = 3 ] || TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set persistent_bwd
if [ "$part" = 1 ]; then
TAIL_LINES=6 stage bits 150 python3 -m pytest -x -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_bwd_gpu.py -k "persistent_grid or rotated_deterministic or longest_first"
TAIL_LINES=30 stage bwd_bench 280 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false true --directions bwd --deterministic --backends cute flash_attn_4 \
  --cute-variants bwd:persistent_ctas=132 bwd:persistent_ctas=0 bwd-det:det_resident=true \
  --rounds 3 --warmup-ms 15 --rep-ms 60 --out-dir "$OUT"
fi
if [ "$part" = 2 ]; then
# the default kernels first (one CTA per tile: their PTX moved with the refactor, the same operations), then on the grid
TAIL_LINES=6 stage bwd_suite 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "not persistent_grid and not rotated and not longest_first"
FA4DIST_BWD_OVERRIDE=persistent_ctas=132 TAIL_LINES=6 stage bwd_suite_persistent 150 python3 -m pytest -q \
  -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py -k "not persistent_grid and not rotated and not longest_first"
# the ring simulation's backward as it is, then with every launch (the whole-sequence one too) on the grid
TAIL_LINES=6 stage cp_sim_bwd 90 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
  --directions bwd --reps 3 --tag bwd
FA4DIST_BWD_OVERRIDE=persistent_ctas=132 TAIL_LINES=6 stage cp_sim_bwd_persistent 90 python3 bench/cp_sim.py \
  --seqlens 131072 --cp 8 --balancers lpt --directions bwd --reps 3 --tag bwd-persistent
fi
if [ "$part" = 3 ]; then
# the forward's merges on the persistent grid, exact merges on both sides: one merge launch against a plain
# forward (the accumulate target: within 2%), then the ring simulation's forward
TAIL_LINES=8 stage merge_cost 120 python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal false true \
  --directions fwd --backends cute --accumulate --accumulate-seqlens 4096 16384 \
  --accumulate-variants exact_merge=true persistent_ctas=132,exact_merge=true --rounds 3 --out-dir "$OUT"
# hdim 96 causal forward on the persistent grid with a 32 / 232 register split (spill-free; 24 / 240 spills)
TAIL_LINES=4 stage d96_bits 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  -k "persistent_grid and d96"
TAIL_LINES=8 stage d96_bench 100 python3 bench/kernels.py --headdims 96 --seqlens 1024 4096 16384 --causal true \
  --directions fwd --backends cute sdpa_cudnn flash_attn_4 --cute-variants fwd:persistent_ctas=132,regs_producer=32 \
  --rounds 3 --out-dir "$OUT"
# (the whole-sequence call is on the persistent grid in both: only the merges differ)
for override in exact_merge=true exact_merge=true,persistent_ctas=132; do
  FA4DIST_FWD_OVERRIDE=$override TAIL_LINES=4 stage "cp_sim_fwd_${override//[=,]/_}" 100 \
    python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt --directions fwd --reps 5 \
    --tag "fwd-${override//[=,]/-}"
done
fi
