#!/usr/bin/env bash
# Seventeenth session: long and short causal tiles interleaved in the launch order (interleave_lengths; tile_scheduler.
# causal_m_block: n-1, 0, n-2, 1, ... instead of longest first). The lead (NOTES_FWD.md, twelfth session): a causal
# merge at 4k costs ~49 us against ~20 us non-causal for the same bytes, i.e. its running-row traffic is not hidden,
# plausibly because longest-first runs the short tiles (mostly epilogue: memory-bound) together at the end.
# Prediction: the 4k causal merge's overhead over the plain forward +10-12% -> +3-5%, 16k within noise; the plain
# causal forward and the causal backward within +-2% (their short tiles move little data), perhaps + at 1k.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_17.sh 1   # bits tests, merge / plain / bwd A/B
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s17 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
PYTEST="python3 -m pytest -x -q -p no:cacheprovider -rfE"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session17
  TAIL_LINES=4 stage bits 120 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_bwd_gpu.py \
    -k "(schedule_fields or step_forms) and interleave"
  TAIL_LINES=12 stage merge 150 python3 bench/kernels.py --headdims 128 --seqlens 4096 --causal true \
    --directions fwd --backends cute --accumulate --accumulate-seqlens 4096 16384 --accumulate-variants \
    interleave_lengths=1 persistent_ctas=132 persistent_ctas=132,interleave_lengths=1 --rounds 5 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/merge.json" 2>/dev/null
  TAIL_LINES=30 stage ab 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 --causal true \
    --directions fwd bwd --backends cute sdpa_cudnn flash_attn_4 \
    --cute-variants fwd:interleave_lengths=1 bwd:interleave_lengths=1 --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/ab.json" 2>/dev/null
  for d in 128 64; do
    TAIL_LINES=8 stage packed_$d 90 python3 bench/packed_tiles.py --direction fwd --headdim $d --doclen 512 1024 2048 \
      --variants interleave_lengths=1 --rounds 3
  done
  rm -f "$OUT"/*.png
  exit
fi
